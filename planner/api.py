"""The public entry point: ``plan(model, cluster, ...)`` -> :class:`plan.format.Plan`."""

from __future__ import annotations

import dataclasses
import functools
import gc
import math
import warnings
from typing import Any, Callable, Sequence, TypeVar

import torch

from costmodel.cluster import Cluster
from costmodel.presets import load_cluster
from costmodel.schedules.specs import schedule_spec
from costmodel.schedules import canonical_schedule, default_stages_per_rank
from ir.device_capture import planned_copy
from ir.exported_graph import tied_parameters
from ir.graph import Graph
from ir.layers import PipelineLayer, block_count, manual_bounds
from ir.precision import Precision
from ir.trace import trace
from planner.search.plan_assembly import build_plan, model_record, training_record
from costmodel.strategy_cost import IntraOpCost
from planner.search.cp_search import (context_parallel_inputs, context_parallel_record,
                                      context_parallel_seconds, cp_link, kv_buffer_bound,
                                      search_sizes, sequence_length)
from planner.search.finalists import (ExactPipeline, assemble, fastest, solve_exact, solve_finalists,
                               split_far_finalists)
from planner.baselines.megatron_layout import CP_COMM_TYPES
from planner.search.forked_workers import run_beside
from planner.search.stage_dp import PipelineCandidate, stage_mesh_options
from planner.ilp.intra_op import IntraOpResult, MemoryInfeasibleError, solve_intra_op
from planner.search.pipeline_search import (NO_PIPELINE, SEARCH_ZERO_STAGES, SearchOptions, accumulates,
                              refine, search, simulate_step, zero_variants)
from plan.format import Plan
from planner.request import (PlanRequest, PlanningError, check_mesh, default_memory_budget,
                             mesh_candidates, resolve_precision)
from planner.search.context import SearchContext
from planner.search.stage_reuse import total_memory

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


def _two_processes(here: Callable[[], Any], there: Callable[[], Any]) -> tuple[Any, Any]:
    """``(here(), there())``, ``there`` run by a forked child meanwhile
    (:func:`planner.search.forked_workers.run_beside`): the first capture's two probes take
    both cores, while nothing else can run yet (llama3-8b: ~1 s each)."""
    done_here, done_there, _, _ = run_beside(here, there)
    return done_here, done_there


def _prepare(model: torch.nn.Module, cluster: Cluster | str, example_inputs: Any,
             memory_budget: float | None, precision: str | Precision | None = None
             ) -> tuple[torch.nn.Module, Cluster, tuple, Graph, Precision, float]:
    """The model and inputs as the step runs them (floating tensors in the
    precision's compute dtype, on the cluster's device type:
    :func:`ir.device_capture.planned_copy`, the caller's model untouched), the cluster, the captured program, the precision
    and the memory budget (bytes per device)."""
    if isinstance(cluster, str):
        cluster = load_cluster(cluster)
    if not isinstance(example_inputs, (tuple, list)):
        example_inputs = (example_inputs,)
    for i, t in enumerate(example_inputs):
        if isinstance(t, torch.Tensor) and 0 in t.shape:
            raise PlanningError(f"example input {i} has shape {list(t.shape)}, with an empty "
                                f"dimension: give a batch and sequence of at least one")
    chosen = resolve_precision(model, cluster, precision)
    model, example_inputs = planned_copy(model, example_inputs, chosen, cluster.device_type)
    graph = trace(model, tuple(example_inputs), beside=_two_processes)
    if not graph.parameters:
        raise PlanningError(f"{type(model).__name__} has no parameters to shard")
    loss = graph[graph.output_names[0]].outputs[0] if graph.output_names else None
    if loss is None or loss.numel != 1:
        raise PlanningError(
            f"{type(model).__name__}'s forward returns "
            f"{'nothing' if loss is None else f'a tensor of shape {list(loss.shape)}'}, not "
            f"the scalar training loss the planner trains; return the loss (for example "
            f"F.cross_entropy(logits, targets)) from forward")
    budget = default_memory_budget(cluster) if memory_budget is None else float(memory_budget)
    return model, cluster, tuple(example_inputs), graph, chosen, budget


def _best_single_stage(graph: Graph, cluster: Cluster, shapes: list[tuple[int, ...]], dtype: str,
                       time_limit_s: float, budget: float, optimizer: str,
                       recompute: bool | None = None
                       ) -> tuple[IntraOpResult | None, list[MemoryInfeasibleError]]:
    best: IntraOpResult | None = None
    too_big: list[MemoryInfeasibleError] = []
    for shape in shapes:
        try:
            result = solve_intra_op(graph, cluster, shape, dtype=dtype, time_limit_s=time_limit_s,
                                    memory_budget=budget, optimizer=optimizer,
                                    recompute=recompute)
        except MemoryInfeasibleError as err:
            too_big.append(err)
            continue
        if best is None or result.solution.objective_s < best.solution.objective_s:
            best = result
    return best, too_big


