"""Single stages asked to shard or accumulate: a request for one stage (a
mesh given, or ``pipeline=False``) with ZeRO stages (``zero_stages``) or
micro-batches (``num_microbatches``) is planned as the two-level search plans
such stages: a pipeline of one stage (pp = 1) on the mesh, its micro-batches
run one after another (1F1B of one stage: the gradients accumulate), ZeRO
over the mesh's first axis (:class:`plan.format.StagePlan`). What one stage
cannot do (pp > 1, a schedule) is refused before this, with the request
(:class:`planner.request.PlanRequest`).

Every configuration asked for (mesh x ZeRO stage x micro-batches) is solved
exactly, without layer profiles: one stage has no cut to choose. The fastest
plan that fits is kept.

Units: seconds, bytes.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ir.graph import Graph
from plan.format import Plan
from planner.ilp.intra_op import MemoryInfeasibleError
from planner.ilp.problem import InfeasibleError
from planner.request import ClusterSettings, PlanRequest, PlanningError
from planner.search.context import SearchContext
from planner.search.finalists import assemble, solve_exact
from planner.search.plan_assembly import build_plan
from planner.search.settings import SearchSettings
from planner.search.stage_dp import (ACCUMULATING_SCHEDULE, PipelineCandidate,
                                     StageMeshOption, config_label, stage_mesh_options)
from planner.search.two_level import best_single_stage

__all__ = ["shards_or_accumulates", "single_stage_plan"]


def shards_or_accumulates(req: PlanRequest) -> bool:
    """Whether ``req`` asks for a ZeRO stage or for micro-batches: a plan of
    the whole batch on one stage (:func:`planner.search.two_level.best_single_stage`)
    has neither."""
    return any(req.zero_stages or ()) or any(m > 1 for m in req.num_microbatches or ())


def single_stage_plan(req: PlanRequest, model: torch.nn.Module, example_inputs: tuple,
                      graph: Graph, settings: ClusterSettings, info: dict[str, Any],
                      training: dict[str, Any],
                      progress: Callable[[str], None] | None = None) -> Plan:
    """The fastest single stage on ``settings.mesh_shapes`` with a ZeRO stage
    of ``req.zero_stages`` (None: 0) and a micro-batch count of
    ``req.num_microbatches`` (None: 1), that fits ``settings.memory_budget``
    bytes per device; ``req.recompute`` pins checkpointing as it does for the
    whole batch. ZeRO 0 with 1 micro-batch is the whole-batch plan
    (:func:`planner.search.two_level.best_single_stage`); each other pair is a
    pipeline of one stage. ZeRO is left out on meshes whose first axis has one
    rank. ``graph``: the captured whole-batch program.

    Raises:
        PlanningError: a micro-batch count that does not divide the batch, no
            mesh with more than one rank on its first axis when only ZeRO is
            asked for, or no configuration fits (the message gives the least
            memory per device one needs).
    """
    cluster = settings.cluster
    zeros = tuple(req.zero_stages or (0,))
    counts = tuple(req.num_microbatches or (1,))
    ctx = SearchContext(model, example_inputs,
                        SearchSettings(cluster, settings.precision, req.optimizer,
                                       settings.memory_budget, req.time_limit_s),
                        progress=progress, whole_batch_graph=graph)
    bad = [m for m in counts if ctx.global_batch % m]
    if bad:
        raise PlanningError(f"{', '.join(map(str, bad))} micro-batches do not divide the batch "
                            f"of {ctx.global_batch}: give --microbatches that divide it")
    whole = stage_mesh_options(cluster, 1)[0]
    configs = [(StageMeshOption(shape, whole.num_nodes, whole.devices_per_node, zero_stage=z), m)
               for shape in settings.mesh_shapes for z in zeros for m in counts
               if (z or m > 1) and not (z and shape[0] == 1)]
    whole_batch = 0 in zeros and 1 in counts
    if not configs and not whole_batch:
        raise PlanningError(f"ZeRO shards over a mesh's first axis, which has one rank on every "
                            f"mesh of cluster '{cluster.name}': leave out --zero")
    plans: list[Plan] = []
    too_big: list[MemoryInfeasibleError] = []
    unsolved: list[InfeasibleError] = []
    if whole_batch:
        best, errors = best_single_stage(graph, cluster, list(settings.mesh_shapes),
                                         settings.precision, req.time_limit_s,
                                         settings.memory_budget, req.optimizer, req.recompute)
        too_big += errors
        if best is not None:
            plans.append(build_plan(best, cluster, info, training, whole_batch=True))
    for mesh, m in configs:
        cand = PipelineCandidate(1, 1, mesh, ACCUMULATING_SCHEDULE, m, None, 0.0, 0.0, 0.0)
        ctx.progress(f"single stage: {config_label(1, 1, mesh, ACCUMULATING_SCHEDULE, m)}")
        layers = len(ctx.program(m, traced=True).layers)
        try:
            exact = solve_exact(ctx, cand, [(0, layers)], req.recompute)
        except MemoryInfeasibleError as err:
            too_big.append(err)
            continue
        except InfeasibleError as err:
            unsolved.append(err)
            continue
        plans.append(assemble(exact, ctx, lambda r, c: build_plan(r, c, info, training)))
    if not plans:
        if too_big:
            raise PlanningError(str(min(too_big, key=lambda e: e.least_bytes)))
        raise PlanningError(f"no single stage asked for has a plan: {unsolved[0]}; give the ILP "
                            f"more time (--time-limit)")
    return min(plans, key=lambda p: round(float(p.predicted["step_time_s"]), 12))
