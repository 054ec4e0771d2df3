"""The public entry point: ``plan(model, cluster, ...)`` -> :class:`plan.format.Plan`,
and ``pipeline_plan`` of one fixed pipeline. The request is checked and the
model captured here; the search itself is :mod:`planner.search.two_level`."""

from __future__ import annotations

import dataclasses
import functools
import gc
import math
import warnings
from typing import Any, Callable, Sequence, TypeVar

import torch

from costmodel.cluster import Cluster
from costmodel.schedules import canonical_schedule, default_stages_per_rank
from costmodel.schedules.specs import schedule_spec
from ir.device_capture import planned_copy
from ir.graph import Graph
from ir.layers import PipelineLayer, block_count, manual_bounds
from ir.precision import Precision
from ir.trace import trace
from plan.format import Plan
from planner.ilp.intra_op import MemoryInfeasibleError
from planner.request import (ClusterSettings, PlanRequest, PlanningError, check_mesh,
                             resolve_on_cluster)
from planner.search.context import SearchContext
from planner.search.finalists import assemble, solve_exact
from planner.search.pipeline_search import SearchOptions, search
from planner.search.plan_assembly import build_plan, model_record, training_record
from planner.search.settings import SearchSettings
from planner.search.single_stage import shards_or_accumulates, single_stage_plan
from planner.search.stage_dp import stage_mesh_options
from planner.search.two_level import (best_single_stage, check_zero_stages, search_plan,
                                      two_processes, unpipelinable)

__all__ = ["PlanRequest", "PlanningError", "pipeline_plan", "plan"]


_Fn = TypeVar("_Fn", bound=Callable[..., Any])


def _planning(fn: _Fn) -> _Fn:
    """``fn``, a search, with Python's cyclic garbage collector paused while
    it runs (as it was before afterwards). The schedule orders it made
    (~400 MB for gpt3-175b on 1024 GPUs) are its search context's
    (:attr:`planner.search.context.SearchContext.schedule_book`) and go with it.

    Reference counting still frees almost all a search makes; the objects it
    leaves in reference cycles wait for the next collection after it. Each
    full collection during a search would walk every live object (the
    programs, profiles and schedule orders: about a million), several times
    a search; the collector is a process-wide setting, restored on return."""
    @functools.wraps(fn)
    def planning(*args: Any, **kwargs: Any) -> Any:
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            if was_enabled:
                gc.enable()
    return planning  # type: ignore[return-value]


def _request(request: PlanRequest | None, options: dict[str, Any]) -> PlanRequest:
    """``request`` (default: all defaults) with ``options``, its fields given as
    keywords, replacing its own.

    Raises:
        TypeError: an option that is no field of :class:`PlanRequest`.
    """
    return dataclasses.replace(request or PlanRequest(), **options)


def _prepare(model: torch.nn.Module, cluster: Cluster | str, example_inputs: Any,
             memory_budget: float | None, precision: str | Precision | None = None,
             mesh_shape: Sequence[int] | None = None, compiled: bool = False
             ) -> tuple[torch.nn.Module, ClusterSettings, tuple, Graph]:
    """The model and inputs as the step runs them (floating tensors in the
    precision's compute dtype, on the cluster's device type:
    :func:`ir.device_capture.planned_copy`, the caller's model untouched), the
    request resolved on its cluster (:func:`planner.request.resolve_on_cluster`)
    and the captured program."""
    if not isinstance(example_inputs, (tuple, list)):
        example_inputs = (example_inputs,)
    for i, t in enumerate(example_inputs):
        if isinstance(t, torch.Tensor) and 0 in t.shape:
            raise PlanningError(f"example input {i} has shape {list(t.shape)}, with an empty "
                                f"dimension: give a batch and sequence of at least one")
    settings = resolve_on_cluster(cluster, model, precision=precision,
                                  memory_budget=memory_budget, mesh_shape=mesh_shape,
                                  compiled=compiled)
    model, example_inputs = planned_copy(model, example_inputs, settings.precision,
                                         settings.cluster.device_type)
    graph = trace(model, tuple(example_inputs), beside=two_processes)
    if not graph.parameters:
        raise PlanningError(f"{type(model).__name__} has no parameters to shard")
    loss = graph[graph.output_names[0]].outputs[0] if graph.output_names else None
    if loss is None or loss.numel != 1:
        raise PlanningError(
            f"{type(model).__name__}'s forward returns "
            f"{'nothing' if loss is None else f'a tensor of shape {list(loss.shape)}'}, not "
            f"the scalar training loss the planner trains; return the loss (for example "
            f"F.cross_entropy(logits, targets)) from forward")
    return model, settings, tuple(example_inputs), graph


