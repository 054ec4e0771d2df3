"""One-GPU benchmark: what the planner predicts for a training step against what runs.

Runs in under 5 minutes on one H100 with the torch the GPU image ships; the
project need not be installed (this script puts the repository root on
``sys.path`` and runs the planner as ``python3 -m app.cli``).

1. ``planner profile --ranks 1`` of the GPU into ``OUT/cluster.json`` (about 20 s
   on an H100; with ``--cluster`` an existing cluster JSON is used instead).
2. Plans for that one GPU (mesh ``(1,)``), timed: gpt2 at 16 x 1024 and gpt3-350m
   at 8 x 2048 in ``bf16-mixed`` with the solver's own checkpointing; and the
   calibration cases of ``shared/measurements/h100-2026-11-26.md``: the same two
   in ``bf16`` (the plan's own checkpointing) and gpt3-350m in ``bf16`` with
   ``recompute=False`` (priced with an unbounded memory budget, as there).
3. For every plan, a plain eager loop of the same model, precision and the plan's
   checkpointed layers (:mod:`benchmarks.plain_loop`: AdamW foreach; CUDA-event
   timed, median of ``--steps`` after ``--warmup``; peak =
   ``torch.cuda.max_memory_allocated`` of a steady-state step), and then, while
   the time budget lasts (main cases first), ``planner run`` of the plan
   (:func:`training.launch.launch`, the function behind ``planner run``, with
   ``--optimizer adamw``): its own per-step times (median of the steps after the
   first ``--run-warmup``) and peak memory as ``training.launch.launch`` reports them;
   with ``--check``, the main cases' ``planner run --check`` too (their first step
   against one process in the same precision on the same GPU).
4. With ``--train N``, ``planner train`` of the first main case's plan
   (:func:`training.launch.train`, the function behind the command) for N steps
   on a token file of this repository's own text (bytes as token ids, AdamW,
   warm-up and cosine decay): its median step time after ``--run-warmup``
   steps, as tokens/s, against the plain loop's tokens/s for the same plan, and
   its peak memory against the prediction.
5. A table of predicted against measured step time and peak memory, ratios
   predicted / measured, and ``OUT/gpu_single.json`` with the machine (GPU name,
   torch, CUDA, driver, git commit) and everything measured. A failing case or
   phase is recorded with its one-line error and the script goes on.

Units: seconds and bytes in the JSON; the table shows ms and GB (1e9 bytes).
Exit status: 0 all measured, 1 some case failed or was skipped, 2 no CUDA GPU.

The GPU image has no ortools (the planner imports it, ``planner run`` too). Carry
its wheel, made on the CPU machine, from the repository root (Python 3.12 on the
GPU; ortools' version as in pyproject.toml / the local .venv)::

    echo /.whl/ >> .git/info/exclude
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \\
        --implementation cp --platform manylinux_2_28_x86_64 \\
        --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \\
        --platform manylinux2014_x86_64 -d .whl \\
        ortools==9.15.6755 protobuf==6.33.6 immutabledict==4.3.1

(ortools requires absl-py, numpy >= 2.0.2, pandas, typing-extensions, which the
image has, ``protobuf>=6.33.1,<6.34``, carried because the image's may be older,
and immutabledict; ``unzip -p .whl/ortools-*.whl '*/METADATA' | grep
^Requires-Dist`` lists them.) About 29 MiB. Pass ``.whl`` as an ignored path to
carry, then on the GPU machine::

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \\
        --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD; \\
        python3 benchmarks/gpu_single.py --out $OUT

To try it on a CPU (no profile, cluster ``local-cpu:1``, gpt-tiny, < 1 min)::

    OMP_NUM_THREADS=1 python benchmarks/gpu_single.py --device cpu --models gpt-tiny --quick --out /tmp/g
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
import traceback
from typing import Any, Callable

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

import torch  # noqa: E402

DEFAULT_OUT = os.path.join(REPO_ROOT, "benchmarks", "results", "gpu")
UNBOUNDED_BYTES = 1e15
#: model -> (batch, seq) of the cases; others use the zoo's defaults
SHAPES = {"gpt2": (16, 1024), "gpt3-350m": (8, 2048)}


class Case:
    """One (model, precision, recompute) to plan, loop and run."""

    def __init__(self, model: str, precision: str, recompute: bool | None, *, main: bool,
                 batch: int | None = None, seq: int | None = None) -> None:
        from models import zoo
        d = zoo.describe(model)
        b, s = SHAPES.get(model, (d["batch_size"], d["seq_len"]))
        self.model, self.precision, self.recompute, self.main = model, precision, recompute, main
        self.batch, self.seq = batch or b, seq or s
        self.unbounded = recompute is False  # as the measurement file priced it
        rc = {None: "auto", True: "ckpt", False: "nockpt"}[recompute]
        self.name = f"{model}-{self.batch}x{self.seq}-{precision}-{rc}"
        self.record: dict[str, Any] = {
            "name": self.name, "model": model, "batch_size": self.batch, "seq_len": self.seq,
            "precision": precision, "recompute": recompute, "main": main,
            "memory_budget": UNBOUNDED_BYTES if self.unbounded else None}
        self.plan: Any = None
        self.plan_path: str | None = None


def cases_for(models: list[str], quick: bool, calibration: bool) -> list[Case]:
    """Main cases (bf16-mixed, the solver's checkpointing) first, then calibration
    (bf16, own checkpointing; gpt3-350m bf16 without checkpointing); with ``quick``
    also bf16-mixed with every layer checkpointed."""
    out = [Case(m, "bf16-mixed", None, main=True) for m in models]
    if quick:
        out += [Case(m, "bf16-mixed", True, main=True) for m in models]
    if calibration:
        out += [Case(m, "bf16", None, main=False) for m in models]
        out += [Case(m, "bf16", False, main=False) for m in models
                if m == "gpt3-350m" or quick]
    return out


def _line(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0] if text else ''}"


def _guard(record: dict[str, Any], key: str, fn: Callable[[], Any]) -> Any:
    """``fn()``; an exception is recorded as ``record["errors"][key]`` (one line) and
    None is returned."""
    try:
        return fn()
    except Exception as err:  # noqa: BLE001 - one failure must not lose the run
        record.setdefault("errors", {})[key] = _line(err)
        print(f"  {key}: {_line(err)}", flush=True)
        if os.environ.get("GPU_SINGLE_TRACEBACK"):
            traceback.print_exc()
        return None


# --- the machine ---------------------------------------------------------------------

def _cmd(args: list[str]) -> str | None:
    try:
        out = subprocess.run(args, capture_output=True, text=True, timeout=20, cwd=REPO_ROOT)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def machine(device: str) -> dict[str, Any]:
    """GPU name and memory, torch, CUDA, driver, Python, ortools, git commit."""
    import importlib.metadata as md

    info: dict[str, Any] = {"python": platform.python_version(), "platform": platform.platform(),
                            "torch": torch.__version__, "cuda": torch.version.cuda,
                            "cpus": os.cpu_count(), "device": device}
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=torch.cuda.get_device_name(0), gpu_memory_bytes=int(props.total_memory),
                    gpu_count=torch.cuda.device_count(),
                    cudnn=torch.backends.cudnn.version())
    if shutil.which("nvidia-smi"):
        q = _cmd(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                  "--format=csv,noheader"])
        info["nvidia_smi"] = q
        if q:
            info["driver"] = q.splitlines()[0].split(",")[1].strip()
    for pkg in ("ortools", "protobuf", "numpy", "scipy", "networkx", "rich"):
        try:
            info[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            info[pkg] = None
    commit = _cmd(["git", "rev-parse", "HEAD"])
    if commit:
        dirty = _cmd(["git", "status", "--porcelain", "--untracked-files=no"])
        info["git_commit"] = commit + (" (dirty)" if dirty else "")
    else:
        info["git_commit"] = None
    return info


# --- phases -------------------------------------------------------------------------

def profile(out_dir: str, quick: bool) -> tuple[str, dict[str, Any]]:
    """``python3 -m app.cli profile --ranks 1``; on failure a preset one-GPU cluster
    (dgx-h100 or h200 cut to one device) so that the rest still runs."""
    path = os.path.join(out_dir, "cluster.json")
    cmd = [sys.executable, "-m", "app.cli", "profile", "--ranks", "1", "-o", path]
    if quick:
        cmd.append("--quick")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO_ROOT, env.get("PYTHONPATH", "")) if p)
    t0 = time.perf_counter()
    rec: dict[str, Any] = {"command": " ".join(cmd[1:])}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env,
                              cwd=REPO_ROOT)
        rec["returncode"] = proc.returncode
        rec["output"] = proc.stdout.strip().splitlines()[-12:]
        if proc.returncode != 0 or not os.path.exists(path):
            tail = (proc.stderr.strip() or proc.stdout.strip()).splitlines()
            raise RuntimeError(tail[-1] if tail else f"exit status {proc.returncode}")
    except Exception as err:  # noqa: BLE001
        rec["error"] = _line(err)
        from costmodel.presets import load_cluster

        gpu = _cmd(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"]) or ""
        name = "h200" if "H200" in gpu else "dgx-h100"
        cluster = load_cluster(name).sub_cluster(1, 1)
        with open(path, "w") as f:
            f.write(cluster.to_json())
        rec["fallback"] = f"preset {name} cut to one device"
        print(f"profile failed ({rec['error']}); using {rec['fallback']}", flush=True)
    rec["wall_s"] = round(time.perf_counter() - t0, 2)
    prof = os.path.join(out_dir, "cluster.profile.json")
    if os.path.exists(prof):
        with open(prof) as f:
            p = json.load(f)
        rec["fits"] = {k: p[k] for k in ("fits", "wall_s") if k in p}
    return path, rec


def plan_case(case: Case, cluster: str, out_dir: str, time_limit_s: float,
              compile: bool = False) -> None:
    """Plan the case (priced as run compiled with ``compile``) into ``case.plan``
    and ``OUT/plans/``; its prediction into ``case.record["predicted"]``."""
    from benchmarks.plain_loop import plan_one_device, predicted_of
    from models import zoo
    model, inputs = zoo.build(case.model, device="meta", batch_size=case.batch,
                              seq_len=case.seq)
    t0 = time.perf_counter()
    plan = plan_one_device(model, inputs, cluster, precision=case.precision,
                           recompute=case.recompute, model_source=case.model,
                           zoo_kwargs={"batch_size": case.batch, "seq_len": case.seq},
                           memory_budget=UNBOUNDED_BYTES if case.unbounded else None,
                           time_limit_s=time_limit_s, compile=compile)
    case.record["plan_s"] = round(time.perf_counter() - t0, 3)
    case.plan = plan
    case.plan_path = os.path.join(out_dir, "plans", case.name + ".json")
    os.makedirs(os.path.dirname(case.plan_path), exist_ok=True)
    plan.save(case.plan_path)
    case.record["predicted"] = predicted_of(plan)
    case.record["plan_path"] = os.path.relpath(case.plan_path, out_dir)


def plain_case(case: Case, device: str, warmup: int, steps: int) -> None:
    from benchmarks.plain_loop import PlainLoop, peak_memory, time_steps

    loop = None
    try:
        loop = PlainLoop.from_zoo(case.model, precision=case.precision,
                                  checkpoint=case.plan.checkpoint, device=device,
                                  batch_size=case.batch, seq_len=case.seq)
        timing = time_steps(loop, warmup=warmup, steps=steps)
        memory = peak_memory(loop, warmup=1)
        case.record["plain"] = {"step_time_s": timing["median_s"], "time": timing,
                                "peak_bytes": memory["peak_bytes"], "memory": memory}
    finally:
        del loop
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()


def run_case(case: Case, run_warmup: int, run_steps: int, timeout_s: float,
             check: bool = False) -> None:
    """``planner run`` of the case's plan; with ``check`` also ``--check`` (its first
    step against a one-process run of the same precision on the same GPU)."""
    from training.launch import launch

    t0 = time.perf_counter()
    res = launch(case.plan_path, steps=run_warmup + run_steps, optimizer="adamw",
                 timeout_s=timeout_s, check=check)
    times = list(res.get("step_times_s") or [])
    timed = times[run_warmup:] or times
    case.record["run"] = {
        "step_time_s": statistics.median(timed) if timed else None,
        "step_times_s": times, "warmup": run_warmup,
        "peak_bytes": res.get("peak_memory_bytes"),
        "peak_memory_kind": res.get("peak_memory_kind"),
        "setup_s": res.get("setup_s"), "loss": res.get("loss"),
        "fallback_ops": res.get("fallback_ops"), "returncode": res.get("returncode"),
        "wall_s": round(time.perf_counter() - t0, 2)}
    if check:
        case.record["run"]["check"] = {k: res.get(k) for k in (
            "passed", "loss_rel_err", "max_rel_grad_err", "worst_param", "num_params_checked",
            "rtol", "observed_match")}


def _text_sources() -> list[str]:
    """This repository's Markdown and Python sources, walked in sorted order
    (hidden folders left out), as paths from its root."""
    out = []
    for folder, dirs, files in os.walk(REPO_ROOT):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        out += [os.path.relpath(os.path.join(folder, name), REPO_ROOT)
                for name in sorted(files) if name.endswith((".md", ".py"))]
    return out


def train_case(case: Case, steps: int, warmup: int, out_dir: str, *,
               compile: bool | None = None, key: str = "train") -> None:
    """``planner train`` of the case's plan for ``steps`` steps (``--compile`` as
    ``compile`` says; None: as the plan records) into ``case.record[key]``;
    tokens/s from the median step after ``warmup``, against the plain loop's
    (same batch), and the compile lines the job printed."""
    import io

    from benchmarks.common import compile_lines, text_token_file
    from training.config import TrainConfig
    from training.launch import train

    # real text that needs no tokenizer: ASCII bytes as ids 0..127, which any
    # zoo vocabulary takes
    data, _ = text_token_file(out_dir, _text_sources(), below=128)
    result_path = os.path.join(out_dir, f"{key}_{case.name}.json")
    config = TrainConfig(plan=case.plan_path, data=data, steps=steps, lr=3e-4,
                         warmup=min(10, steps), grad_clip=1.0, log_every=10,
                         log=os.path.join(out_dir, f"{key}_{case.name}.jsonl"),
                         result_json=result_path, compile=compile)
    t0 = time.perf_counter()
    outcome = train(config, out=io.StringIO())
    if outcome.returncode != 0:
        raise RuntimeError(outcome.error or f"planner train exited {outcome.returncode}")
    with open(result_path) as f:
        res = json.load(f)
    times = res["step_times_s"][warmup:] or res["step_times_s"]
    step_s = statistics.median(times)
    tokens = res["tokens_per_step"]
    plain = (case.record.get("plain") or {}).get("step_time_s")
    losses = [r["loss"] for r in res["losses"]]
    case.record[key] = {
        "steps": steps, "warmup": warmup, "step_time_s": step_s, "tokens_per_step": tokens,
        "tokens_per_s": tokens / step_s,
        "plain_tokens_per_s": tokens / plain if plain else None,
        "tokens_per_s_over_plain": (plain / step_s) if plain else None,
        "first_loss": losses[0] if losses else None, "final_loss": res.get("final_loss"),
        "loss_every_10": losses[::10],
        "peak_bytes": [r["peak_bytes"] for r in res["ranks"]],
        "predicted_peak_bytes": res.get("predicted_peak_bytes_per_device"),
        "data_tokens": os.path.getsize(data) // 2, "compile_lines": compile_lines(outcome.log_path),
        "wall_s": round(time.perf_counter() - t0, 2)}
    os.remove(data)


# --- report -------------------------------------------------------------------------

def _ratio(pred: Any, meas: Any) -> float | None:
    if isinstance(pred, (int, float)) and isinstance(meas, (int, float)) and meas > 0:
        return pred / meas
    return None


def add_ratios(rec: dict[str, Any]) -> None:
    """Predicted / measured step time and peak memory, against the plain loop and
    planner run (not against a CPU rank's peak RSS, which counts the whole process)."""
    pred = rec.get("predicted") or {}
    rec["ratios"] = {
        f"{what}_{kind}": _ratio(pred.get(key), (rec.get(kind) or {}).get(key))
        for what, key in (("time", "step_time_s"), ("memory", "peak_bytes"))
        for kind in ("plain", "run")}
    if (rec.get("run") or {}).get("peak_memory_kind") == "cpu_peak_rss":
        rec["ratios"]["memory_run"] = None


def print_table(records: list[dict[str, Any]]) -> None:
    def ms(x: Any) -> str:
        return f"{x * 1e3:.1f}" if isinstance(x, (int, float)) else "-"

    def gb(x: Any) -> str:  # GB (1e9 bytes); MB below 0.1 GB
        if not isinstance(x, (int, float)):
            return "-"
        return f"{x / 1e9:.2f}" if x >= 1e8 else f"{x / 1e6:.2f}M"

    def r(x: Any) -> str:
        return f"{x:.2f}" if isinstance(x, (int, float)) else "-"

    head = (f"{'case':<34} {'ckpt':>4} {'plan s':>6} | {'pred ms':>8} {'loop ms':>8} {'ratio':>5} "
            f"{'run ms':>8} {'ratio':>5} | {'pred GB':>7} {'loop GB':>7} {'ratio':>5} "
            f"{'run GB':>7} {'ratio':>5}")
    print(head)
    print("-" * len(head))
    for rec in records:
        p, pl, ru, q = (rec.get("predicted") or {}, rec.get("plain") or {}, rec.get("run") or {},
                        rec.get("ratios") or {})
        ck = len(p["checkpoint"]) if "checkpoint" in p else "-"
        plan_s = rec.get("plan_s")
        print(f"{rec['name']:<34} {ck!s:>4} {plan_s if plan_s is not None else '-':>6} | "
              f"{ms(p.get('step_time_s')):>8} {ms(pl.get('step_time_s')):>8} "
              f"{r(q.get('time_plain')):>5} {ms(ru.get('step_time_s')):>8} {r(q.get('time_run')):>5} | "
              f"{gb(p.get('peak_bytes')):>7} {gb(pl.get('peak_bytes')):>7} "
              f"{r(q.get('memory_plain')):>5} {gb(ru.get('peak_bytes')):>7} {r(q.get('memory_run')):>5}")
        for k, v in (rec.get("errors") or {}).items():
            print(f"    {k}: {v}")
    print("ratio = predicted / measured; loop = plain eager loop (benchmarks.plain_loop), "
          "run = planner run of the plan; memory in GB (1e9 bytes), M = MB")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=DEFAULT_OUT, help="folder for gpu_single.json, "
                    "cluster.json and plans/ (default benchmarks/results/gpu)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--models", nargs="+", default=["gpt2", "gpt3-350m"],
                    help="zoo models (gpt2 16x1024 and gpt3-350m 8x2048; others at the "
                         "zoo's default shape)")
    ap.add_argument("--quick", action="store_true",
                    help="fewer steps; on CPU no profile (cluster local-cpu:1); also a "
                         "bf16-mixed case with every layer checkpointed")
    ap.add_argument("--cluster", help="use this cluster JSON or preset instead of profiling")
    ap.add_argument("--no-calibration", action="store_true",
                    help="only the bf16-mixed cases, not the bf16 calibration ones")
    ap.add_argument("--no-run", action="store_true", help="skip planner run")
    ap.add_argument("--warmup", type=int, default=3, help="plain loop warm-up steps")
    ap.add_argument("--steps", type=int, default=5, help="plain loop timed steps")
    ap.add_argument("--run-warmup", type=int, default=2, help="planner run steps not timed")
    ap.add_argument("--run-steps", type=int, default=4, help="planner run steps timed")
    ap.add_argument("--check", action="store_true",
                    help="planner run --check for the main (bf16-mixed) cases")
    ap.add_argument("--train", type=int, default=0, metavar="N",
                    help="also planner train N steps of the first main case's plan")
    ap.add_argument("--time-limit", type=float, default=30.0, help="ILP time limit, s")
    ap.add_argument("--budget-s", type=float, default=270.0,
                    help="wall-clock budget: phases that would start after it are skipped")
    return ap


