"""A training run a user can judge: text to tokens, 200 steps with a held-out
validation loss, and its picture.

    OMP_NUM_THREADS=1 python benchmarks/train_validation.py             # 2 CPU ranks, bytes
    python benchmarks/train_validation.py --ranks 1 --steps 50
    python benchmarks/train_validation.py --tokenizer ~/my-tokenizer    # a local HF tokenizer
    OMP_NUM_THREADS=1 python benchmarks/train_validation.py --hf        # transformers' Llama

Every step is the command a user types (subprocesses, ``OMP_NUM_THREADS=1``):

1. ``planner data TEXT -o DATA``: this repository's own Markdown (README.md,
   docs/design.md) as one text, bytes as tokens (vocabulary 256), or the
   tokens of ``--tokenizer FOLDER``; the last 10 % of the tokens go to
   ``val.bin``.
2. ``planner plan --model MODEL.py:make --cluster local-cpu:RANKS``: the
   planner's own choice of plan. The model is gpt-tiny's shape (2 layers,
   width 64, 4 heads, 32 tokens a row, batch 8) with a vocabulary that holds
   the data's: the zoo's gpt-tiny has 128 ids, fewer than bytes' 256, so a
   factory file with the vocabulary of the data folder's ``meta.json``
   (rounded up to a multiple of 64) is written to the work folder. With
   ``--hf``, the model is transformers' ``LlamaForCausalLM`` of the same size
   (``--model hf:llama,...``, 2 layers, width 64, 4 heads of which 2 K/V
   heads, that vocabulary).
3. ``planner train PLAN --data DATA --steps 200 --eval-every 20 --eval-batches
   8 --log .../train.jsonl``: AdamW, lr 1e-3, 10 warm-up steps, cosine decay
   to 0.1 x lr, gradients clipped to 1.0; the validation loss is the mean over
   the same 8 held-out batches (2,048 tokens) after every 20th step.

Writes ``benchmarks/results/train_validation.json`` (``train_validation_hf.json``
with ``--hf``: machine, commands, wall
times, the data's meta.json, the plan's layout, every logged training loss,
every validation loss and whether it fell) and, in
``benchmarks/results/train_validation/`` (``train_validation_hf/``), copies of the job's own
``train.jsonl`` and of the ``loss.png`` that ``planner train`` drew beside it. Work files go to
``--workdir`` (default: a new temporary folder).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.common import (RESULTS_DIR, file_tail, git_commit, job_env, load_average,  # noqa: E402
                               machine_block, report_results)

RESULT_PATH = os.path.join(RESULTS_DIR, "train_validation.json")
RUN_DIR = os.path.join(RESULTS_DIR, "train_validation")
RESULT_PATH_HF = os.path.join(RESULTS_DIR, "train_validation_hf.json")
RUN_DIR_HF = os.path.join(RESULTS_DIR, "train_validation_hf")
#: transformers' Llama of gpt-tiny's size, with the data's vocabulary
HF_MODEL = ("hf:llama,num_hidden_layers=2,hidden_size=64,intermediate_size=128,"
            "num_attention_heads=4,num_key_value_heads=2,vocab_size={vocab},"
            "max_position_embeddings=64")
TEXTS = ("README.md", "docs/design.md")
#: the training settings of the run
TRAIN = {"lr": 1e-3, "warmup": 10, "grad_clip": 1.0, "eval_every": 20, "eval_batches": 8,
         "log_every": 10}
#: gpt-tiny's shape; the vocabulary is the data's
MODEL_FILE = '''"""gpt-tiny's shape with a vocabulary of {vocab} ids (written by
benchmarks/train_validation.py)."""
import torch

from models.zoo import build_from_config
from models.zoo.gpt import GPTConfig


def make():
    config = GPTConfig(n_layer=2, n_embd=64, n_head=4, vocab_size={vocab}, block_size=32)
    return build_from_config(config, device=torch.get_default_device(), batch_size=8, seq_len=32)
'''
TIMEOUT_S = 1800


def _planner(args: list[str], log: list[dict[str, Any]]) -> str:
    """Run ``planner ARGS`` from the repository root; its output. Records the
    command and its wall time in ``log``; exits with the command's output on
    a failure."""
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "app.cli", *args], cwd=ROOT, env=job_env(),
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    wall = time.perf_counter() - t0
    log.append({"command": "planner " + " ".join(args), "wall_s": round(wall, 2),
                "returncode": proc.returncode})
    print(f"{wall:6.1f} s  planner {' '.join(args)}", flush=True)
    if proc.returncode != 0:
        sys.exit(f"failed ({proc.returncode}): planner {' '.join(args)}\n"
                 f"{(proc.stdout + proc.stderr)[-3000:]}")
    return proc.stdout + proc.stderr


def _text(workdir: str) -> str:
    """This repository's Markdown as one text file."""
    path = os.path.join(workdir, "docs.txt")
    with open(path, "wb") as out:
        for name in TEXTS:
            with open(os.path.join(ROOT, name), "rb") as f:
                out.write(f.read())
    return path


