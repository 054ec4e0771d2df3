"""A pipeline's (or a single stage's) predicted step against its measured one
as its micro-batches grow, eager and compiled.

    python -m benchmarks.pipeline_microbatches --cluster local-cpu-2.json
    python -m benchmarks.pipeline_microbatches --cluster local-cpu-2.json --schedules zbv \
        --microbatches 2 8
    python -m benchmarks.pipeline_microbatches --cluster local-cpu-2.json --mesh 2x1 \
        --zero 1 --recompute none all --microbatches 1 2 8 --batch-size 16

For each schedule and micro-batch count a plan of ``--model`` is pinned to a
pipeline over ``--pp`` ranks (``planner.api.plan(pp=..., schedules=...,
num_microbatches=..., zero_stages=(ZERO,))``), or with ``--mesh`` to one
stage on that mesh accumulating the micro-batches' gradients (``--zero``,
and with ``--recompute`` every layer checkpointed or none, each a run of its
own), once priced eager and once priced compiled, and each is run as priced
(``training.launch.launch``, ``--steps`` steps, the first two dropped: the
compiled program compiles in them). Writes
``benchmarks/results/pipeline_microbatches.json``: per run the plan's
layout, its predicted step and breakdown, and its measured median.
Units: seconds.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import tempfile
import warnings
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import (RESULTS_DIR, load_average, machine_block,  # noqa: E402
                               report_results, torch_speed_probe)
from benchmarks.compile_switch import plan_layout  # noqa: E402
from benchmarks.stats import median_after_warmup  # noqa: E402
from models.source import build_model  # noqa: E402
from planner.api import plan  # noqa: E402
from training.launch import launch  # noqa: E402

#: steps a run drops before its median (the compiled program compiles in them)
WARMUP_STEPS = 2

#: ``--recompute`` choices as :class:`planner.request.PlanRequest`'s ``recompute``
_RECOMPUTE = {"auto": None, "none": False, "all": True}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="benchmarks.step_models:llama_small")
    ap.add_argument("--cluster", default="local-cpu:2",
                    help="a cluster file (planner profile) or a preset")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--pp", type=int, default=2, help="ranks of the pipeline")
    ap.add_argument("--schedules", nargs="+", default=["1f1b", "zbv"])
    ap.add_argument("--microbatches", nargs="+", type=int, default=[2, 4, 8])
    ap.add_argument("--mesh", default=None,
                    help="one stage on this mesh, e.g. 2x1, instead of a pipeline")
    ap.add_argument("--zero", type=int, default=0, help="ZeRO stage of the stage(s)")
    ap.add_argument("--recompute", nargs="+", choices=("auto", "none", "all"), default=["auto"],
                    help="with --mesh: layers checkpointed as the search picks, none or all")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("-o", "--output", default=os.path.join(RESULTS_DIR, "pipeline_microbatches.json"))
    args = ap.parse_args(argv)
    if args.mesh is None and args.recompute != ["auto"]:
        ap.error("--recompute needs --mesh (a pipeline's checkpointing is the search's)")
    if args.mesh is not None:
        layout = {"pipeline": False, "mesh_shape": tuple(int(x) for x in args.mesh.split("x"))}
        args.schedules = [None]
    else:
        layout = {"pp": (args.pp,)}
    load_before, speed_before = load_average(), torch_speed_probe()
    model, inputs = build_model(args.model, device="meta", batch_size=args.batch_size)
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="pipeline-microbatches-") as tmp:
        for schedule, recompute, m, compiled in itertools.product(
                args.schedules, args.recompute, args.microbatches, (False, True)):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                p = plan(model, args.cluster, example_inputs=inputs, model_source=args.model,
                         zoo_kwargs={"batch_size": args.batch_size}, compile=compiled,
                         num_microbatches=(m,), zero_stages=(args.zero,), **layout,
                         **({"schedules": (schedule,)} if schedule else {}),
                         recompute=_RECOMPUTE[recompute])
            path = os.path.join(tmp, f"{schedule}-{recompute}-{m}-{compiled}.json")
            p.save(path)
            steps = launch(path, steps=args.steps, check=False, compile=compiled,
                           timeout_s=900)["step_times_s"]
            measured = median_after_warmup(steps, WARMUP_STEPS)
            runs.append({"schedule": schedule, "recompute": recompute, "microbatches": m,
                         "compiled": compiled,
                         "layout": plan_layout(p),
                         "predicted": {k: v for k, v in p.predicted.items()
                                       if k != "memory_bytes_per_device"},
                         "steps_s": steps, "measured_median_s": measured,
                         "ratio_measured_over_predicted": measured / p.predicted["step_time_s"]})
    result = {"benchmark": "pipeline_microbatches",
              "machine": machine_block(load_before, speed_before=speed_before),
              "model": args.model, "cluster": args.cluster, "batch_size": args.batch_size,
              "pp": args.pp if args.mesh is None else 1, "mesh": args.mesh,
              "zero_stage": args.zero, "warmup_steps_dropped": WARMUP_STEPS, "runs": runs,
              "load_after": load_average()}
    return report_results(args.output, result, [
        f"{r['schedule'] or 'stage':5s} x{r['microbatches']:<2d} "
        f"{'' if r['recompute'] == 'auto' else 'recompute ' + r['recompute'] + ' '}"
        f"{'compiled' if r['compiled'] else 'eager':8s} "
        f"predicted {r['predicted']['step_time_s'] * 1e3:7.1f} ms  measured "
        f"{r['measured_median_s'] * 1e3:7.1f} ms  ({r['ratio_measured_over_predicted']:.2f})"
        for r in runs])


if __name__ == "__main__":
    sys.exit(main())