def _cluster(args: argparse.Namespace, result: dict[str, Any]) -> str:
    """Phase 1: the cluster (given, the CPU preset, or profiled here); recorded in ``result``."""
    if args.cluster:
        cluster = args.cluster
        result["profile"] = {"cluster": cluster, "source": "given"}
    elif args.device == "cpu":
        cluster = "local-cpu:1"
        result["profile"] = {"cluster": cluster, "source": "preset (CPU run: no profile)"}
    else:
        cluster, rec = profile(args.out, args.quick)
        result["profile"] = {"cluster": os.path.relpath(cluster, args.out), **rec}
        print(f"profile: {rec['wall_s']:.1f} s", flush=True)
    return cluster


def _plan_cases(cases: list[Case], cluster: str, args: argparse.Namespace,
                over_budget: Callable[[], bool]) -> None:
    """Phase 2: plan every case (before the parent touches the GPU: the planner forks)."""
    for c in cases:
        if over_budget():
            c.record.setdefault("errors", {})["plan"] = "skipped: time budget"
            continue
        _guard(c.record, "plan", lambda: plan_case(c, cluster, args.out, args.time_limit))
        if c.plan is not None:
            print(f"planned {c.name} in {c.record['plan_s']:.1f} s: "
                  f"{len(c.plan.checkpoint)} layers checkpointed", flush=True)


