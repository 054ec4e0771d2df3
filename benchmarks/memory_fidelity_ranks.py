"""Per-rank peak memory of multi-rank plans against their predictions (``memory_fidelity.py --ranks``).

A small model (default ``llama-4x256`` in bf16-mixed) under four plans on
``local-cpu:4`` (:data:`RANK_PLANS`: the 2 x 2 search, two 1F1B pipeline stages
of 2 ranks, ZeRO-3 over 4 ranks, context parallelism of 2), each run by
torchrun (gloo, 4 CPU ranks); on every rank the 2nd step of
``parallelize(plan)`` counted by :class:`benchmarks.live_storages.LiveStorages`,
against the rank's predicted peak (:func:`rank_predicted_peak`: the ranks of a
pipeline run different stages). Units: bytes (MB = 1e6 bytes).

``python -m benchmarks.memory_fidelity_ranks PLAN OUT`` is one rank of a run
(started by torchrun); the table is ``python benchmarks/memory_fidelity.py --ranks``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from typing import Any

import torch

from benchmarks.common import (load_average, machine_block, training_step, write_results,
                               wrote_message)
from benchmarks.live_storages import LiveStorages
from benchmarks.memory_models import MODELS, build, model_source

__all__ = ["RANK_PLANS", "RANK_WORLD", "make_rank_plan", "mb", "one_line", "ranks_main",
           "rank_predicted_peak", "rank_worker", "run_rank_plan"]

#: predicted / measured within [1 - UNDER, 1 + TOLERANCE]
TOLERANCE = 0.05
UNDER = 0.03


def one_line(err: BaseException) -> str:
    """The first line of ``err``'s message."""
    text = str(err).strip()
    return text.splitlines()[0] if text else ""


def mb(x: Any) -> str:
    """Bytes as MB (1e6 bytes), or ``-``."""
    return f"{x / 1e6:,.1f}" if isinstance(x, (int, float)) else "-"


#: plan kinds of the multi-rank table, on 4 CPU ranks (local-cpu:4, gloo)
RANK_PLANS = ("2x2", "pp2-1f1b", "zero3", "cp2")
RANK_WORLD = 4
DEFAULT_RANKS_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                 "memory_fidelity_ranks.json")


def make_rank_plan(kind: str, name: str, precision: str, time_limit_s: float) -> Any:
    """A ``kind`` plan (:data:`RANK_PLANS`) of model ``name`` on ``local-cpu:4``:
    ``2x2`` the search on a (2, 2) mesh; ``pp2-1f1b`` two stages of a (2,) mesh,
    1F1B over 2 micro-batches; ``zero3`` one stage of 4 ranks under ZeRO-3
    (FSDP2), 1F1B over 2 micro-batches; ``cp2`` context parallelism of 2."""
    from planner.api import pipeline_plan, plan as search_plan

    _, _, batch, seq, _, _ = MODELS[name]
    model, inputs = build(name, "meta", batch, seq)
    common = dict(example_inputs=inputs, model_source=model_source(name), precision=precision,
                  zoo_kwargs={"batch_size": batch, "seq_len": seq}, time_limit_s=time_limit_s)
    cluster = f"local-cpu:{RANK_WORLD}"
    if kind == "2x2":
        return search_plan(model, cluster, mesh_shape=(2, 2), **common)
    if kind == "pp2-1f1b":
        return pipeline_plan(model, cluster, pp=2, stage_mesh=(2,), schedule="1f1b",
                             num_microbatches=2, **common)
    if kind == "zero3":
        return pipeline_plan(model, cluster, pp=1, stage_mesh=(4,), schedule="1f1b",
                             num_microbatches=2, zero_stage=3, **common)
    if kind == "cp2":
        return search_plan(model, cluster, context_parallel=(2,), pp=(1,), **common)
    raise ValueError(f"unknown plan kind {kind!r}; one of {', '.join(RANK_PLANS)}")


