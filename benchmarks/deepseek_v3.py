"""DeepSeek-V3 on 256 H800 nodes (2048 GPUs): the automatic plan against the
published layout, both priced by the same cost model.

The published layout (DeepSeek-V3 technical report, section 3.2): 16-way
pipeline parallelism with DualPipe (``dualpipev``), 64-way expert parallelism
over 8 nodes, ZeRO-1 data parallelism, no tensor parallelism
(:mod:`planner.baselines.deepseek_layout`). The automatic plan is :func:`planner.plan`
with its defaults. Each side's predicted step, memory per device by kind and
communication are recorded; a side that does not fit the device is recorded
with the error, and priced once more with the memory budget lifted
(``--lifted-budget-gib``) so that its step time can still be compared.

    OMP_NUM_THREADS=1 python -m benchmarks.deepseek_v3 [--batch 4096] [--skip-auto] [--repeats 3]

Writes ``benchmarks/results/deepseek_v3.json``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from typing import Any

from benchmarks.common import (cpu_pair_probe, cpu_speed_probe, git_commit, machine_info,
                               write_results)

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
CLUSTER = "h800:256"
SEQ_LEN = 4096


def _summary(plan: Any, seconds: float) -> dict[str, Any]:
    """What the note compares: the plan's layout, predicted step and memory."""
    out: dict[str, Any] = {"planning_s": round(seconds, 1), "mesh": list(plan.mesh_shape),
                           "predicted": plan.predicted}
    if plan.pipeline is not None:
        pipe = plan.pipeline
        out["pipeline"] = {"schedule": pipe.schedule, "pp": pipe.pp,
                           "num_microbatches": pipe.num_microbatches,
                           "stage_mesh": list(pipe.stage_mesh["shape"]),
                           "zero_stages": sorted({st.zero_stage for st in pipe.stages})}
    experts = {k: v for k, v in plan.parameters.items()
               if k.startswith("moe_layers.") and k.endswith("feed_forward.w1")}
    out["expert_placements"] = dict(sorted(experts.items())[:2])
    return out


def _auto(model: Any, inputs: tuple, repeats: int) -> dict[str, Any]:
    """The automatic plan, made ``repeats`` times: each time with the CPU
    probes taken just before (the machine's speed drifts from hour to hour,
    :func:`benchmarks.common.cpu_speed_probe`), and the summary of the last
    (every repeat must give the same step, or the plan is not deterministic)."""
    from planner.api import plan

    runs, steps = [], set()
    for _ in range(repeats):
        probes = {"cpu_speed_probe_s": round(cpu_speed_probe(), 3),
                  "cpu_pair_probe_s": round(cpu_pair_probe(), 3)}
        t0 = time.perf_counter()
        result = plan(model, CLUSTER, example_inputs=inputs, model_source="deepseek-v3")
        out = _summary(result, time.perf_counter() - t0)
        runs.append({"planning_s": out["planning_s"], **probes})
        steps.add(result.predicted["step_time_s"])
    if len(steps) > 1:
        raise RuntimeError(f"the repeats planned different steps: {sorted(steps)}")
    return {**out, "runs": runs}


def _published(model: Any, inputs: tuple, lifted_gib: float) -> dict[str, Any]:
    from planner.baselines.deepseek_layout import deepseek_plan
    from planner.baselines.megatron import MegatronDoesNotFit

    t0 = time.perf_counter()
    try:
        result = deepseek_plan(model, CLUSTER, example_inputs=inputs, model_source="deepseek-v3")
        return _summary(result, time.perf_counter() - t0)
    except MegatronDoesNotFit as err:
        out: dict[str, Any] = {"fits": False, "error": str(err)}
    t0 = time.perf_counter()
    try:
        lifted = deepseek_plan(model, CLUSTER, example_inputs=inputs, model_source="deepseek-v3",
                               memory_budget=lifted_gib * 2**30)
        out["with_lifted_budget"] = {"budget_gib": lifted_gib,
                                     **_summary(lifted, time.perf_counter() - t0)}
    except MegatronDoesNotFit as err:
        out["with_lifted_budget"] = {"budget_gib": lifted_gib, "error": str(err)}
    return out


def main(argv: list[str] | None = None) -> int:
    from models.source import build_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=4096,
                    help="global batch, sequences (DualPipeV needs 32 micro-batches per dp rank)")
    ap.add_argument("--skip-auto", action="store_true")
    ap.add_argument("--repeats", type=int, default=1,
                    help="plan the automatic side this many times (planning time spread)")
    ap.add_argument("--lifted-budget-gib", type=float, default=1024.0)
    ap.add_argument("--out", default=os.path.join(RESULTS, "deepseek_v3.json"))
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error(f"--repeats must be at least 1, got {args.repeats}")
    warnings.simplefilter("ignore")
    commit = git_commit()
    model, inputs = build_model("deepseek-v3", device="meta", batch_size=args.batch,
                                seq_len=SEQ_LEN)
    results: dict[str, Any] = {"machine": machine_info(brief=True), "git_commit": commit,
                               "cluster": CLUSTER, "batch": args.batch, "seq_len": SEQ_LEN}
    results["published"] = _published(model, inputs, args.lifted_budget_gib)
    print("published:", results["published"].get("error", "fits"), flush=True)
    if not args.skip_auto:
        results["auto"] = _auto(model, inputs, args.repeats)
        print("auto:", results["auto"]["predicted"], flush=True)
    write_results(args.out, results)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