def _plain_loops(cases: list[Case], args: argparse.Namespace,
                 over_budget: Callable[[], bool]) -> None:
    """Phase 3: the plain training loop of every planned case."""
    for c in cases:
        if c.plan is None:
            continue
        if over_budget():
            c.record.setdefault("errors", {})["plain"] = "skipped: time budget"
            continue
        _guard(c.record, "plain", lambda: plain_case(c, args.device, args.warmup, args.steps))
        if "plain" in c.record:
            print(f"plain loop {c.name}: {c.record['plain']['step_time_s'] * 1e3:.1f} ms, "
                  f"{c.record['plain']['peak_bytes'] / 1e9:.3g} GB", flush=True)


def _planner_runs(cases: list[Case], args: argparse.Namespace, start: float) -> None:
    """Phase 4: ``planner run`` of every planned case, main cases first, while
    the budget (``args.budget_s`` seconds from ``start``) lasts."""
    for c in sorted(cases, key=lambda c: not c.main):
        if c.plan is None:
            continue
        left = args.budget_s - (time.perf_counter() - start)
        if left < 20:
            c.record.setdefault("errors", {})["run"] = "skipped: time budget"
            continue
        _guard(c.record, "run", lambda: run_case(c, args.run_warmup, args.run_steps,
                                                 timeout_s=max(20.0, left),
                                                 check=args.check and c.main))
        if "run" in c.record:
            st = c.record["run"]["step_time_s"]
            checked = c.record["run"].get("check")
            verdict = "" if checked is None else (
                f", check {'PASSED' if checked['passed'] else 'FAILED'} (max grad err "
                f"{checked['max_rel_grad_err']}, rtol {checked['rtol']})")
            print(f"planner run {c.name}: "
                  f"{st * 1e3 if st is not None else float('nan'):.1f} ms{verdict}",
                  flush=True)