def _check_zero_stages(zero_stages: Sequence[int] | None) -> list[int] | None:
    """``zero_stages`` as a list, or None (the search's default)."""
    if zero_stages is None:
        return None
    out = [int(z) for z in zero_stages]
    if not out or any(z not in SEARCH_ZERO_STAGES for z in out):
        raise PlanningError(f"ZeRO stages must be 0 (none), 1 (sharded optimizer states), "
                            f"2 or 3 (FSDP2), got {list(zero_stages)}")
    return out


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
    (``context_parallel``; :func:`_context_parallel_plan`), and the fastest
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
    model, cluster, example_inputs, graph, dtype, budget = _prepare(
        model, cluster, example_inputs, req.memory_budget, req.precision)
    info = model_record(model, graph, req.model_source)
    training = training_record(dtype, req.optimizer, example_inputs, req.zoo_kwargs,
                               memory_budget_bytes=int(budget))
    if req.single_stage or _whole_batch_only(req, graph):
        shapes = [check_mesh(req.mesh_shape, cluster)] if req.mesh_shape else mesh_candidates(
            cluster.num_devices)
        best, too_big = _best_single_stage(graph, cluster, shapes, dtype, req.time_limit_s,
                                           budget, req.optimizer, req.recompute)
        if best is None:
            raise PlanningError(str(min(too_big, key=lambda e: e.least_bytes)))
        return build_plan(best, cluster, info, training, whole_batch=True)
    return _search_plan(req, model, cluster, example_inputs, graph, dtype, budget, progress,
                        info, training)


def _whole_batch_only(req: PlanRequest, graph: Graph) -> bool:
    """Whether ``graph`` must be planned as one stage on the whole batch: its
    forward updates buffers (BatchNorm's running statistics), which pipeline
    stages and micro-batches do not run (a warning says so). A request for a
    pipeline or micro-batches of such a model is refused."""
    if not graph.buffer_updates:
        return False
    why = _updates_buffers(graph)
    if (req.pp is not None and list(req.pp) != [1]) or (
            req.num_microbatches is not None and list(req.num_microbatches) != [1]):
        raise PlanningError(f"{why}, which pipelines and micro-batches do not run yet; leave "
                            f"out --pp and --microbatches (or give --no-pipeline)")
    warnings.warn(f"no pipeline or micro-batch plans: {why}, which they do not run yet; "
                  f"single-stage plans on the whole batch only", stacklevel=3)
    return True


def _updates_buffers(graph: Graph) -> str:
    """``graph``'s buffer updates in words (for an error or a warning)."""
    names = sorted(set(graph.buffer_updates.values()))
    more = f" and {len(names) - 2} more" if len(names) > 2 else ""
    return (f"forward updates buffers ({', '.join(names[:2])}{more}: BatchNorm's running "
            f"statistics or the like)")


def _pipeline_sizes(pp: Sequence[int] | None, model: torch.nn.Module) -> Sequence[int] | None:
    """The pipeline sizes to search: ``pp`` (None: all), or only 1 (no pipeline)
    for a model with tied parameters, which the pipeline runtime cannot split
    over stages (GPT-2's embedding and head would be one tensor in the first
    and the last stage), said in a warning."""
    why = _unpipelinable(model)
    if why is None or (pp is not None and list(pp) == [1]):
        return pp
    warnings.warn(f"no pipeline plans: {why}; single-stage plans only", stacklevel=3)
    return [1]


def _unpipelinable(model: torch.nn.Module) -> str | None:
    """Why the pipeline runtime cannot run ``model`` over several stages (a
    tied parameter, which a stage cannot share), or None."""
    tied = tied_parameters(model)
    if not tied:
        return None
    name, first = next(iter(tied.items()))
    return (f"parameter {name} is tied to {first}, and a pipeline stage cannot share a "
            f"parameter with another")