def _verdict(val: list[dict[str, float]]) -> dict[str, Any]:
    """Whether the validation loss fell: first and last, the best, and how
    many validations were below the one before."""
    losses = [e["loss"] for e in val]
    if not losses:
        return {"falls": None}
    return {"first": losses[0], "last": losses[-1], "best": min(losses),
            "best_step": val[losses.index(min(losses))]["step"] + 1,
            "falls": losses[-1] < losses[0],
            "decreases": sum(b < a for a, b in zip(losses, losses[1:])),
            "validations": len(losses)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2, help="CPU ranks (default 2)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--tokenizer", help="a local Hugging Face tokenizer folder (default: bytes)")
    ap.add_argument("--hf", action="store_true",
                    help="train transformers' Llama of gpt-tiny's size instead")
    ap.add_argument("--workdir", help="work files (default: a new temporary folder)")
    ap.add_argument("--output", help=f"the result JSON (default {RESULT_PATH}, "
                    f"or {RESULT_PATH_HF} with --hf)")
    ap.add_argument("--run-dir", help="where the job's train.jsonl and loss.png go "
                    f"(default {RUN_DIR}, or {RUN_DIR_HF} with --hf)")
    args = ap.parse_args(argv)
    args.output = args.output or (RESULT_PATH_HF if args.hf else RESULT_PATH)
    args.run_dir = args.run_dir or (RUN_DIR_HF if args.hf else RUN_DIR)
    workdir = args.workdir or tempfile.mkdtemp(prefix="train-validation-")
    os.makedirs(workdir, exist_ok=True)
    loadavg = load_average()
    t0 = time.perf_counter()
    commands: list[dict[str, Any]] = []

    data = os.path.join(workdir, "data")
    _planner(["data", _text(workdir), "-o", data, *(["--tokenizer", args.tokenizer]
                                                    if args.tokenizer else [])], commands)
    with open(os.path.join(data, "meta.json")) as f:
        meta = json.load(f)
    vocab = -(-int(meta["vocab_size"]) // 64) * 64
    if args.hf:
        model_args = ["--model", HF_MODEL.format(vocab=vocab), "--batch-size", "8",
                      "--seq-len", "32"]
    else:
        model = os.path.join(workdir, "model.py")
        with open(model, "w") as f:
            f.write(MODEL_FILE.format(vocab=vocab))
        model_args = ["--model", f"{model}:make"]
    plan = os.path.join(workdir, "plan.json")
    _planner(["plan", *model_args, "--cluster", f"local-cpu:{args.ranks}", "--quiet", "-o", plan],
             commands)
    with open(plan) as f:
        layout = json.load(f)
    log = os.path.join(workdir, "run", "train.jsonl")
    if os.path.exists(log):
        os.remove(log)  # the log is appended to: start this run's afresh
    result_json = os.path.join(workdir, "result.json")
    _planner(["train", plan, "--data", data, "--steps", str(args.steps),
              "--lr", str(TRAIN["lr"]), "--warmup", str(TRAIN["warmup"]),
              "--grad-clip", str(TRAIN["grad_clip"]), "--eval-every", str(TRAIN["eval_every"]),
              "--eval-batches", str(TRAIN["eval_batches"]), "--log-every",
              str(TRAIN["log_every"]), "--log", log, "--result-json", result_json], commands)
    with open(result_json) as f:
        run = json.load(f)
    with open(log) as f:
        logged = [json.loads(line) for line in f if line.strip()]
    os.makedirs(args.run_dir, exist_ok=True)
    for name in ("train.jsonl", "loss.png"):  # what planner train wrote, not the ranks' log
        shutil.copyfile(os.path.join(os.path.dirname(log), name), os.path.join(args.run_dir, name))
    pipeline = layout.get("pipeline") or {}
    result = {
        "benchmark": "train_validation", "git_commit": git_commit(),
        "machine": machine_block(loadavg, after=True), "wall_s": time.perf_counter() - t0,
        "ranks": args.ranks, "steps": args.steps, "settings": TRAIN,
        "model": {"shape": ("transformers' LlamaForCausalLM" if args.hf else "gpt-tiny")
                  + " (2 layers, width 64, 4 heads, batch 8 x 32)",
                  "vocab_size": vocab, "why": "gpt-tiny's vocabulary (128) is below the data's"
                  if vocab > 128 and not args.hf else None},
        "data": {"texts": list(TEXTS), **{k: meta[k] for k in ("dtype", "vocab_size", "tokenizer",
                                                                "tokens", "val_fraction")}},
        "plan": {"mesh": layout["mesh"].get("shape"), "schedule": pipeline.get("schedule"),
                 "stages": len(pipeline.get("stages", [])) or 1,
                 "num_microbatches": pipeline.get("num_microbatches")},
        "commands": commands,
        "train_losses": [{"step": r["step"] + 1, "loss": r["loss"]} for r in logged],
        "val_losses": [{"step": e["step"] + 1, "loss": e["loss"]} for e in run["val_losses"]],
        "final_loss": run["final_loss"], "final_val_loss": run["final_val_loss"],
        "validation": _verdict(run["val_losses"]),
        "median_step_s": sorted(run["step_times_s"])[len(run["step_times_s"]) // 2],
        "plot": os.path.relpath(os.path.join(args.run_dir, "loss.png"), ROOT),
        "log_tail": file_tail(log + ".ranks.log", 3),
    }
    v = result["validation"]
    return report_results(args.output, result, [
        f"validation loss {v['first']:.4f} (step {TRAIN['eval_every']}) -> {v['last']:.4f} "
        f"(step {args.steps}); falls: {v['falls']}; training loss {run['final_loss']:.4f}"])


if __name__ == "__main__":
    sys.exit(main())