def rank_worker(plan_path: str, out_path: str) -> None:
    """One rank under torchrun: :func:`measure_executor_step`'s count on this
    rank's part of the plan (``parallelize``, the model built on meta, every
    storage counted from before the build), written to ``out_path`` by rank 0
    with every rank's figures."""
    import json

    import torch.distributed as dist

    from codegen.parallel_model import parallelize
    from codegen.plan_model import build_plan_model
    from plan.format import load_plan

    plan = load_plan(plan_path)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    t0 = time.perf_counter()
    with warnings.catch_warnings(), LiveStorages(track_resizes=True) as live:
        warnings.simplefilter("ignore")
        _, meta_inputs = build_plan_model(plan, "meta")
        inputs = tuple(torch.zeros(t.shape, dtype=t.dtype) if isinstance(t, torch.Tensor)
                       else t for t in meta_inputs)
        runtime = parallelize(plan)
        built = live.reset_peak()
        # the update planner train runs: multi-tensor where the runtime can
        # (codegen.grad_reduction.prefer_foreach); a ZeRO-1 stage mixes its
        # plain master slices with DTensors, which one foreach call refuses
        opt = runtime.optimizer(torch.optim.AdamW, lr=1e-4)
        losses: list[float] = []
        step = training_step(runtime, inputs, opt, losses)
        step()
        before = live.reset_peak()
        step()
        row = {"rank": rank, "peak_bytes": int(live.peak), "before_step_bytes": int(before),
               "built_bytes": int(built), "losses": losses,
               "wall_s": round(time.perf_counter() - t0, 2)}
    rows: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(rows, f)
    dist.barrier()
    dist.destroy_process_group()


def run_rank_plan(kind: str, name: str, precision: str, time_limit_s: float,
                  timeout_s: float) -> dict[str, Any]:
    """Plan ``kind``, run it on :data:`RANK_WORLD` CPU ranks (torchrun, gloo)
    and compare each rank's measured peak with the plan's prediction."""
    import json
    import subprocess
    import tempfile

    from benchmarks.common import job_env

    row: dict[str, Any] = {"plan": kind, "model": name, "precision": precision}
    t0 = time.perf_counter()
    try:
        plan = make_rank_plan(kind, name, precision, time_limit_s)
    except Exception as err:  # noqa: BLE001 - one plan's failure is recorded
        row["error"] = f"plan: {type(err).__name__}: {one_line(err)}"
        return row
    row["plan_s"] = round(time.perf_counter() - t0, 1)
    memory = dict(plan.predicted.get("memory_bytes_per_device", {}))
    row.update(mesh=list(plan.mesh_shape), predicted=memory,
               checkpoint=len(plan.checkpoint),
               context_parallel=plan.training.get("context_parallel"))
    if plan.pipeline is not None:
        row.update(pp=plan.pipeline.pp, schedule=plan.pipeline.schedule,
                   num_microbatches=plan.pipeline.num_microbatches,
                   zero_stages=[st.zero_stage for st in plan.pipeline.stages])
    with tempfile.TemporaryDirectory(prefix="memory-ranks-") as workdir:
        plan_path, out = os.path.join(workdir, "plan.json"), os.path.join(workdir, "ranks.json")
        plan.save(plan_path)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={RANK_WORLD}", "-m", "benchmarks.memory_fidelity_ranks",
               plan_path, out]
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, env=job_env(), capture_output=True, text=True,
                                  timeout=timeout_s)
        except subprocess.TimeoutExpired:
            row["error"] = f"run: over {timeout_s:.0f} s"
            return row
        row["run_s"] = round(time.perf_counter() - t0, 1)
        if proc.returncode != 0 or not os.path.exists(out):
            first = proc.stderr.find("Traceback")
            row["error"] = "run: " + proc.stderr[max(first, 0):][-1500:]
            return row
        with open(out) as f:
            ranks = json.load(f)
    for r in ranks:
        r["predicted_peak_bytes"] = peak = rank_predicted_peak(plan, r["rank"])
        r["ratio"] = peak / r["peak_bytes"] if peak and r["peak_bytes"] else None
    row["ranks"] = ranks
    return row