def _no_pipeline_reason(ctx: SearchContext, opts: SearchOptions) -> str:
    """Why the search could build no pipeline of the sizes ``opts.pp`` asks for."""
    from planner.search.stage_dp import SEARCH_SCHEDULES

    layers = len(ctx.program(1).layers)
    sizes = ",".join(map(str, opts.pp))
    wanted = [canonical_schedule(s) for s in (opts.schedules or SEARCH_SCHEDULES)]
    fewest = min(min(opts.pp) * default_stages_per_rank(s) for s in wanted)
    if fewest > layers:
        return (f"no pipeline with pp={sizes}: the model has {layers} pipeline layer(s) (its "
                f"blocks, and the ops before and after them), fewer than the {fewest} stages "
                f"that pp x stages per rank of "
                f"{', '.join(wanted)} needs; ask for fewer stages (--pp), a schedule of one "
                f"stage per rank (--schedule 1f1b), or no pipeline (--pp 1)")
    return (f"no pipeline with pp={sizes} and schedule(s) {', '.join(wanted)} fits this "
            f"cluster and batch (the devices must split evenly into pp stage meshes and the "
            f"batch into the schedule's micro-batches); change --pp, --schedule or "
            f"--microbatches")


def _search_plan(req: PlanRequest, model: torch.nn.Module, cluster: Cluster,
                 example_inputs: tuple, graph: Graph, dtype: Precision, budget: float,
                 progress: Callable[[str], None] | None, info: dict[str, Any],
                 training: dict[str, Any]) -> Plan:
    """The two-level search of :func:`plan` (single stages and pipelines), its
    finalists solved exactly, without context parallelism and with each cp
    size of :func:`planner.search.cp_search.search_sizes` (the request's, or
    automatic); the fastest plan by predicted step time (the smaller cp of
    equal ones). The automatic sizes are tried largest first (the least
    memory per rank), then smaller, until one is slower than (or does not
    fit where) the one before it fitted."""
    plans: list[Plan] = []
    errors: list[PlanningError] = []
    requested = req.context_parallel
    seq = sequence_length(example_inputs)
    if requested is not None:  # refused before any search
        search_sizes(requested, seq, cluster.num_devices, fits_without=True)
    if requested is None or 1 in requested:
        ctx = SearchContext(model, example_inputs, cluster, dtype=dtype,
                            optimizer=req.optimizer, budget=budget,
                            time_limit_s=req.time_limit_s, progress=progress,
                            whole_batch_graph=graph)
        build = functools.partial(_build_plan, info=info, training=training)
        try:
            winner = _search_winner(req, ctx, model, graph)
            plans.append(build(winner, cluster) if isinstance(winner, IntraOpResult)
                         else _assembled(winner, ctx, build))
        except PlanningError as err:
            errors.append(err)
    sizes = search_sizes(requested, seq, cluster.num_devices, fits_without=bool(plans))
    before: Plan | None = None
    # automatic: the largest first (the least memory per rank), then smaller
    for cp in (sizes if requested is not None else sizes[::-1]):
        try:
            found = _context_parallel_plan(req, model, cluster, example_inputs, dtype, budget,
                                           progress, cp)
        except PlanningError as err:
            errors.append(err)
            found = None
        if found is not None:
            plans.append(found)
        if requested is None and before is not None and (
                found is None or _step(found) > _step(before)):
            break
        before = found or before
    if not plans:
        raise errors[0]
    return min(plans, key=lambda p: (round(_step(p), 12), _cp_size(p)))


def _step(plan: Plan) -> float:
    return float(plan.predicted["step_time_s"])


def _cp_size(plan: Plan) -> int:
    """The plan's context-parallel size (1 without)."""
    return int(((plan.training or {}).get("context_parallel") or {}).get("size", 1))


def _build_plan(result: IntraOpResult, cluster: Cluster, *, info: dict[str, Any],
                training: dict[str, Any]) -> Plan:
    return build_plan(result, cluster, info, training)


def _assembled(winner: ExactPipeline, ctx: SearchContext,
               build: Callable[[IntraOpResult, Cluster], Plan]) -> Plan:
    """The Plan of an exactly solved candidate (a single stage's, or a pipeline's)."""
    if winner.candidate.schedule == NO_PIPELINE:
        return build(winner.results[0], ctx.cluster)
    return assemble(winner, ctx, build)


