"""A compiled plan's step time against a compiled plain loop and eager, one CPU rank.

    OMP_NUM_THREADS=1 python -m benchmarks.compile_speed            # writes results JSON

For each model: a plan for one device (``planner.plan(mesh_shape=(1,))``) run by
:class:`codegen.executor.PlanExecutor` as ``planner train`` runs it, eager and
with ``training.compile`` (:mod:`codegen.compiled_program`: the program's
GraphModule through ``torch.compile``), against
:class:`benchmarks.plain_loop.PlainLoop` of the same model eager and with the
model wrapped in ``torch.compile``. All four train with AdamW (foreach),
gradients set to None after each step, in this one process (a gloo group of
one rank), on one thread, fp32. Their steps alternate (``--rounds`` rounds of
``--steps`` steps each, after warm-up, which compiles) so that load elsewhere
on the machine falls on all alike; each one's step time is the median of its
steps. The goal: the compiled plan at least 0.95x as fast as the compiled plain
loop (``compiled_plan_speed_vs_compiled_loop`` >= 0.95) and faster than eager.

Writes ``benchmarks/results/compile_speed.json``. Units: seconds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from typing import Any, Callable

from benchmarks.common import machine_info, add_timing_args, time_alternating, write_results
from benchmarks.executor_vs_loop import _model, _plan, executor_step

DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                           "compile_speed.json")
#: (zoo name, batch size, sequence length) measured by default
CASES = [("gpt-tiny", 8, 32), ("llama-tiny", 8, 32)]


def _loop_step(name: str, batch: int, seq: int, compiled: bool) -> Callable[[], Any]:
    """One step of the plain loop of the same model (its module compiled or not)."""
    import torch

    from benchmarks.plain_loop import PlainLoop

    torch.manual_seed(0)
    model, inputs = _model(name, batch, seq, "cpu")
    return PlainLoop(torch.compile(model) if compiled else model, inputs).step


def _one_case(name: str, batch: int, seq: int, eager_plan: Any,
              args: argparse.Namespace) -> dict[str, Any]:
    plan_eager, _ = executor_step(eager_plan, name, batch, seq)
    plan_compiled, executor = executor_step(eager_plan.with_compile(True), name, batch, seq)
    steps = {"plan_eager": plan_eager, "plan_compiled": plan_compiled,
             "loop_eager": _loop_step(name, batch, seq, False),
             "loop_compiled": _loop_step(name, batch, seq, True)}
    first = time_alternating(steps, warmup=0, rounds=1, each=1)  # compiles the compiled two
    timed = time_alternating(steps, warmup=args.warmup - 1, rounds=args.rounds, each=args.steps)
    median = {kind: statistics.median(ts) for kind, ts in timed.items()}
    return {"model": name, "batch_size": batch, "seq_len": seq, "precision": "fp32",
            "step_s": median, "first_step_s": {kind: ts[0] for kind, ts in first.items()}, "steps_each": args.rounds * args.steps,
            "compile_regions": executor.compile_report.lines(),
            "compiled_plan_speed_vs_compiled_loop":
                median["loop_compiled"] / median["plan_compiled"],
            "compiled_plan_speed_vs_plan_eager": median["plan_eager"] / median["plan_compiled"],
            "compiled_plan_speed_vs_loop_eager": median["loop_eager"] / median["plan_compiled"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_timing_args(ap, steps=4, out=DEFAULT_OUT)
    args = ap.parse_args(argv)

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    # made before the process group exists: the planner forks
    plans = {name: _plan(name, batch, seq, "fp32", False) for name, batch, seq in CASES}
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29573")
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        results = [_one_case(name, batch, seq, plans[name], args)
                   for name, batch, seq in CASES]
    finally:
        dist.destroy_process_group()
    for r in results:
        ms = {k: f"{v * 1e3:.2f} ms" for k, v in r["step_s"].items()}
        print(f"{r['model']:12s} {ms}  compiled plan / compiled loop speed "
              f"{r['compiled_plan_speed_vs_compiled_loop']:.3f}")
    write_results(args.out, {"benchmark": "compile_speed", "torch": torch.__version__,
                             "threads": 1, "machine": machine_info(brief=True),
                             "goal_speed_vs_compiled_loop": 0.95, "cases": results})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
