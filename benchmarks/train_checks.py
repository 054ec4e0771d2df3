"""``planner train`` on 4 CPU ranks checked against one process: loss curves,
a crash and its resume, and a new plan mid-training.

    OMP_NUM_THREADS=1 python benchmarks/train_checks.py            # everything (~12 min on 2 cores)
    python benchmarks/train_checks.py --checks curves --models gpt-tiny --steps 50

Every run is the command a user types, ``planner train PLAN.json --data
TOKENS.bin ...`` (a subprocess: torchrun, gloo, 4 ranks, ``OMP_NUM_THREADS=1``),
fp32, AdamW with lr 1e-3, 10 warm-up steps then cosine decay to 0.1 x lr, and
the gradient norm clipped to 1.0. The data is real text: this repository's
README.md and docs/design.md, bytes >= 128 dropped (gpt-tiny's vocabulary is
128), repeated to about 300 KB and written as byte tokens
(:func:`training.data.bytes_to_tokens`).

Models: ``gpt-tiny`` (the zoo's) and ``hf-qwen2``, a tiny untied Qwen2 built
by ``transformers`` (:data:`HF_SPEC`, batch 8 x 32 tokens; tied embeddings
cannot be pipelined) with ``use_cache=false`` and ``attn_implementation=eager``:
with the library's defaults (:data:`HF_SPEC_DEFAULT`) the zero3 and pp2 plans
do not run (the KV cache's empty tensors are captured as lifted constants,
which the planner makes stage inputs; SDPA's boolean causal mask would cross
the pp=2 stage boundary, which carries floating values only). Check 1 records
that too: those two plans of the default model, 2 steps each, and the ranks'
first error line (``hf_default_spec_probe``). Plans, each on ``local-cpu:4``:

* ``2x2``: ``planner plan --mesh 2x2`` (one stage, the ILP's layout on a 2x2 mesh);
* ``pp2``: ``planner plan --pp 2 --schedule 1f1b`` (a 2-stage 1F1B pipeline,
  the search's stage meshes, micro-batches and ZeRO stage);
* ``zero3``: :func:`planner.api.pipeline_plan` with ``pp=1``, stage mesh
  (4,), ``zero_stage=3`` and 2 micro-batches (one FSDP2 stage over 4 ranks,
  the ILP's layout inside it);
* ``pp2-zero3`` (gpt-tiny, check 3 only): ``planner plan --pp 2 --schedule
  1f1b --zero 3``.

Checks:

1. ``curves``: each model under each plan for ``--steps`` (200) steps; every
   step's loss against :func:`training.reference.train_one_process` of
   the same settings (eager, one process, the plan's micro-batch count); the
   maximum relative error over all steps must be <= 1e-4 (:data:`LOSS_RTOL`).
   The run also exports its weights, compared with the one-process run's
   final parameters (max |a - b| / max |b| per tensor, the worst reported).
2. ``crash``: gpt-tiny 2x2, 20 steps, ``--save-every 5``,
   ``PLANNER_TRAIN_FAULT=1:12`` (rank 1 SIGKILLs itself at step 12),
   ``--max-restarts 1``, ``--export``: torchrun restarts the ranks, which
   resume from step 10 by themselves. Checked: ``restarts == 1``,
   ``start_step == 10``, ``resumed_from`` ends in ``step_00000010``, and the
   exported weights equal an uninterrupted 20-step run's (same plan) within
   1e-6 (:data:`WEIGHT_RTOL`, of the model's largest entry:
   :func:`benchmarks.training_diff.weight_diff`), the losses of steps 10..19
   within 1e-6 too.
3. ``replan``: gpt-tiny 2x2, ``--steps 20 --save-every 10``, rank 1 killed at
   step 11 and ``--max-restarts 0``, so the job stops with the save of step
   10; then ``--resume --steps 20`` under the pp=2 ZeRO-3 plan from that save
   (DCP resharding it), exported and compared with the uninterrupted 2x2
   20-step run of check 2: weights within 1e-6, losses of steps 10..19.

Writes ``benchmarks/results/train_checks.json`` (machine, settings, the plans,
every run's command, wall time, losses and verdict; running some checks keeps
the others' results) and ``benchmarks/results/loss.png`` (check 1: the loss
curves and each plan's relative error against one process, per step). Work
files (plans, tokens, checkpoints, exports, the ranks' logs) go to
``--workdir`` (default: a new temporary folder).
"""

