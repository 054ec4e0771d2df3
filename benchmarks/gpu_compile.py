"""One GPU: ``planner train --compile`` against a compiled plain loop and eager.

    python3 benchmarks/gpu_compile.py --out $OUT              # on the GPU machine
    OMP_NUM_THREADS=1 python benchmarks/gpu_compile.py --device cpu --models gpt-tiny \\
        --quick --out /tmp/gc                                 # the same phases on a CPU

For gpt2 at 16 x 1024 and gpt3-350m at 8 x 2048 in ``bf16-mixed`` (other zoo
models at their default shape), on one device:

1. the cluster: ``planner profile --ranks 1`` of the GPU (:func:`benchmarks.gpu_single.profile`;
   its compiled-region probe prices a compiled program), ``--cluster`` or, on a
   CPU, ``local-cpu:1``;
2. two plans of each model on it, the solver's own checkpointing: one priced as
   run eager, one priced as run compiled (``compile=True``: the plan records
   ``training.compile``);
3. :class:`benchmarks.plain_loop.PlainLoop` of the model, with the compiled
   plan's checkpointed layers, eager and with its forward through
   ``torch.compile`` (AdamW foreach; CUDA-event timed, the median of
   ``--steps`` steps after ``--warmup``, which compile);
4. ``planner train`` (:func:`training.launch.train`) of the eager plan, and
   ``planner train --compile`` of the compiled plan, ``--train`` steps each on
   this repository's text: the median step after ``--train-warmup`` steps, the
   loss curves, the compile lines the job printed (each region's compile time);
5. tokens/s and MFU of all four, and each plan's predicted step against its
   ``planner train``.

MFU counts model FLOPs as 3 x the zoo config's ``forward_flops`` (every
matmul of the forward, the language-model head and attention's two among them:
6 x the linear layers' weights + 12 x layers x width x sequence per token, as
``planner compare`` counts them), over the datasheet's dense bf16 peak of the
GPU (:mod:`costmodel.presets`; on a CPU, none). Writes ``OUT/gpu_compile.json``.
Units: seconds, tokens/s. Exit status: 0 all measured, 1 a phase failed (its
one-line error is in the JSON), 2 no CUDA GPU.

The GPU image has no ortools: carry its wheels as :mod:`benchmarks.gpu_single`'s
docstring says.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from typing import Any

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

import torch  # noqa: E402

from benchmarks import gpu_single  # noqa: E402
from benchmarks.gpu_single import Case, _guard  # noqa: E402

#: the four ways one model's step runs: (record key, label)
KINDS = (("loop_eager", "plain loop, eager"), ("loop_compiled", "plain loop, torch.compile"),
         ("train_eager", "planner train"), ("train_compiled", "planner train --compile"))


def datasheet_peak_flops(device: str) -> float | None:
    """The GPU's dense bf16 FLOP/s by its datasheet (H100 and H200: the preset
    devices); None on a CPU or an unknown GPU."""
    if device != "cuda":
        return None
    from costmodel.presets import H100_SXM5_80GB, H200_SXM5_141GB

    name = torch.cuda.get_device_name(0)
    for key, spec in (("H200", H200_SXM5_141GB), ("H100", H100_SXM5_80GB)):
        if key in name:
            return float(spec.peak_flops["bfloat16"])
    return None


def loop_time(case: Case, device: str, compiled: bool, warmup: int, steps: int) -> dict[str, Any]:
    """The plain loop's step (``compiled``: its forward through ``torch.compile``);
    its first step's seconds (which compiles) and the median of ``steps`` after ``warmup``."""
    from benchmarks.plain_loop import PlainLoop, time_steps

    loop = None
    try:
        loop = PlainLoop.from_zoo(case.model, precision=case.precision,
                                  checkpoint=case.plan.checkpoint, device=device,
                                  batch_size=case.batch, seq_len=case.seq, compile=compiled)
        t0 = time.perf_counter()
        loop.step().item()
        first = time.perf_counter() - t0
        timing = time_steps(loop, warmup=max(0, warmup - 1), steps=steps)
        return {"step_time_s": timing["median_s"], "first_step_s": first, "time": timing}
    finally:
        del loop
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
        torch._dynamo.reset()


def _plan_pair(model: str, cluster: str, args: argparse.Namespace) -> dict[str, Case]:
    """The model's eager-priced and compiled-priced plans (bf16-mixed, own checkpointing)."""
    pair = {}
    for kind, compiled in (("eager", False), ("compiled", True)):
        case = Case(model, "bf16-mixed", None, main=True)
        case.name += f"-{kind}"
        case.record["name"] = case.name
        _guard(case.record, "plan", lambda: gpu_single.plan_case(
            case, cluster, args.out, args.time_limit, compile=compiled))
        pair[kind] = case
    return pair


