"""The plan the search picks under ``--compile`` against the one it picks
eagerly, both run compiled: does the measured step agree with the switch?

    python -m benchmarks.compile_switch                  # llama-tiny on local-cpu:2
    python -m benchmarks.compile_switch --model gpt-tiny --ranks 2 --steps 10
    python -m benchmarks.compile_switch --cluster local-cpu-2.json   # a profiled cluster
    python -m benchmarks.compile_switch --cluster local-cpu-2.json --memory-budget-mib 3.5

Plans ``--model`` on ``local-cpu:RANKS`` twice (eager pricing, compiled
pricing), runs each plan compiled (``training.launch.launch(compile=True)``,
the first ``--warmup`` steps of each run dropped: the first compiles) in
rounds, the order of the plans reversed every other round, and writes
``benchmarks/results/compile_switch.json``: each plan's layout, its predicted
step as the search priced it, its predicted compiled step (the eager pick
planned again under ``compile=True`` with its layout pinned: mesh, stages,
micro-batches, ZeRO stage, schedule) and its measured median; with
``--eager-too`` each plan also runs eager in the same rounds, beside its eager
prediction (the compiled pick planned again eagerly, pinned the same way).
Each round gives each plan a median; ``paired`` is the compiled pick's step
over the eager pick's, round by round (the machine's drift falls on both),
with a bootstrap interval: the switch is ``shown`` when the whole interval
lies below 1.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import tempfile
import warnings
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import (load_average, machine_block, report_results,  # noqa: E402
                               torch_speed_probe)
from benchmarks.stats import median_after_warmup, paired_ratio  # noqa: E402
from models.source import build_model  # noqa: E402
from planner.api import plan  # noqa: E402
from training.launch import launch  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def plan_layout(p: Any) -> dict[str, Any]:
    """What distinguishes one plan from another, in a few fields."""
    pipe = p.pipeline
    return {"mesh": list(p.mesh_shape),
            "stages": len(pipe.stages) if pipe is not None else 1,
            "schedule": pipe.schedule if pipe is not None and len(pipe.stages) > 1 else None,
            "microbatches": pipe.num_microbatches if pipe is not None else 1,
            "zero_stage": pipe.zero_stage if pipe is not None else 0,
            "checkpointed": len(p.checkpoint or [])}


def _cluster_file(cluster: str) -> dict[str, Any] | None:
    """The cluster file's contents (a `planner profile` cluster), so that the
    result says what the plans were priced on; None for a preset."""
    if not os.path.isfile(cluster):
        return None
    with open(cluster) as f:
        return json.load(f)


def _pinned(p: Any) -> dict[str, Any]:
    """Plan options that make the search give ``p``'s layout again."""
    pipe = p.pipeline
    if pipe is None:
        return {"mesh_shape": tuple(p.mesh_shape), "num_microbatches": (1,), "zero_stages": (0,)}
    return {"pp": (len(pipe.stages) // pipe.stages_per_rank,), "schedules": (pipe.schedule,),
            "num_microbatches": (pipe.num_microbatches,), "zero_stages": (pipe.zero_stage,)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-tiny")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--steps", type=int, default=8, help="steps per run")
    ap.add_argument("--warmup", type=int, default=1,
                    help="steps dropped at the start of each run (the first compiles)")
    ap.add_argument("--rounds", type=int, default=2, help="alternating runs of each plan")
    ap.add_argument("--cluster", default=None,
                    help="cluster the plans are priced on: a preset or a `planner profile` "
                         "cluster file of RANKS devices (default local-cpu:RANKS)")
    ap.add_argument("--memory-budget-mib", type=float, default=None,
                    help="memory per device both searches may use (MiB; default the device's)")
    ap.add_argument("--pp", default=None,
                    help="pipeline sizes both searches may use, e.g. 1 (default: any)")
    ap.add_argument("--eager-too", action="store_true",
                    help="also run both plans eager, in the same alternating rounds")
    ap.add_argument("-o", "--output", default=os.path.join(RESULTS, "compile_switch.json"))
    args = ap.parse_args(argv)
    load_before, speed_before = load_average(), torch_speed_probe()
    cluster = args.cluster or f"local-cpu:{args.ranks}"
    model, inputs = build_model(args.model, device="meta", batch_size=args.batch_size)
    kw = dict(example_inputs=inputs, model_source=args.model,
              zoo_kwargs={"batch_size": args.batch_size})
    if args.memory_budget_mib is not None:
        kw["memory_budget"] = args.memory_budget_mib * 2**20
    if args.pp is not None:
        kw["pp"] = tuple(int(x) for x in args.pp.split(","))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        picked = {"eager": plan(model, cluster, **kw),
                  "compiled": plan(model, cluster, compile=True, **kw)}
    rows: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="compile-switch-") as tmp:
        paths = {}
        for name, p in picked.items():
            paths[name] = os.path.join(tmp, f"{name}.json")
            p.with_compile(True).save(paths[name])
            compiled = p if name == "compiled" else plan(model, cluster, compile=True,
                                                         **{**kw, **_pinned(p)})
            rows[name] = {"layout": plan_layout(p),
                          "predicted_as_priced_s": p.predicted["step_time_s"],
                          "predicted_compiled_s": compiled.predicted["step_time_s"],
                          "steps_s": [], "round_medians_s": []}
            if args.eager_too:
                eager = p if name == "eager" else plan(model, cluster, **{**kw, **_pinned(p)})
                rows[name].update(predicted_eager_s=eager.predicted["step_time_s"],
                                  eager_steps_s=[], eager_round_medians_s=[])
        runtimes = [(True, "")] + ([(False, "eager_")] if args.eager_too else [])
        for round_index in range(args.rounds):
            order = list(paths.items())[::-1 if round_index % 2 else 1]
            for (compiles, key), (name, path) in itertools.product(runtimes, order):
                res = launch(path, steps=args.steps, check=False, compile=compiles,
                             timeout_s=900)
                kept = res["step_times_s"][args.warmup:] or res["step_times_s"][-1:]
                rows[name][key + "steps_s"] += kept
                rows[name][key + "round_medians_s"].append(median_after_warmup(kept, 0))
    for row in rows.values():
        row["measured_median_s"] = median_after_warmup(row["steps_s"], 0)
        if args.eager_too:
            row["measured_eager_median_s"] = median_after_warmup(row["eager_steps_s"], 0)
    paired = paired_ratio(rows["compiled"]["round_medians_s"], rows["eager"]["round_medians_s"])
    faster_measured = min(rows, key=lambda k: rows[k]["measured_median_s"])
    result = {"benchmark": "compile_switch",
              "machine": machine_block(load_before, speed_before=speed_before),
              "model": args.model, "cluster": cluster, "batch_size": args.batch_size,
              "memory_budget_mib": args.memory_budget_mib, "pp": args.pp,
              "profiled_cluster": _cluster_file(cluster),
              "steps": args.steps, "warmup_steps_dropped": args.warmup,
              "rounds": args.rounds, "plans": rows,
              "same_layout": rows["eager"]["layout"] == rows["compiled"]["layout"],
              "faster_measured": faster_measured,
              "switch_agrees": faster_measured == "compiled"
              or rows["eager"]["layout"] == rows["compiled"]["layout"],
              "paired_compiled_over_eager_pick": paired,
              "shown": rows["eager"]["layout"] != rows["compiled"]["layout"]
              and paired["high"] < 1.0,
              **({"faster_measured_eager": min(
                  rows, key=lambda k: rows[k]["measured_eager_median_s"])}
                 if args.eager_too else {}),
              "load_after": load_average()}
    return report_results(args.output, result, [
        f"{name:9s} {row['layout']}  measured {row['measured_median_s'] * 1e3:.1f} ms "
        f"(predicted as priced {row['predicted_as_priced_s'] * 1e3:.1f} ms, "
        f"compiled {row['predicted_compiled_s'] * 1e3:.1f} ms)"
        + (f"; eager measured {row['measured_eager_median_s'] * 1e3:.1f} ms "
           f"(predicted {row['predicted_eager_s'] * 1e3:.1f} ms)" if args.eager_too else "")
        for name, row in rows.items()] + [
        f"compiled pick / eager pick, paired by round: {paired['geomean']:.3f} "
        f"(90 % interval {paired['low']:.3f}-{paired['high']:.3f})"])


if __name__ == "__main__":
    sys.exit(main())