from __future__ import annotations

import argparse
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

from benchmarks.common import RESULTS_DIR, file_tail, git_commit, job_env, load_average  # noqa: E402
from benchmarks.common import machine_block, read_results, write_results, wrote_message  # noqa: E402
from benchmarks.train_job import CLUSTER, RANKS, doc_tokens, planner_argv, read_result  # noqa: E402
from benchmarks.training_diff import loss_diff, weight_diff  # noqa: E402

#: model name -> (model spec, planning flags of its example step)
#: the tiny Qwen2 as transformers builds it by default (KV cache on, SDPA
#: attention): its pipeline plans do not run (:func:`probe_default_hf`)
HF_SPEC_DEFAULT = ("hf:qwen2,num_hidden_layers=2,hidden_size=64,intermediate_size=128,"
                   "num_attention_heads=4,num_key_value_heads=2,vocab_size=256,"
                   "tie_word_embeddings=false")
#: the one trained: no KV cache (its empty cache tensors are captured as lifted
#: constants, which the planner treats as user inputs) and eager attention
#: (SDPA's boolean mask would cross the pp=2 stage boundary, which carries
#: floating values only); the same model and loss otherwise
HF_SPEC = HF_SPEC_DEFAULT + ",use_cache=false,attn_implementation=eager"
MODELS: dict[str, tuple[str, dict[str, int]]] = {
    "gpt-tiny": ("gpt-tiny", {}),
    "hf-qwen2": (HF_SPEC, {"batch_size": 8, "seq_len": 32}),
}
PLANS = ("2x2", "pp2", "zero3")
CHECKS = ("curves", "crash", "replan")
#: the training settings of every run
TRAIN = {"lr": 1e-3, "warmup": 10, "grad_clip": 1.0, "min_lr_ratio": 0.1, "optimizer": "adamw"}
LOSS_RTOL = 1e-4  # check 1: max relative loss error over all steps
WEIGHT_RTOL = 1e-6  # checks 2 and 3: max |a - b| over the model's largest |b| (weight_diff)
RESUME_STEPS = 20
GPT_TINY_VOCAB = 128
TEXT_BYTES = 300_000


# ------------------------------------------------------------------ helpers

def _planner(args: list[str], log: str, env: dict[str, str] | None = None
             ) -> tuple[int, float]:
    """Run ``planner ARGS`` (``python -m app.cli``) with its output in ``log``;
    (exit status, wall seconds)."""
    t0 = time.perf_counter()
    with open(log, "w") as f:
        f.write("planner " + " ".join(args) + "\n")
        f.flush()
        rc = subprocess.run(planner_argv(args), cwd=ROOT, env=job_env(env), stdout=f,
                            stderr=subprocess.STDOUT).returncode
    return rc, round(time.perf_counter() - t0, 2)



def _ranks_log(planner_log: str) -> str:
    """The ranks' log a failed ``planner train`` names (its error line)."""
    import re

    for line in file_tail(planner_log, 20):
        found = re.search(r"the ranks' output: (\S+?)\)?$", line)
        if found:
            return found.group(1)
    return ""


def _train_args(plan: str, tokens: str, steps: int, result: str, *extra: str) -> list[str]:
    return ["train", plan, "--data", tokens, "--steps", str(steps), "--lr", str(TRAIN["lr"]),
            "--warmup", str(TRAIN["warmup"]), "--grad-clip", str(TRAIN["grad_clip"]),
            "--min-lr-ratio", str(TRAIN["min_lr_ratio"]), "--optimizer", TRAIN["optimizer"],
            "--log-every", "20", "--result-json", result, *extra]