def _train_first(cases: list[Case], args: argparse.Namespace,
                 over_budget: Callable[[], bool]) -> None:
    """Phase 5: ``planner train`` of the first planned main case (``--train`` steps)."""
    first = next((c for c in cases if c.main and c.plan is not None), None)
    if not args.train or first is None:
        return
    if over_budget():
        first.record.setdefault("errors", {})["train"] = "skipped: time budget"
        return
    _guard(first.record, "train",
           lambda: train_case(first, args.train, args.run_warmup, args.out))
    tr = first.record.get("train")
    if tr:
        ratio = tr["tokens_per_s_over_plain"]
        print(f"planner train {first.name}: {tr['steps']} steps, "
              f"{tr['tokens_per_s']:,.0f} tokens/s (plain loop "
              f"{tr['plain_tokens_per_s'] or float('nan'):,.0f}; ratio "
              f"{ratio if ratio is not None else float('nan'):.3f}), loss "
              f"{tr['first_loss']:.3f} -> {tr['final_loss']:.3f}", flush=True)


def missing_gpu(device: str, script: str) -> bool:
    """Whether ``device`` is ``cuda`` and torch sees no GPU; if so, one error
    line naming ``script`` and how to try it on a CPU."""
    if device != "cuda" or torch.cuda.is_available():
        return False
    print(f"{script}: error: no CUDA GPU (torch.cuda.is_available() is False); "
          "to try it on a CPU: --device cpu --models gpt-tiny --quick", file=sys.stderr)
    return True


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)

    if missing_gpu(args.device, "gpu_single"):
        return 2
    if args.quick:
        args.warmup, args.steps = min(args.warmup, 1), min(args.steps, 3)
        args.run_warmup, args.run_steps = min(args.run_warmup, 1), min(args.run_steps, 2)
    start = time.perf_counter()
    os.makedirs(args.out, exist_ok=True)
    # the machine is recorded at the end: the planner forks, so the parent leaves
    # the GPU alone until the plans are made
    result: dict[str, Any] = {"benchmark": "gpu_single", "machine": None,
                              "args": vars(args), "cases": []}
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, device {args.device}",
          flush=True)
    missing = [m for m in ("ortools", "scipy", "networkx") if importlib.util.find_spec(m) is None]
    if missing:
        result["missing_modules"] = missing
        print(f"gpu_single: warning: cannot import {', '.join(missing)}: planning and planner "
              f"run will fail (see this script's docstring for carrying the ortools wheel)",
              file=sys.stderr, flush=True)

    def over_budget() -> bool:
        return time.perf_counter() - start > args.budget_s

    cluster = _cluster(args, result)
    cases = cases_for(args.models, args.quick, not args.no_calibration)
    result["cases"] = [c.record for c in cases]
    _plan_cases(cases, cluster, args, over_budget)
    _plain_loops(cases, args, over_budget)
    if not args.no_run:
        _planner_runs(cases, args, start)
    _train_first(cases, args, over_budget)
    for c in cases:
        add_ratios(c.record)
    result["machine"] = _guard(result, "machine", lambda: machine(args.device))
    print(json.dumps({k: (result["machine"] or {}).get(k) for k in
                      ("gpu", "torch", "cuda", "driver", "git_commit", "ortools")}), flush=True)
    result["wall_s"] = round(time.perf_counter() - start, 1)
    path = os.path.join(args.out, "gpu_single.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1, default=str)
        f.write("\n")
    print()
    print_table(result["cases"])
    print(f"wrote {path} ({result['wall_s']:.0f} s)")
    return 1 if any(c.record.get("errors") for c in cases) or result.get("errors") else 0


if __name__ == "__main__":
    sys.exit(main())