def _search_winner(req: PlanRequest, ctx: SearchContext, model: torch.nn.Module, graph: Graph,
                   finish: Callable[[list[ExactPipeline]], list[ExactPipeline]] | None = None
                   ) -> ExactPipeline | IntraOpResult:
    """The fastest exactly solved candidate of the search in ``ctx`` (each
    passed through ``finish`` first, which may re-price or drop it), or, where
    no candidate has a plan and ``ctx`` has no context parallelism, the best
    single stage of the whole batch ``graph``."""
    cluster = ctx.cluster
    opts = SearchOptions(pp=_pipeline_sizes(req.pp, model), schedules=req.schedules,
                         num_microbatches=req.num_microbatches,
                         zero_stages=_check_zero_stages(req.zero_stages))
    priced = search(ctx, opts)
    pipelines_only = req.pp is not None and 1 not in req.pp
    if pipelines_only:  # --pp without 1: a pipeline, or a reason why there is none
        priced = [c for c in priced if c.pp in req.pp]
        if not priced:
            raise PlanningError(_no_pipeline_reason(ctx, opts))
    first = [c for c in priced if not accumulates(c)]
    accumulating = [c for c in priced if accumulates(c)]
    ranked = refine(ctx, first)
    singles = [c for c in ranked if c.schedule == NO_PIPELINE]
    variants, accumulating_variants = zero_variants(ctx, [ranked, accumulating], opts)
    # the fastest few as ranked after refining and as first priced (a refined
    # profile can move a cut the exact solve liked better), the best single
    # stage, the best FSDP2 ZeRO variants, and the best single stages accumulating
    # micro-batches (with and without FSDP2 ZeRO; apart, so that they take no
    # pipeline's place): candidates are priced from layer profiles, the exact
    # solve decides
    finalists = list({(c.label(), tuple(c.split.bounds)): c for c in
                      ranked[:opts.finalists] + first[:opts.finalists] + singles[:1]
                      + variants[:opts.zero_finalists] + accumulating[:1]
                      + accumulating_variants[:1]}.values())
    finish = finish or (lambda exact: exact)
    # finalists with a stage that has no plan within limits are dropped; those
    # predicted far behind the fastest are solved only if no other has a plan
    close, far = split_far_finalists(finalists)
    exact = finish([e for e in solve_finalists(ctx, close) if e is not None])
    if not exact and far:
        exact = finish([e for e in solve_finalists(ctx, far) if e is not None])
    if not exact and pipelines_only:
        raise PlanningError(f"no pipeline with pp={','.join(map(str, req.pp))} fits in memory "
                            f"or runs under torch's schedules; add pp 1 (--pp 1,{req.pp[0]}) to "
                            f"allow a single stage, or give the devices more memory")
    if not exact and ctx.context_parallel > 1:  # every single stage exactly, pinned as ctx pins
        exact = finish(_exact_single_stages(ctx))
        if not exact:
            raise PlanningError(f"no plan with context parallel size {ctx.context_parallel} "
                                f"fits in memory")
    if not exact:  # the layer profiles are coarse: try every single stage exactly
        best, too_big = _best_single_stage(graph, cluster, mesh_candidates(cluster.num_devices),
                                           ctx.dtype, req.time_limit_s, ctx.budget,
                                           req.optimizer)
        if best is not None:
            return best
        least = min(too_big, key=lambda e: e.least_bytes) if too_big else None
        raise PlanningError((str(least) if least else "no plan fits in memory")
                            + " (no pipeline of its layers fits either)")
    return fastest(exact)


def _exact_single_stages(ctx: SearchContext) -> list[ExactPipeline]:
    """Every single stage of the whole batch that fits, solved exactly by
    ``ctx`` (so with its layout) on each stage mesh it allows."""
    prog = ctx.program(1, traced=True)
    out = []
    for mesh in stage_mesh_options(ctx.cluster, 1):
        if not ctx.allows(mesh.shape, 1):
            continue
        cand = PipelineCandidate(1, 1, mesh, NO_PIPELINE, 1, None, 0.0, 0.0, 0.0)
        try:
            out.append(solve_exact(ctx, cand, [(0, len(prog.layers))]))
        except MemoryInfeasibleError:
            continue
    return out