def train_run(name: str, workdir: str, plan: str, tokens: str, steps: int, *extra: str,
              env: dict[str, str] | None = None, expect_ok: bool = True) -> dict[str, Any]:
    """One ``planner train`` run: its command, exit status, wall time and
    result JSON (None where the job wrote none)."""
    folder = os.path.join(workdir, "runs", name)
    if os.path.exists(folder):
        shutil.rmtree(folder)
    os.makedirs(folder)
    result = os.path.join(folder, "result.json")
    extra = tuple(a.replace("{run}", folder) for a in extra)
    args = _train_args(plan, tokens, steps, result, *extra)
    log = os.path.join(folder, "planner.log")
    print(f"[{name}] planner {' '.join(args)}" + (f"  (env {env})" if env else ""), flush=True)
    rc, wall = _planner(args, log, env)
    out: dict[str, Any] = {"name": name, "command": "planner " + " ".join(args),
                           "env": env or {}, "returncode": rc, "wall_s": wall, "folder": folder,
                           "result": read_result(result)}
    if (rc == 0) != expect_ok or (expect_ok and out["result"] is None):
        out["error_tail"] = file_tail(log, 6) + file_tail(_ranks_log(log), 12)
    print(f"[{name}] exit {rc} in {wall:.0f} s", flush=True)
    return out


def _losses(run: dict[str, Any]) -> dict[int, float]:
    res = run.get("result") or {}
    return {int(e["step"]): float(e["loss"]) for e in res.get("losses", [])}


def _exported(folder: str) -> dict[str, Any]:
    from safetensors.torch import load_file

    return load_file(os.path.join(folder, "model.safetensors"))


# --------------------------------------------------------------- data, plans
def make_tokens(workdir: str) -> tuple[str, dict[str, Any]]:
    """ASCII text of this repository's README.md and docs/design.md, repeated
    to about :data:`TEXT_BYTES` bytes, as a uint16 byte-token file
    (:func:`benchmarks.train_job.doc_tokens`)."""
    path, info = doc_tokens(workdir, TEXT_BYTES, below=GPT_TINY_VOCAB)
    # the text is this checkout's docs: another commit gives other batches
    return path, {"sources": info["sources"], "sha256": info["sha256"],
                  "ascii_bytes": info["kept_bytes"], "dropped_bytes": info["dropped_bytes"],
                  "repeats": info["repeats"], "tokens": info["tokens"]}


def _summary(plan: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"mesh": list(plan.mesh_shape), "precision": plan.precision.name,
                           "source": plan.model.get("source"),
                           "zoo_kwargs": dict((plan.training or {}).get("zoo_kwargs", {})),
                           "predicted_step_s": plan.predicted.get("step_time_s")}
    if plan.pipeline is not None:
        pipe = plan.pipeline
        out.update(pp=pipe.pp, schedule=pipe.schedule, num_microbatches=pipe.num_microbatches,
                   stage_mesh=list(pipe.stage_mesh["shape"]),
                   zero_stages=[st.zero_stage for st in pipe.stages],
                   stage_inputs=[sorted(st.inputs) for st in pipe.stages])
    return out


