"""``planner train``: training with a plan, checked against one process.

The multi-process cases run torchrun on 4 CPU ranks (gloo); each covers several
features in one job to keep the suite short. The bad-input cases start no rank.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from app.cli import main as planner
from training.reference import relative_error
from plan.format import load_plan

GPT_TINY_VOCAB = 128


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    """gpt-tiny on local-cpu:4: a 2x2 single-stage plan and a pp=2 ZeRO-3 pipeline."""
    folder = tmp_path_factory.mktemp("plans")
    paths = {"2x2": str(folder / "p22.json"), "pp2z3": str(folder / "pp2z3.json")}
    assert planner(["plan", "--model", "gpt-tiny", "--cluster", "local-cpu:4", "--mesh", "2x2",
                    "-o", paths["2x2"], "--quiet"]) == 0
    assert planner(["plan", "--model", "gpt-tiny", "--cluster", "local-cpu:4", "--pp", "2",
                    "--schedule", "1f1b", "--zero", "3", "-o", paths["pp2z3"], "--quiet"]) == 0
    pipe = load_plan(paths["pp2z3"]).pipeline
    assert pipe.pp == 2 and all(st.zero_stage == 3 for st in pipe.stages)
    return paths


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    """Real text (this repository's docs) as byte tokens below gpt-tiny's vocabulary."""
    from training.data import bytes_to_tokens

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    folder = tmp_path_factory.mktemp("data")
    text = b"".join(open(os.path.join(root, f), "rb").read() for f in ("README.md", "docs/design.md"))
    ascii_text = folder / "text.txt"
    ascii_text.write_bytes(bytes(b for b in text if b < GPT_TINY_VOCAB))
    path = str(folder / "text.bin")
    bytes_to_tokens(str(ascii_text), path)
    return path


def _train(args: list[str], env: dict[str, str] | None = None) -> tuple[int, dict]:
    """Run ``planner train`` (in this process; its ranks under torchrun)."""
    from training.config import TrainConfig
    from training.launch import train

    result = next(a for i, a in enumerate(args) if args[i - 1] == "--result-json")
    from app.cli import build_parser

    config = TrainConfig.from_args(build_parser().parse_args(["train", *args]))
    restarts = int(args[args.index("--max-restarts") + 1]) if "--max-restarts" in args else 0
    outcome = train(config, max_restarts=restarts, env=env)
    assert outcome.returncode == 0, open(outcome.log_path).read()[-3000:]
    with open(result) as f:
        return outcome.returncode, json.load(f)


def _reference(plan_path: str, tokens: str, steps: int):
    from training.data import TokenFile
    from training.reference import train_one_process

    plan = load_plan(plan_path)
    batch_size, seq_len = plan.training["input_shapes"][0]
    data = TokenFile(tokens, batch_size=batch_size, seq_len=seq_len)
    return train_one_process(plan, data.batch, steps=steps, lr=1e-2, warmup=2, grad_clip=0.5)


def _batch(plan_path: str, tokens: str, step: int) -> tuple:
    from training.data import TokenFile

    batch_size, seq_len = load_plan(plan_path).training["input_shapes"][0]
    return TokenFile(tokens, batch_size=batch_size, seq_len=seq_len).batch(step)


def _loss(state: dict[str, torch.Tensor], batch: tuple) -> float:
    """gpt-tiny's loss on ``batch`` with the weights ``state``."""
    from models.source import build_model

    model, _ = build_model("gpt-tiny", device="cpu", seed=0)
    model.load_state_dict(state, strict=False)
    with torch.no_grad():
        return float(model(*batch))


def _exported(folder: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(os.path.join(folder, "model.safetensors"))


@pytest.mark.multiprocess
def test_crash_resume_and_a_new_plan_equal_one_process(plans, tokens, tmp_path):
    """2x2 for 8 steps with saves every 3, rank 1 killed at step 5: torchrun
    restarts the ranks and they resume from step 3 by themselves. Then the save
    of step 8 is made half-written, and a pp=2 ZeRO-3 plan resumes from step 6
    to step 8. Losses and exported weights equal one process's."""
    ck, common = str(tmp_path / "ck"), ["--data", tokens, "--steps", "8", "--lr", "1e-2",
                                        "--warmup", "2", "--grad-clip", "0.5", "--log-every", "4"]
    _, first = _train([plans["2x2"], *common, "--checkpoint-dir", ck, "--save-every", "3",
                       "--max-restarts", "1", "--result-json", str(tmp_path / "a.json")],
                      env={"PLANNER_TRAIN_FAULT": "1:5"})
    assert first["restarts"] == 1 and first["start_step"] == 3
    assert first["resumed_from"].endswith("step_00000003")
    ref = _reference(plans["2x2"], tokens, steps=8)
    for entry in first["losses"]:
        assert entry["loss"] == pytest.approx(ref.losses[entry["step"]], rel=1e-5)
    assert sorted(os.listdir(ck)) == ["step_00000003", "step_00000006", "step_00000008",
                                      "train-ranks.log"]
    os.remove(os.path.join(ck, "step_00000008", "meta.json"))  # as if killed while saving
    export = str(tmp_path / "export")
    _, second = _train([plans["pp2z3"], *common, "--checkpoint-dir", ck, "--resume",
                        "--export", export, "--result-json", str(tmp_path / "b.json")])
    assert second["start_step"] == 6 and [e["step"] for e in second["losses"]] == [6, 7]
    for entry in second["losses"]:
        assert entry["loss"] == pytest.approx(ref.losses[entry["step"]], rel=1e-5)
    weights = _exported(export)
    assert set(weights) == set(ref.state)
    # AdamW turns a gradient that is rounding noise (the attention key bias's:
    # softmax ignores it) into full-size updates, so those entries differ from
    # one process's while the function does not: compare what the weights compute.
    held_out = _batch(plans["2x2"], tokens, 1000)
    assert _loss(weights, held_out) == pytest.approx(_loss(ref.state, held_out), rel=1e-5)
    worst = max(ref.state, key=lambda fqn: relative_error(weights[fqn], ref.state[fqn]))
    assert relative_error(weights[worst], ref.state[worst]) < 1e-3, worst
    assert all(r["peak_bytes"] > r["baseline_bytes"] > 0 for r in second["ranks"])
    assert [r["rank"] for r in second["ranks"]] == [0, 1, 2, 3]


# ---------------------------------------------------------------- bad input
def _refused(capsys, args: list[str]) -> str:
    """``planner train ARGS`` exits 2 with one ``planner: error:`` line; returns it."""
    assert planner(["train", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("planner: error: "), err
    return err[0]


def test_bad_input_is_one_line_and_touches_nothing(plans, tokens, tmp_path, capsys):
    from training.data import write_token_file

    plan = plans["2x2"]
    short = str(tmp_path / "short.bin")
    write_token_file(short, list(range(100)))
    assert "fewer than one batch" in _refused(capsys, [plan, "--data", short])
    wide = str(tmp_path / "wide.bin")
    write_token_file(wide, [5] * 1000 + [GPT_TINY_VOCAB + 3] + [5] * 1000)
    assert f"holds id {GPT_TINY_VOCAB + 3}" in _refused(capsys, [plan, "--data", wide])

    batches = tmp_path / "batches.py"
    batches.write_text("import torch\n"
                       "def batch(step):\n"
                       "    return torch.zeros(4, 32, dtype=torch.long), torch.zeros(4, 32, "
                       "dtype=torch.long)\n")
    assert "batch input 0 is [4, 32]" in _refused(capsys, [plan, "--data", f"{batches}:batch"])

    export = tmp_path / "export"
    export.mkdir()
    (export / "keep.txt").write_text("mine")
    assert "already holds" in _refused(capsys, [plan, "--data", tokens, "--export", str(export)])
    assert (export / "keep.txt").read_text() == "mine"

    ck = tmp_path / "ck"
    half = ck / "step_00000004"
    half.mkdir(parents=True)
    (half / "__0_0.distcp").write_bytes(b"partial")
    assert "half-written" in _refused(capsys, [plan, "--data", tokens, "--init", str(half)])
    assert "only unfinished saves" in _refused(
        capsys, [plan, "--data", tokens, "--checkpoint-dir", str(ck), "--resume"])
    other = ck / "step_00000002"
    other.mkdir()
    (other / "meta.json").write_text(json.dumps({"step": 2, "model": "llama-tiny", "parameters": {
        "tok_embeddings.weight": [128, 64]}}))
    assert "is of another model" in _refused(
        capsys, [plan, "--data", tokens, "--checkpoint-dir", str(ck), "--resume"])
    assert sorted(os.listdir(ck)) == ["step_00000002", "step_00000004"]


@pytest.mark.multiprocess
def test_readme_training_loop_runs(plans, tokens, tmp_path):
    """The README's own training loop (``# train_loop.py``) trains a 2x2 plan on
    4 ranks, saves a DCP checkpoint of the model by its FQNs, and exits cleanly."""
    import shutil
    import subprocess
    import sys

    from training.torchrun import rank_env
    from tests.test_readme import _readme_file

    # registered before parallelize's own exit handler, so it runs after it
    report_at_exit = ("import atexit\nimport torch.distributed\n"
                      "atexit.register(lambda: print('group open at exit:', "
                      "torch.distributed.is_initialized()))\n")
    (tmp_path / "train_loop.py").write_text(report_at_exit + _readme_file("train_loop.py"))
    shutil.copy(plans["2x2"], tmp_path / "plan.json")
    shutil.copy(tokens, tmp_path / "train.bin")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc_per_node=4", "train_loop.py"], cwd=tmp_path, env=rank_env(None),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [float(line.split()[-1]) for line in proc.stdout.splitlines()
              if line.startswith("step ")]
    assert len(losses) == 5 and losses[-1] < losses[0]
    assert (tmp_path / "my_checkpoint" / ".metadata").exists()
    # every rank closed the group before interpreter finalization (a group left
    # to it can abort a rank after its last step)
    # the ranks print at once and their lines may interleave: count the words
    words = "".join(proc.stdout.split())
    assert words.count("groupopenatexit:") == 4 and words.count("exit:True") == 0 \
        and proc.stdout.count("False") == 4, proc.stdout[-2000:]


@pytest.mark.multiprocess
def test_hugging_face_folder_trains_and_exports_for_from_pretrained(tokens, tmp_path):
    """A tiny Qwen2 saved with ``save_pretrained``, planned as ``hf:FOLDER`` on a
    2x2 mesh, starts from its own weights (step 0's loss is one process's) and
    its ``--export`` loads with ``from_pretrained`` to one process's logits."""
    transformers = pytest.importorskip("transformers")
    from training.data import TokenFile
    from training.reference import train_one_process

    config = transformers.AutoConfig.for_model(
        "qwen2", num_hidden_layers=2, hidden_size=64, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=256, tie_word_embeddings=True)
    torch.manual_seed(3)
    source = transformers.AutoModelForCausalLM.from_config(config)
    folder = str(tmp_path / "qwen")
    source.save_pretrained(folder)
    plan = str(tmp_path / "hf.json")
    assert planner(["plan", "--model", f"hf:{folder}", "--cluster", "local-cpu:4", "--mesh",
                    "2x2", "--seq-len", "16", "-o", plan, "--quiet"]) == 0
    export = str(tmp_path / "export")
    _, result = _train([plan, "--data", tokens, "--steps", "2", "--lr", "1e-3", "--export",
                        export, "--result-json", str(tmp_path / "r.json")])
    data = TokenFile(tokens, batch_size=8, seq_len=16, targets="same")
    tokens0, labels0 = data.batch(0)
    with torch.no_grad():
        first = float(source(input_ids=tokens0, labels=labels0).loss)
    assert result["losses"][0]["loss"] == pytest.approx(first, rel=1e-5)
    ref = train_one_process(load_plan(plan), data.batch, steps=2, lr=1e-3,
                            start_state={f"hf.{k}": v for k, v in source.state_dict().items()})
    source.load_state_dict({k[len("hf."):]: v for k, v in ref.state.items()}, strict=False)
    exported = transformers.AutoModelForCausalLM.from_pretrained(export)
    with torch.no_grad():
        want, got = source(input_ids=tokens0).logits, exported(input_ids=tokens0).logits
    assert relative_error(got, want) < 1e-5


def test_gpu_plans_say_where_they_run_and_fp16_is_refused(tmp_path, capsys, monkeypatch):
    """A GPU cluster's plan on a machine without CUDA runs on CPU ranks, and says
    so in one line; an fp16 plan (no loss scaling here) is refused by train too."""
    from training.torchrun import cpu_fallback_note

    gpu = str(tmp_path / "gpu.json")
    assert planner(["plan", "--model", "gpt-tiny", "--cluster", "dgx-h100:1", "--mesh", "8",
                    "--quiet", "-o", gpu]) == 0
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    note = cpu_fallback_note(load_plan(gpu), gpu)
    assert "no CUDA device" in note and "8 ranks run on the CPU" in note
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert cpu_fallback_note(load_plan(gpu), gpu) is None
    monkeypatch.undo()
    fp16 = str(tmp_path / "fp16.json")
    assert planner(["plan", "--model", "gpt-tiny", "--cluster", "p3.16xlarge:1", "--mesh", "8",
                    "--quiet", "-o", fp16]) == 0
    capsys.readouterr()
    assert "loss scaling" in _refused(capsys, [fp16, "--steps", "1"])