@_planning
def plan(model: torch.nn.Module, cluster: Cluster | str, *, example_inputs: Any,
         request: PlanRequest | None = None,
         progress: Callable[[str], None] | None = None, **options: Any) -> Plan:
    """Find the fastest way to run one training step of ``model`` on ``cluster``.

    The two-level search: every single-stage plan (the intra-op ILP on each 1-D
    and 2-D mesh, on the whole batch or accumulating the gradients of
    micro-batches), and every pipeline (stages from the inter-op DP on equal
    sub-meshes, each solved by the intra-op ILP, with the number of
    micro-batches and the schedule), keeping the fastest that fits in memory.
    At long sequences (or where nothing else fits) the same search runs again
    with context parallelism, each sequence cut over cp ranks
    (``context_parallel``;
    :mod:`planner.search.two_level`), and the fastest
    plan over all cp is kept.

    Args:
        model: the module (build it on the meta device for large models).
        cluster: a Cluster or a spec string (``dgx-a100-80g:2``, ``local-cpu:4``,
            path to a cluster JSON).
        example_inputs: arguments of one forward call of the whole (global)
            batch; ``model(*example_inputs)`` must return the scalar loss, a mean
            over the batch (micro-batches split dim 0 of every input).
        request: the settings (:class:`planner.request.PlanRequest`: mesh,
            precision, memory budget, pipeline restrictions, ...).
        progress: called with a short line as the search goes (for a progress bar).
        options: :class:`PlanRequest` fields, given one by one (they replace
            those of ``request``), e.g. ``mesh_shape=(2, 8)``,
            ``precision="bf16-mixed"``, ``time_limit_s=10``.

    Python's cyclic garbage collector is paused while it runs (reference
    counting frees almost everything, the search's schedule orders included;
    the rest waits for the next collection).

    Raises:
        PlanningError: bad mesh, or no plan fits in memory (the message gives the
            least memory per device that would fit).
        TypeError: an option that is no :class:`PlanRequest` field.
    """
    req = _request(request, options)
    model, settings, example_inputs, graph = _prepare(
        model, cluster, example_inputs, req.memory_budget, req.precision, req.mesh_shape,
        req.compile)
    cluster, dtype, budget = settings.cluster, settings.precision, settings.memory_budget
    info = model_record(model, graph, req.model_source)
    training = training_record(dtype, req.optimizer, example_inputs, req.zoo_kwargs,
                               memory_budget_bytes=int(budget))
    if req.single_stage or _whole_batch_only(req, graph):
        if shards_or_accumulates(req) and not graph.buffer_updates:
            # ZeRO or micro-batches on the one stage (a model updating buffers:
            # refused, unless the whole batch without ZeRO is among those asked)
            return single_stage_plan(req, model, example_inputs, graph, settings, info,
                                     training, progress).with_compile(req.compile)
        _refuse_beyond_whole_batch(req, graph)
        best, too_big = best_single_stage(graph, cluster, list(settings.mesh_shapes), dtype,
                                          req.time_limit_s, budget, req.optimizer,
                                          req.recompute)
        if best is None:
            raise PlanningError(str(min(too_big, key=lambda e: e.least_bytes)))
        return build_plan(best, cluster, info, training,
                          whole_batch=True).with_compile(req.compile)
    return search_plan(req, model, cluster, example_inputs, graph, dtype, budget, progress,
                       info, training).with_compile(req.compile)


def _whole_batch_only(req: PlanRequest, graph: Graph) -> bool:
    """Whether ``graph`` must be planned as one stage on the whole batch: its
    forward updates buffers (BatchNorm's running statistics), which pipeline
    stages and micro-batches do not run (a warning says so). A request for a
    pipeline or micro-batches of such a model is refused."""
    if not graph.buffer_updates:
        return False
    _refuse_beyond_whole_batch(req, graph)
    warnings.warn(f"no pipeline or micro-batch plans: {_updates_buffers(graph)}, which they do "
                  f"not run yet; single-stage plans on the whole batch only", stacklevel=3)
    return True


def _refuse_beyond_whole_batch(req: PlanRequest, graph: Graph) -> None:
    """Refuse a request for a pipeline, micro-batches or ZeRO alone (without
    stage 0) when ``graph``'s forward updates buffers, which those do not run."""
    if not graph.buffer_updates:
        return
    if (req.pp is not None and list(req.pp) != [1]) or (
            req.num_microbatches is not None and list(req.num_microbatches) != [1]) or (
            req.zero_stages is not None and 0 not in req.zero_stages):
        raise PlanningError(f"{_updates_buffers(graph)}, which pipelines, micro-batches and "
                            f"ZeRO stages do not run yet; leave out --pp, --microbatches and "
                            f"--zero")


def _updates_buffers(graph: Graph) -> str:
    """``graph``'s buffer updates in words (for an error or a warning)."""
    names = sorted(set(graph.buffer_updates.values()))
    more = f" and {len(names) - 2} more" if len(names) > 2 else ""
    return (f"forward updates buffers ({', '.join(names[:2])}{more}: BatchNorm's running "
            f"statistics or the like)")