def _context_parallel_plan(req: PlanRequest, model: torch.nn.Module, cluster: Cluster,
                           example_inputs: tuple, dtype: Precision, budget: float,
                           progress: Callable[[str], None] | None, cp: int) -> Plan:
    """The fastest plan with context-parallel size ``cp``, the search choosing
    everything else, priced as :mod:`planner.search.cp_search` prices it.

    The program searched is one cp rank's (each sequence cut into cp rows of
    s / cp tokens), its batch rows pinned to stage mesh axis 0, which holds
    whole cp groups (:meth:`SearchContext.allows`,
    :func:`planner.search.cp_search.pinned_strategies`): the weights are
    replicated or sharded over axis 0 as the search decides (ZeRO over axis
    0 shards over dp x cp, as Megatron's distributed optimizer with cp).
    The candidates are ranked without the exchange (it is the same work on
    every candidate that places the attention alike); each finalist, solved
    exactly, then gets :func:`planner.search.cp_search.context_parallel_seconds`
    of both exchanges added to its stages' forward and backward, is dropped
    where a stage and its K/V buffers exceed the memory budget, and keeps the
    faster exchange. The stage ILPs get the budget less the buffers with K/V
    split evenly over the cluster (a lower bound; the exact check is that
    one). The plan's ``training["context_parallel"]`` records cp and the
    exchange, ``predicted["context_parallel"]`` its seconds and buffers.

    Raises:
        PlanningError: no plan with this cp fits, or cp does not cut the inputs.
    """
    say = progress or (lambda msg: None)
    say(f"context parallel {cp}: capturing one cp rank's program")
    cut = context_parallel_inputs(example_inputs, cp)
    graph = trace(model, cut, beside=_two_processes)
    reserve = min(kv_buffer_bound(graph, cp, t, (cluster.num_devices,)) for t in CP_COMM_TYPES)
    ctx = SearchContext(model, cut, cluster, dtype=dtype, optimizer=req.optimizer,
                        budget=budget - reserve, time_limit_s=req.time_limit_s,
                        progress=progress, whole_batch_graph=graph, context_parallel=cp)
    exchanges: dict[int, dict[str, Any]] = {}

    def finish(exact: list[ExactPipeline]) -> list[ExactPipeline]:
        out = []
        for e in exact:
            priced = [x for x in (_with_exchange(e, ctx, cp, t, budget) for t in CP_COMM_TYPES)
                      if x is not None]
            if priced:
                chosen, record = min(priced, key=lambda x: round(x[0].step_time_s, 12))
                exchanges[id(chosen)] = record
                out.append(chosen)
        return out

    winner = _search_winner(req, ctx, model, graph, finish)
    assert isinstance(winner, ExactPipeline)
    exchange = exchanges[id(winner)]
    training = training_record(dtype, req.optimizer, cut, req.zoo_kwargs,
                               memory_budget_bytes=int(budget),
                               context_parallel=context_parallel_record(
                                   cp, exchange["comm_type"], example_inputs))
    build = functools.partial(_build_plan, info=model_record(model, graph, req.model_source),
                              training=training)
    plan = _assembled(winner, ctx, build)
    if winner.candidate.schedule == NO_PIPELINE:  # its step is the stage's own, exchange aside
        plan.predicted["step_time_s"] += sum(exchange["exchange_s_per_microbatch"])
    # the exchange's buffers, held while one attention runs: counted at the peak
    memory = plan.predicted["memory_bytes_per_device"]
    memory["peak"] = int(round(memory["peak"] + exchange["kv_buffer_bytes"]))
    plan.predicted["context_parallel"] = exchange
    return plan


def _with_exchange(exact: ExactPipeline, ctx: SearchContext, cp: int, comm_type: str,
                   budget: float) -> tuple[ExactPipeline, dict[str, Any]] | None:
    """``exact`` with the attention across cp chunks (``comm_type``) added to
    its stages' times and the step simulated again, and what that adds; None
    where a stage and its K/V buffers exceed its share of ``budget``."""
    cand = exact.candidate
    shape = cand.mesh.shape
    stage_cluster = cand.mesh.cluster(ctx.cluster)
    link = cp_link(stage_cluster, shape[0] // cp, cp, math.prod(shape[1:]))
    times, extra, held = [], [], 0.0
    for r, t in zip(exact.results, exact.times):
        cost = IntraOpCost(r.graph, stage_cluster, r.mesh_shape, ctx.dtype, ctx.optimizer)
        f, b, kv = context_parallel_seconds(r, cost, cp, comm_type, link)
        if total_memory(r) + kv > budget / cand.stages_per_rank:
            return None
        times.append(dataclasses.replace(t, forward_s=t.forward_s + f,
                                         backward_input_s=t.backward_input_s + b))
        extra.append(f + b)
        held = max(held, kv)
    step, bubble = simulate_step(cand.schedule, cand.pp, cand.num_microbatches,
                                 cand.stages_per_rank, times, exact.p2p, ctx.schedule_book)
    return (dataclasses.replace(exact, times=times, step_time_s=step, bubble_s=bubble),
            {"comm_type": comm_type, "kv_buffer_bytes": held,
             "exchange_s_per_microbatch": extra})


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
    model, cluster, example_inputs, graph, dtype, budget = _prepare(
        model, cluster, example_inputs, req.memory_budget, req.precision)
    stage_mesh = check_mesh(stage_mesh)
    _check_zero_stages([zero_stage])
    why = _unpipelinable(model) if pp > 1 else None
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
    ctx = SearchContext(model, example_inputs, cluster, dtype=dtype, optimizer=req.optimizer,
                        budget=budget, time_limit_s=req.time_limit_s, fixed=fixed,
                        whole_batch_graph=graph)
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
    return assemble(exact, ctx, lambda r, c: build_plan(r, c, info, training))


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