def _summary(pair: dict[str, Case], peak: float | None) -> dict[str, Any]:
    """One model's row: each kind's step, tokens/s and MFU; predicted / measured."""
    eager, comp = pair["eager"], pair["compiled"]
    from models import zoo

    tokens = comp.batch * comp.seq
    # the matmuls' FLOPs, forward and backward (3 x the forward's), as planner compare counts them
    flops = 3.0 * zoo.config(comp.model).forward_flops(comp.batch, comp.seq)
    steps = {"loop_eager": (comp.record.get("loop_eager") or {}).get("step_time_s"),
             "loop_compiled": (comp.record.get("loop_compiled") or {}).get("step_time_s"),
             "train_eager": (eager.record.get("train") or {}).get("step_time_s"),
             "train_compiled": (comp.record.get("train") or {}).get("step_time_s")}
    row: dict[str, Any] = {"model": comp.model, "batch_size": comp.batch, "seq_len": comp.seq,
                           "precision": comp.precision, "tokens_per_step": tokens,
                           "model_flops_per_step": flops, "peak_flops": peak, "kinds": {}}
    for key, label in KINDS:
        s = steps[key]
        row["kinds"][key] = {"label": label, "step_time_s": s,
                             "tokens_per_s": tokens / s if s else None,
                             "mfu": flops / s / peak if s and peak else None}
    for kind, case in pair.items():
        pred = (case.record.get("predicted") or {}).get("step_time_s")
        meas = steps[f"train_{kind}"]
        row[f"predicted_{kind}_step_s"] = pred
        row[f"predicted_over_measured_{kind}"] = pred / meas if pred and meas else None
        row[f"checkpoint_{kind}"] = (case.record.get("predicted") or {}).get("checkpoint")
    tc, lc, te = steps["train_compiled"], steps["loop_compiled"], steps["train_eager"]
    row["train_compiled_speed_vs_loop_compiled"] = lc / tc if tc and lc else None
    row["train_compiled_speed_vs_train_eager"] = te / tc if tc and te else None
    le, ce = [(c.record.get("train") or {}).get("loss_every_10") for c in (eager, comp)]
    if le and ce:
        row["loss_every_10"] = {"eager": le, "compiled": ce,
                                "max_abs_diff": max(abs(a - b) for a, b in zip(le, ce))}
    return row


def _run_model(pair: dict[str, Case], args: argparse.Namespace, over_budget: Any,
               save: Any) -> None:
    """Phases 3 and 4 for one model (each guarded; skipped past the budget;
    ``save()`` after each, so that a run stopped from outside keeps what it measured)."""
    comp = pair["compiled"]
    if comp.plan is None or pair["eager"].plan is None:
        return
    for key, compiled in (("loop_eager", False), ("loop_compiled", True)):
        if over_budget():
            comp.record.setdefault("errors", {})[key] = "skipped: time budget"
            continue
        _guard(comp.record, key, lambda: comp.record.__setitem__(key, loop_time(
            comp, args.device, compiled, args.warmup, args.steps)))
        print(f"{comp.model} {key}: {comp.record.get(key, {}).get('step_time_s')}", flush=True)
        save()
    for case, compiled in ((pair["eager"], False), (comp, True)):
        if over_budget():
            case.record.setdefault("errors", {})["train"] = "skipped: time budget"
            continue
        _guard(case.record, "train", lambda: gpu_single.train_case(
            case, args.train, args.train_warmup, args.out, compile=compiled))
        tr = case.record.get("train") or {}
        print(f"{case.name} planner train{' --compile' if compiled else ''}: "
              f"{tr.get('step_time_s')} s a step; {tr.get('compile_lines')}", flush=True)
        save()


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=gpu_single.DEFAULT_OUT, help="folder for gpu_compile.json")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--models", nargs="+", default=["gpt2", "gpt3-350m"])
    ap.add_argument("--cluster", help="a cluster JSON or preset instead of profiling")
    ap.add_argument("--quick", action="store_true", help="fewer steps (a CPU try)")
    ap.add_argument("--warmup", type=int, default=3, help="plain loop steps not timed")
    ap.add_argument("--steps", type=int, default=10, help="plain loop steps timed")
    ap.add_argument("--train", type=int, default=40, help="planner train steps")
    ap.add_argument("--train-warmup", type=int, default=5, help="planner train steps not timed")
    ap.add_argument("--time-limit", type=float, default=20.0, help="ILP time limit, s")
    ap.add_argument("--budget-s", type=float, default=420.0,
                    help="wall-clock budget: phases that would start after it are skipped")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if gpu_single.missing_gpu(args.device, "gpu_compile"):
        return 2
    if args.quick:
        args.warmup, args.steps, args.train, args.train_warmup = 2, 3, 12, 2
    start = time.perf_counter()
    os.makedirs(args.out, exist_ok=True)
    result: dict[str, Any] = {"benchmark": "gpu_compile", "args": vars(args)}
    cluster = gpu_single._cluster(args, result)

    def over_budget() -> bool:
        return time.perf_counter() - start > args.budget_s

    # every plan before the parent touches the GPU: the planner forks
    pairs = {m: _plan_pair(m, cluster, args) for m in args.models}
    result["cases"] = [c.record for pair in pairs.values() for c in pair.values()]
    path = os.path.join(args.out, "gpu_compile.json")

    def save() -> None:
        peak = datasheet_peak_flops(args.device)
        result["models"] = [_summary(pair, peak) for pair in pairs.values()]
        result["wall_s"] = round(time.perf_counter() - start, 1)
        with open(path, "w") as f:
            json.dump(result, f, indent=1, default=str)
            f.write("\n")

    for pair in pairs.values():
        _run_model(pair, args, over_budget, save)
    result["machine"] = _guard(result, "machine", lambda: gpu_single.machine(args.device))
    save()
    for row in result["models"]:
        print(f"{row['model']} {row['batch_size']}x{row['seq_len']}:")
        for key, k in row["kinds"].items():
            mfu = f"{k['mfu']:.3f}" if k["mfu"] else "-"
            tps = f"{k['tokens_per_s']:,.0f}" if k["tokens_per_s"] else "-"
            print(f"  {k['label']:<26} {tps:>12} tokens/s  MFU {mfu}")
        print(f"  predicted/measured: eager {row['predicted_over_measured_eager']}, "
              f"compiled {row['predicted_over_measured_compiled']}")
    print(f"wrote {path} ({result['wall_s']:.0f} s)")
    failed = any(c.get("errors") for c in result["cases"]) or result.get("errors")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