def make_plan(model_name: str, kind: str, workdir: str) -> tuple[str, dict[str, Any]]:
    """Plan ``kind`` of ``model_name``; (path, summary). Raises RuntimeError
    when planning fails or gives another kind of plan."""
    from plan.format import load_plan

    spec, kwargs = MODELS[model_name]
    path = os.path.join(workdir, "plans", f"{model_name}-{kind}.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    log = path[:-5] + ".log"
    t0 = time.perf_counter()
    how: str
    if kind == "zero3":
        from models.source import build_model
        from planner.api import pipeline_plan

        model, inputs = build_model(spec, device="meta", seed=0, **kwargs)
        plan = pipeline_plan(model, CLUSTER, example_inputs=inputs, pp=1, stage_mesh=(4,),
                             schedule="1f1b", num_microbatches=2, zero_stage=3,
                             model_source=spec, zoo_kwargs=kwargs, precision="fp32",
                             time_limit_s=30.0)
        plan.save(path)
        how = ("planner.api.pipeline_plan(model, 'local-cpu:4', pp=1, stage_mesh=(4,), "
               "schedule='1f1b', num_microbatches=2, zero_stage=3, precision='fp32')")
    else:
        flags = {"2x2": ["--mesh", "2x2"], "pp2": ["--pp", "2", "--schedule", "1f1b"],
                 "pp2-zero3": ["--pp", "2", "--schedule", "1f1b", "--zero", "3"]}[kind]
        sizes = [a for k, v in kwargs.items() for a in ("--" + k.replace("_", "-"), str(v))]
        args = ["plan", "--model", spec, "--cluster", CLUSTER, *flags, *sizes,
                "--precision", "fp32", "--quiet", "-o", path]
        rc, _ = _planner(args, log)
        if rc != 0:
            raise RuntimeError(f"planner {' '.join(args)} exited {rc}: {file_tail(log, 3)}")
        how = "planner " + " ".join(args)
    summary = {"how": how, "plan_s": round(time.perf_counter() - t0, 1),
               **_summary(load_plan(path))}
    want_pp = {"2x2": None, "pp2": 2, "zero3": 1, "pp2-zero3": 2}[kind]
    if summary["source"] != spec:
        raise RuntimeError(f"{model_name} {kind}: plan records model source "
                           f"{summary['source']!r}, not {spec!r}")
    if want_pp is None and summary.get("pp") is not None:
        raise RuntimeError(f"{model_name} {kind}: a pipeline plan, not one stage")
    if want_pp is not None and (summary.get("pp") != want_pp
                                or summary.get("schedule") not in ("1f1b", "1F1B")):
        raise RuntimeError(f"{model_name} {kind}: pp={summary.get('pp')} "
                           f"schedule={summary.get('schedule')}, not a pp={want_pp} 1F1B plan")
    if "zero3" in kind and set(summary["zero_stages"]) != {3}:
        raise RuntimeError(f"{model_name} {kind}: zero stages {summary['zero_stages']}, not 3")
    if kind == "2x2" and summary["mesh"] != [2, 2]:
        raise RuntimeError(f"{model_name} 2x2: mesh {summary['mesh']}")
    print(f"[plan] {model_name} {kind}: {summary}", flush=True)
    return path, summary


def reference(plan_path: str, tokens: str, steps: int) -> Any:
    """:func:`training.reference.train_one_process` of the job's settings
    on the plan's model, batches and micro-batch count."""
    from plan.format import load_plan
    from training.data import TokenFile
    from training.reference import train_one_process

    plan = load_plan(plan_path)
    source = plan.model["source"]
    from codegen.plan_model import build_plan_model

    _, inputs = build_plan_model(plan, "meta")
    batch_size, seq_len = inputs[0].shape
    vocab = GPT_TINY_VOCAB if not source.startswith("hf:") else 256
    data = TokenFile(tokens, batch_size=int(batch_size), seq_len=int(seq_len), vocab_size=vocab,
                     targets="same" if source.startswith("hf:") else "shifted")
    return train_one_process(plan, data.batch, steps=steps, lr=TRAIN["lr"],
                             warmup=TRAIN["warmup"], min_lr_ratio=TRAIN["min_lr_ratio"],
                             grad_clip=TRAIN["grad_clip"], optimizer=TRAIN["optimizer"])


def _reference_names(model_name: str, state: dict[str, Any]) -> dict[str, Any]:
    """One process's parameters under the export's names (Hugging Face's drop
    our ``hf.`` prefix)."""
    if MODELS[model_name][0].startswith("hf:"):
        return {k[3:] if k.startswith("hf.") else k: v for k, v in state.items()}
    return dict(state)


# -------------------------------------------------------------------- checks
def check_curves(workdir: str, tokens: str, models: list[str], steps: int,
                 plans: dict[str, Any]) -> dict[str, Any]:
    """Check 1 for each model: three plans against one process."""
    out: dict[str, Any] = {"steps": steps, "rtol": LOSS_RTOL, "models": {}}
    for model_name in models:
        refs: dict[int, Any] = {}
        entry: dict[str, Any] = {"spec": MODELS[model_name][0], "plans": {}, "reference": {}}
        for kind in PLANS:
            row: dict[str, Any] = {"passed": False}
            entry["plans"][kind] = row
            try:
                path, summary = make_plan(model_name, kind, workdir)
            except Exception as err:  # noqa: BLE001 - recorded, the grid goes on
                row["error"] = f"planning: {type(err).__name__}: {str(err)[:400]}"
                print(f"[{model_name} {kind}] {row['error']}", flush=True)
                continue
            plans[f"{model_name}/{kind}"] = summary
            parts = summary.get("num_microbatches") or 1
            if parts not in refs:
                t0 = time.perf_counter()
                refs[parts] = reference(path, tokens, steps)
                entry["reference"][f"microbatches={parts}"] = {
                    "wall_s": round(time.perf_counter() - t0, 2),
                    "losses": [round(x, 7) for x in refs[parts].losses]}
            ref = refs[parts]
            run = train_run(f"curves-{model_name}-{kind}", workdir, path, tokens, steps,
                            "--export", "{run}/export")
            got = _losses(run)
            want = dict(enumerate(ref.losses))
            ld = loss_diff(got, want)
            row.update(microbatches=parts, returncode=run["returncode"], wall_s=run["wall_s"],
                       command=run["command"], loss=ld,
                       losses=[[s, got[s]] for s in sorted(got)],
                       rel_err_per_step=[[s, abs(got[s] - want[s]) / abs(want[s])]
                                         for s in sorted(got) if s in want],
                       peak_bytes=[r["peak_bytes"] for r in
                                   (run["result"] or {}).get("ranks", []) or []])
            if "error_tail" in run:
                row["error_tail"] = run["error_tail"]
            if run["returncode"] == 0 and os.path.exists(os.path.join(run["folder"], "export")):
                row["final_weights_vs_one_process"] = weight_diff(
                    _exported(os.path.join(run["folder"], "export")),
                    _reference_names(model_name, ref.state))
            row["passed"] = bool(run["returncode"] == 0 and ld["steps_compared"] == steps
                                 and ld["max_rel_err"] is not None
                                 and ld["max_rel_err"] <= LOSS_RTOL)
            print(f"[{model_name} {kind}] max rel loss err {ld['max_rel_err']} at step "
                  f"{ld['worst_step']}: {'ok' if row['passed'] else 'FAIL'}", flush=True)
        if 1 in refs and 2 in refs:  # two correct runs, summing in another order
            entry["one_process_1_vs_2_microbatches"] = {
                "weights": weight_diff(refs[2].state, refs[1].state),
                "losses": loss_diff(dict(enumerate(refs[2].losses)),
                                    dict(enumerate(refs[1].losses)))}
        out["models"][model_name] = entry
    out["passed"] = all(r["passed"] for e in out["models"].values() for r in e["plans"].values())
    return out


def _uninterrupted(workdir: str, tokens: str, plan22: str, cache: dict[str, Any]) -> dict[str, Any]:
    """The uninterrupted 2x2 gpt-tiny run of :data:`RESUME_STEPS` steps, exported
    (shared by checks 2 and 3)."""
    if "run" not in cache:
        cache["run"] = train_run("uninterrupted-2x2", workdir, plan22, tokens, RESUME_STEPS,
                                 "--export", "{run}/export")
    return cache["run"]


def check_crash(workdir: str, tokens: str, plan22: str, cache: dict[str, Any]) -> dict[str, Any]:
    """Check 2: a rank killed at step 12, torchrun's restart resumes from step 10."""
    base = _uninterrupted(workdir, tokens, plan22, cache)
    run = train_run("crash-2x2", workdir, plan22, tokens, RESUME_STEPS,
                    "--checkpoint-dir", "{run}/ck", "--save-every", "5", "--max-restarts", "1",
                    "--export", "{run}/export", env={"PLANNER_TRAIN_FAULT": "1:12"})
    res = run["result"] or {}
    out: dict[str, Any] = {
        "steps": RESUME_STEPS, "save_every": 5, "fault": "1:12", "rtol": WEIGHT_RTOL,
        "uninterrupted": {k: base[k] for k in ("command", "returncode", "wall_s")},
        "crashed": {k: run[k] for k in ("command", "env", "returncode", "wall_s")},
        "restarts": res.get("restarts"), "start_step": res.get("start_step"),
        "resumed_from": res.get("resumed_from"),
        "steps_run_after_restart": [e["step"] for e in res.get("losses", [])],
        "saves": sorted(d for d in os.listdir(os.path.join(run["folder"], "ck"))
                        if d.startswith("step_")) if os.path.isdir(
                            os.path.join(run["folder"], "ck")) else [],
    }
    if "error_tail" in run:
        out["error_tail"] = run["error_tail"]
    ok = (run["returncode"] == 0 and base["returncode"] == 0 and out["restarts"] == 1
          and out["start_step"] == 10 and str(out["resumed_from"]).endswith("step_00000010"))
    if run["returncode"] == 0 and base["returncode"] == 0:
        ok = ok and _same_as_uninterrupted(run, base, out)
        ok = ok and out["losses"]["max_rel_err"] <= WEIGHT_RTOL
    out["passed"] = bool(ok)
    print(f"[crash] restarts {out['restarts']} start {out['start_step']} from "
          f"{out['resumed_from']}; weights "
          f"{out.get('weights', {}).get('max_diff_of_model_scale')}: "
          f"{'ok' if ok else 'FAIL'}", flush=True)
    return out


def _same_as_uninterrupted(run: dict[str, Any], base: dict[str, Any],
                           out: dict[str, Any]) -> bool:
    """Record in ``out`` how ``run``'s exported weights and losses differ from
    the uninterrupted ``base`` run's; whether every weight is within
    :data:`WEIGHT_RTOL` and both runs export the same tensors."""
    out["weights"] = weight_diff(_exported(os.path.join(run["folder"], "export")),
                                 _exported(os.path.join(base["folder"], "export")))
    out["losses"] = loss_diff(_losses(run), _losses(base))
    return out["weights"]["max_diff_of_model_scale"] <= WEIGHT_RTOL and not (
        out["weights"]["only_in_run"] or out["weights"]["only_in_reference"])


def check_replan(workdir: str, tokens: str, plan22: str, plan_pz3: str,
                 cache: dict[str, Any]) -> dict[str, Any]:
    """Check 3: saved at step 10 under 2x2, resumed to 20 under pp=2 ZeRO-3."""
    base = _uninterrupted(workdir, tokens, plan22, cache)
    first = train_run("replan-first-2x2", workdir, plan22, tokens, RESUME_STEPS,
                      "--checkpoint-dir", "{run}/ck", "--save-every", "10",
                      "--max-restarts", "0", env={"PLANNER_TRAIN_FAULT": "1:11"},
                      expect_ok=False)
    ck = os.path.join(first["folder"], "ck")
    saves = sorted(d for d in os.listdir(ck) if d.startswith("step_")) if os.path.isdir(ck) else []
    finished = [d for d in saves if os.path.exists(os.path.join(ck, d, "meta.json"))]
    second = train_run("replan-resume-pp2-zero3", workdir, plan_pz3, tokens, RESUME_STEPS,
                       "--checkpoint-dir", ck, "--resume", "--export", "{run}/export")
    res = second["result"] or {}
    out: dict[str, Any] = {
        "steps": RESUME_STEPS, "rtol": WEIGHT_RTOL,
        "uninterrupted": {k: base[k] for k in ("command", "returncode", "wall_s")},
        "first": {k: first[k] for k in ("command", "env", "returncode", "wall_s")},
        "saves_after_first": saves, "finished_saves_after_first": finished,
        "resumed": {k: second[k] for k in ("command", "returncode", "wall_s")},
        "start_step": res.get("start_step"), "resumed_from": res.get("resumed_from"),
        "steps_run": [e["step"] for e in res.get("losses", [])],
    }
    if "error_tail" in second:
        out["error_tail"] = second["error_tail"]
    ok = (first["returncode"] != 0 and finished == ["step_00000010"] and second["returncode"] == 0
          and base["returncode"] == 0 and out["start_step"] == 10
          and str(out["resumed_from"]).endswith("step_00000010"))
    if second["returncode"] == 0 and base["returncode"] == 0:
        ok = ok and _same_as_uninterrupted(second, base, out)
        ok = ok and out["losses"]["steps_compared"] == 10
    # the same comparison between two one-process runs, of 1 and of 2 micro-batches
    # (the 2x2 and the pp=2 plans' splits) for all 20 steps: what summing in
    # another order alone does
    one, two = reference(plan22, tokens, RESUME_STEPS), reference(plan_pz3, tokens, RESUME_STEPS)
    out["one_process_1_vs_2_microbatches"] = {
        "weights": weight_diff(two.state, one.state),
        "losses": loss_diff(dict(enumerate(two.losses)), dict(enumerate(one.losses)))}
    out["passed"] = bool(ok)
    print(f"[replan] start {out['start_step']} from {out['resumed_from']}; weights "
          f"{out.get('weights', {}).get('max_diff_of_model_scale')}: {'ok' if ok else 'FAIL'}",
          flush=True)
    return out


def probe_default_hf(workdir: str, tokens: str) -> dict[str, Any]:
    """The default tiny Qwen2 (:data:`HF_SPEC_DEFAULT`) under the zero3 and pp2
    plans for 2 steps: whether each runs, and the ranks' first error line."""
    saved = MODELS.get("hf-qwen2-default")
    MODELS["hf-qwen2-default"] = (HF_SPEC_DEFAULT, MODELS["hf-qwen2"][1])
    out: dict[str, Any] = {"spec": HF_SPEC_DEFAULT}
    try:
        for kind in ("zero3", "pp2"):
            try:
                path, summary = make_plan("hf-qwen2-default", kind, workdir)
            except Exception as err:  # noqa: BLE001 - recorded
                out[kind] = {"error": f"planning: {type(err).__name__}: {str(err)[:300]}"}
                continue
            run = train_run(f"probe-hf-default-{kind}", workdir, path, tokens, 2)
            errors = [line for line in run.get("error_tail", []) if "error:" in line]
            out[kind] = {"returncode": run["returncode"], "wall_s": run["wall_s"],
                         "stage_inputs": summary.get("stage_inputs"),
                         "error": errors[0] if errors else None}
    finally:
        if saved is None:
            MODELS.pop("hf-qwen2-default", None)
    return out


# ---------------------------------------------------------------------- plot
def plot(curves: dict[str, Any], path: str) -> None:
    """loss.png: per model, the loss of every plan and of one process (top)
    and each plan's relative error against one process (bottom, log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(curves["models"])
    fig, axes = plt.subplots(2, len(models), figsize=(6.5 * len(models), 7.5), squeeze=False,
                             gridspec_kw={"height_ratios": [3, 2]})
    styles = {"2x2": ("tab:blue", "-"), "pp2": ("tab:orange", "--"), "zero3": ("tab:green", ":")}
    for col, model_name in enumerate(models):
        entry = curves["models"][model_name]
        top, bottom = axes[0][col], axes[1][col]
        refs = entry["reference"]
        if refs:
            ref = refs.get("microbatches=1") or next(iter(refs.values()))
            top.plot(range(len(ref["losses"])), ref["losses"], color="black", lw=3, alpha=0.25,
                     label="one process (eager)")
        for kind, row in entry["plans"].items():
            color, ls = styles.get(kind, ("gray", "-"))
            if row.get("losses"):
                steps, losses = zip(*row["losses"])
                top.plot(steps, losses, color=color, ls=ls, lw=1.2,
                         label=f"{kind} ({row.get('microbatches', 1)} µb)")
            if row.get("rel_err_per_step"):
                steps, errs = zip(*row["rel_err_per_step"])
                bottom.semilogy(steps, [max(e, 1e-10) for e in errs], color=color, ls="none",
                                marker={"2x2": "o", "pp2": "s", "zero3": "^"}.get(kind, "."),
                                ms=2.5, alpha=0.7, label=kind)
        bottom.axhline(curves["rtol"], color="red", lw=0.8, ls="-.", label=f"tolerance {curves['rtol']:g}")
        top.set_title(f"{model_name}: 4 CPU ranks vs one process, fp32 AdamW"
                      + ("\n(eager attention, no KV cache)" if model_name.startswith("hf") else ""),
                      fontsize=10)
        top.set_ylabel("training loss")
        top.legend(fontsize=8)
        top.grid(alpha=0.3)
        bottom.set_xlabel("step")
        bottom.set_ylabel("|loss - one process| / one process\n(exact: drawn at 1e-10)")
        bottom.set_ylim(1e-10, 1e-2)
        bottom.legend(fontsize=8, ncol=2)
        bottom.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checks", nargs="+", default=list(CHECKS), choices=CHECKS)
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS),
                    help="models of check 1")
    ap.add_argument("--steps", type=int, default=200, help="steps of check 1")
    ap.add_argument("--workdir", default=None, help="work files (default: a new temp folder)")
    ap.add_argument("--out", default=os.path.join(RESULTS_DIR, "train_checks.json"))
    ap.add_argument("--png", default=os.path.join(RESULTS_DIR, "loss.png"))
    args = ap.parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)
    workdir = args.workdir or tempfile.mkdtemp(prefix="train_checks-")
    os.makedirs(workdir, exist_ok=True)
    load_before = load_average()
    t0 = time.perf_counter()
    tokens, data = make_tokens(workdir)
    result = read_results(args.out)
    result.setdefault("plans", {})
    result.update(command="python benchmarks/train_checks.py " + " ".join(
        argv if argv is not None else sys.argv[1:]), workdir=workdir, git_commit=git_commit(),
                  data=data, cluster=CLUSTER, ranks=RANKS, train=TRAIN, models={
                      k: v[0] for k, v in MODELS.items()})
    cache: dict[str, Any] = {}
    if "curves" in args.checks and "hf-qwen2" in args.models:
        result["hf_default_spec_probe"] = probe_default_hf(workdir, tokens)
    if "curves" in args.checks:
        result["curves"] = check_curves(workdir, tokens, args.models, args.steps, result["plans"])
        plot(result["curves"], args.png)
        print(f"wrote {args.png}", flush=True)
    if "crash" in args.checks or "replan" in args.checks:
        plan22, s22 = make_plan("gpt-tiny", "2x2", workdir)
        result["plans"]["gpt-tiny/2x2"] = s22
    if "crash" in args.checks:
        result["crash"] = check_crash(workdir, tokens, plan22, cache)
    if "replan" in args.checks:
        plan_pz3, spz3 = make_plan("gpt-tiny", "pp2-zero3", workdir)
        result["plans"]["gpt-tiny/pp2-zero3"] = spz3
        result["replan"] = check_replan(workdir, tokens, plan22, plan_pz3, cache)
    if "run" in cache:
        result["uninterrupted_2x2"] = {k: cache["run"][k]
                                       for k in ("command", "returncode", "wall_s")}
        result["uninterrupted_2x2"]["losses"] = sorted(_losses(cache["run"]).items())
    result["passed"] = {c: result[c]["passed"] for c in CHECKS if c in result}
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    result["machine"] = machine_block(load_before, after=True)
    write_results(args.out, result)
    print(wrote_message(args.out, result))
    return 0 if all(result["passed"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