def rank_predicted_peak(plan: Any, rank: int) -> int | None:
    """The predicted peak bytes of ``rank``: the plan's peak per device, or in a
    pipeline of several ranks the summed peaks of the stages that ``rank``
    runs (plan.json's ``pipeline.stages[*].predicted``), plus what the plan
    adds to every rank beyond its stages (a context-parallel exchange's
    buffers)."""
    peak = plan.predicted.get("memory_bytes_per_device", {}).get("peak")
    if peak is None or plan.pipeline is None or plan.pipeline.pp == 1:
        return peak
    by_rank: dict[int, int] = {}
    for st in plan.pipeline.stages:
        for r in st.ranks:
            by_rank[r] = by_rank.get(r, 0) + int(st.predicted["memory_bytes_per_device"]["peak"])
    return by_rank[rank] + max(0, int(peak) - max(by_rank.values()))


def print_rank_table(rows: list[dict[str, Any]]) -> None:
    head = (f"{'plan':<9} {'mesh':<7} {'rank':>4} {'pred MB':>9} {'before MB':>10} "
            f"{'peak MB':>9} {'ratio':>6}")
    print(head)
    print("-" * len(head))
    for row in rows:
        if "error" in row:
            print(f"{row['plan']:<9} error: {row['error'][:300]}")
            continue
        mesh = "x".join(map(str, row["mesh"]))
        for r in row["ranks"]:
            ratio = f"{r['ratio']:.3f}" if r.get("ratio") else "-"
            print(f"{row['plan']:<9} {mesh:<7} {r['rank']:>4} "
                  f"{mb(r.get('predicted_peak_bytes')):>9} {mb(r['before_step_bytes']):>10} "
                  f"{mb(r['peak_bytes']):>9} {ratio:>6}")


def ranks_main(args: argparse.Namespace) -> int:
    """The multi-rank table: each plan of ``args.rank_plans`` on 4 CPU ranks."""
    load_before = load_average()
    start = time.perf_counter()
    rows = []
    for kind in args.rank_plans:
        row = run_rank_plan(kind, args.rank_model, args.rank_precision, args.time_limit,
                            args.rank_timeout)
        rows.append(row)
        ratios = [r["ratio"] for r in row.get("ranks", []) if r.get("ratio")]
        print(f"  {kind}: " + (row["error"][:200] if "error" in row else
                               f"ratios {min(ratios):.3f}-{max(ratios):.3f}"), flush=True)
    print()
    print_rank_table(rows)
    result = {
        "benchmark": "memory_fidelity_ranks",
        "definition": (f"predicted = plan.predicted['memory_bytes_per_device']['peak'] of each "
                       f"plan on local-cpu:{RANK_WORLD} (in a pipeline the summed peaks of the "
                       "rank's stages, pipeline.stages[*].predicted, plus what the plan adds "
                       "to every rank); measured = on every rank (torchrun, "
                       f"gloo, {RANK_WORLD} CPU ranks) the peak of the 2nd step of "
                       "parallelize(plan) (model built on meta by the runtime; "
                       "ParallelModel.step, AdamW foreach step, zero_grad), every tensor "
                       "storage alive counted from before the build (LiveStorages, storage "
                       "resizes read at every op); ratio = predicted / measured"),
        "tolerance": {"over": TOLERANCE, "under": UNDER},
        "machine": machine_block(load_before, after=True),
        "rows": rows,
        "wall_s": round(time.perf_counter() - start, 1),
    }
    write_results(args.ranks_out, result)
    print(wrote_message(args.ranks_out, result))
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    rank_worker(*sys.argv[1:3])
