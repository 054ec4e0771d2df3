"""Long context: llama3-8b at 131,072 tokens per sequence on 64 H100s, the automatic
plan against Megatron-LM's configurations with and without context parallelism.

    OMP_NUM_THREADS=1 python benchmarks/long_context.py        # ~5-10 min on 2 cores

Cluster ``dgx-h100:8`` (8 nodes of 8 H100 80 GB, the datasheet preset), a global
batch of 16 sequences of 131,072 tokens (2M tokens), bf16-mixed, Adam:

* auto: ``planner.plan`` with the default search, which at this length also
  searches context parallelism (cp = 2, 4, ... with everything else its own
  choice, priced as Megatron's cp is: :mod:`planner.search.cp_search`), and
  the same search without it (``context_parallel=(1,)``) beside it;
* Megatron: the configurations a practitioner tries at this length: tp = 8 with
  sequence parallelism, micro-batches of one sequence, pp in 1, 2, 4 and cp in
  1, 2, 4, 8 (the distributed optimizer; Megatron's ring exchange,
  ``cp_comm_type="p2p"``), each priced by :func:`planner.baselines.megatron.megatron_plan`.
  A configuration that does not fit is recorded with its reason.

Writes ``benchmarks/results/long_context.json``: every configuration's predicted
step (seconds), tokens/s and peak bytes per device, the best Megatron with cp > 1,
the best without, and the automatic plans (with its cp and exchange, and without
cp). Units: seconds, bytes, tokens per second.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.common import load_average, machine_block, write_results, wrote_message  # noqa: E402

MODEL, CLUSTER, BATCH, SEQ = "llama3-8b", "dgx-h100:8", 16, 131072
DEFAULT_OUT = os.path.join(HERE, "results", "long_context.json")


def _summary(plan: Any) -> dict[str, Any]:
    pred = plan.predicted
    step = pred["step_time_s"]
    cp = (plan.training or {}).get("context_parallel") or {}
    budget = (plan.training or {}).get("memory_budget_bytes")
    peak = pred["memory_bytes_per_device"].get("peak")
    return {"step_time_s": step, "tokens_per_s": BATCH * SEQ / step,
            "peak_bytes": peak, "cp": cp.get("size", 1), "cp_comm_type": cp.get("comm_type"),
            **({"memory_budget_bytes": budget, "peak_over_budget": peak / budget}
               if budget and peak else {}),
            "mesh": list(plan.mesh_shape),
            "pipeline": None if plan.pipeline is None else {
                "schedule": plan.pipeline.schedule, "pp": plan.pipeline.pp,
                "num_microbatches": plan.pipeline.num_microbatches,
                "stage_mesh": plan.pipeline.stage_mesh["shape"]}}


def megatron_rows(time_limit_s: float) -> list[dict[str, Any]]:
    """Each configuration of the grid, priced or with the reason it does not fit."""
    from costmodel.presets import load_cluster
    from models.source import build_model
    from planner.baselines.megatron import MegatronDoesNotFit, megatron_configs, megatron_plan
    from planner.request import PlanningError

    cluster = load_cluster(CLUSTER)
    model, inputs = build_model(MODEL, device="meta", batch_size=BATCH, seq_len=SEQ)
    configs = [c for c in megatron_configs(cluster, BATCH, 32, micro_batch_sizes=(1,),
                                           virtual_stages=(None,), sequence_parallel=(True,),
                                           context_parallel=(1, 2, 4, 8), seq_len=SEQ)
               if c.tp == 8 and c.pp in (1, 2, 4) and c.micro_batch_size == 1]
    rows = []
    for cfg in configs:
        t0 = time.perf_counter()
        row: dict[str, Any] = {"config": cfg.label(), "tp": cfg.tp, "pp": cfg.pp, "cp": cfg.cp,
                               "dp": cfg.dp}
        try:
            plan = megatron_plan(model, cluster, cfg, example_inputs=inputs,
                                 model_source=MODEL, zoo_kwargs={"batch_size": BATCH,
                                                                 "seq_len": SEQ},
                                 time_limit_s=time_limit_s)
            row.update(_summary(plan))
        except (MegatronDoesNotFit, PlanningError) as err:
            row["does_not_fit"] = str(err).splitlines()[0]
        row["planning_s"] = round(time.perf_counter() - t0, 1)
        print(f"  {row['config']}: " + (f"{row['step_time_s']:.3f} s" if "step_time_s" in row
                                        else row["does_not_fit"][:120]), flush=True)
        rows.append(row)
    return rows


def auto_row(time_limit_s: float, context_parallel: tuple[int, ...] | None = None
             ) -> dict[str, Any]:
    """The automatic plan (``context_parallel``: as :class:`planner.api.PlanRequest`;
    None searches cp as the planner does by default)."""
    from models.source import build_model
    from planner.api import plan

    model, inputs = build_model(MODEL, device="meta", batch_size=BATCH, seq_len=SEQ)
    t0 = time.perf_counter()
    p = plan(model, CLUSTER, example_inputs=inputs, model_source=MODEL,
             zoo_kwargs={"batch_size": BATCH, "seq_len": SEQ}, time_limit_s=time_limit_s,
             context_parallel=context_parallel)
    return {**_summary(p), "planning_s": round(time.perf_counter() - t0, 1)}


def _best(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    fits = [r for r in rows if "step_time_s" in r]
    return min(fits, key=lambda r: r["step_time_s"]) if fits else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--time-limit", type=float, default=10.0, help="ILP limit per solve, s")
    ap.add_argument("--out", default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    load_before, start = load_average(), time.monotonic()
    auto = auto_row(args.time_limit)
    print(f"auto: {auto['step_time_s']:.3f} s, cp={auto['cp']}, {auto['tokens_per_s']:,.0f} "
          f"tokens/s, planned in {auto['planning_s']} s", flush=True)
    auto_without_cp = auto_row(args.time_limit, (1,))
    print(f"auto without cp: {auto_without_cp['step_time_s']:.3f} s", flush=True)
    rows = megatron_rows(args.time_limit)
    with_cp = _best([r for r in rows if r["cp"] > 1])
    without_cp = _best([r for r in rows if r["cp"] == 1])
    result = {
        "machine": machine_block(load_before), "model": MODEL, "cluster": CLUSTER,
        "global_batch": BATCH, "seq_len": SEQ, "precision": "bf16-mixed",
        "auto": auto, "auto_without_cp": auto_without_cp, "megatron": rows,
        "best_megatron_with_cp": with_cp,
        "best_megatron_without_cp": without_cp,
        "auto_over_best_with_cp": (with_cp["step_time_s"] / auto["step_time_s"]
                                   if with_cp else None),
        "wall_s": round(time.monotonic() - start, 1)}
    write_results(args.out, result)
    for name, row in (("best Megatron with cp", with_cp), ("best Megatron without cp",
                                                          without_cp)):
        print(f"{name}: " + (f"{row['config']} {row['step_time_s']:.3f} s" if row else "none fits"))
    print(wrote_message(args.out, result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