@_planning
def pipeline_plan(model: torch.nn.Module, cluster: Cluster | str, *, example_inputs: Any,
                  pp: int, stage_mesh: Sequence[int], schedule: str, num_microbatches: int,
                  zero_stage: int = 0, layer_split: Sequence[int] | None = None,
                  fixed: dict[str, tuple] | None = None, request: PlanRequest | None = None,
                  **options: Any) -> Plan:
    """A pipeline plan of one fixed configuration (what a user would pin by hand).

    Args:
        pp: pipeline ranks; ``pp * prod(stage_mesh)`` must be the cluster size.
        stage_mesh: logical mesh of every stage, e.g. ``(2,)`` or ``(1, 2)``.
        schedule: a schedule name (``1f1b``, ``gpipe``, ``interleaved_1f1b``, ...).
        num_microbatches: micro-batches per step (must divide the batch).
        zero_stage: 0; 1 to shard each stage's optimizer states over its
            first mesh axis (:mod:`codegen.zero1`); 2 to shard its gradients
            and optimizer states with FSDP2 over that axis, its parameters
            not resharded between forward and backward; or 3 to shard the
            parameters too.
        layer_split: layers per stage, in stage order (default: the inter-op DP's cut):
            repeated blocks, the ops before the first (embeddings) joining the first
            stage and those after the last (head and loss) the last stage.
        fixed: placements (on the stage mesh) some parameters (by FQN) or inputs
            must take, e.g. a Megatron layout; the ILP places everything else.
        request, options: as :func:`plan` (of its fields, ``model_source``,
            ``zoo_kwargs``, ``time_limit_s``, ``optimizer``, ``memory_budget``
            and ``precision`` apply).
    """
    req = _request(request, options)
    model, settings, example_inputs, graph = _prepare(
        model, cluster, example_inputs, req.memory_budget, req.precision,
        compiled=req.compile)
    cluster, dtype, budget = settings.cluster, settings.precision, settings.memory_budget
    stage_mesh = check_mesh(stage_mesh)
    check_zero_stages([zero_stage])
    why = unpipelinable(model) if pp > 1 else None
    if why is not None:
        raise PlanningError(f"{why}: plan pp=1, or untie them")
    if graph.buffer_updates:
        raise PlanningError(f"{_updates_buffers(graph)}, which pipeline stages do not run "
                            f"yet; plan it without a pipeline")
    if pp * math.prod(stage_mesh) != cluster.num_devices:
        raise PlanningError(
            f"pp={pp} x stage mesh {'x'.join(map(str, stage_mesh))} is "
            f"{pp * math.prod(stage_mesh)} devices but cluster '{cluster.name}' has "
            f"{cluster.num_devices}")
    schedule = canonical_schedule(schedule)
    problem = schedule_spec(schedule).zero_stage_problem(zero_stage)
    if problem:
        raise PlanningError(problem)
    ctx = SearchContext(model, example_inputs,
                        SearchSettings(cluster, dtype, req.optimizer, budget, req.time_limit_s,
                                       fixed=fixed), whole_batch_graph=graph)
    if ctx.global_batch % num_microbatches:
        raise PlanningError(f"{num_microbatches} micro-batches do not divide the batch of "
                            f"{ctx.global_batch}")
    if not stage_mesh_options(cluster, pp):
        raise PlanningError(f"pp={pp} does not cut cluster '{cluster.name}' into sub-meshes "
                            f"inside a node or of whole nodes")
    layers = ctx.program(num_microbatches).layers
    bounds = None if layer_split is None else _manual_bounds(
        layers, layer_split, pp * default_stages_per_rank(schedule))
    cands = [c for c in search(ctx, SearchOptions(
        pp=[pp], schedules=[schedule], num_microbatches=[num_microbatches],
        stage_mesh=stage_mesh, zero_stages=[zero_stage])) if c.schedule == schedule]
    if not cands:
        raise PlanningError(
            f"no {schedule} pipeline with pp={pp}, {num_microbatches} micro-batches and "
            f"{len(layers)} layers fits in memory (or torch's schedule rejects the shape)")
    try:
        exact = solve_exact(ctx, cands[0], bounds)
    except MemoryInfeasibleError as err:
        raise PlanningError(f"a stage does not fit: {err}") from None
    info = model_record(model, graph, req.model_source)
    training = training_record(dtype, req.optimizer, example_inputs, req.zoo_kwargs,
                               memory_budget_bytes=int(budget))
    return assemble(exact, ctx,
                    lambda r, c: build_plan(r, c, info, training)).with_compile(req.compile)


def _manual_bounds(layers: Sequence[PipelineLayer], layer_split: Sequence[int],
                   stages: int) -> list[tuple[int, int]]:
    """:func:`ir.layers.manual_bounds` of a user's ``layer_split`` over ``stages``.

    Raises:
        PlanningError: not ``stages`` counts of at least one layer adding up to the layers.
    """
    blocks = block_count(layers)
    if len(layer_split) != stages or sum(layer_split) != blocks or min(layer_split) < 1:
        raise PlanningError(
            f"layer_split {list(layer_split)} must give {stages} stages of at least one "
            f"layer each, {blocks} layers in all")
    return manual_bounds(layers, layer_split)
