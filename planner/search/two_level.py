"""The two-level search of :func:`planner.api.plan`: single stages and
pipelines priced from layer profiles (:mod:`planner.search.pipeline_search`),
the finalists solved exactly (:mod:`planner.search.finalists`), without
context parallelism and with each cp size of
:func:`planner.search.cp_search.search_sizes`; the fastest plan.

Units: seconds, bytes.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import warnings
from typing import Any, Callable, Sequence

import torch

from costmodel.cluster import Cluster, candidate_mesh_shapes
from costmodel.schedules import default_stages_per_rank
from costmodel.strategy_cost import IntraOpCost
from ir.exported_graph import tied_parameters
from ir.graph import Graph
from ir.precision import Precision
from ir.trace import trace
from plan.format import Plan
from planner.megatron_layout import CP_COMM_TYPES
from planner.ilp.intra_op import IntraOpResult, MemoryInfeasibleError, solve_intra_op
from planner.request import PlanRequest, PlanningError, check_zero_stages
from planner.search.context import SearchContext
from planner.search.cp_search import (CP_MIN_SEQ, context_parallel_inputs,
                                      context_parallel_record, context_parallel_seconds,
                                      cp_link, kv_buffer_bound, search_sizes, sequence_length)
from planner.search.finalists import (ACCUMULATING_MARGIN, ExactPipeline, assemble, fastest,
                                      fastest_key, solve_exact, solve_finalists,
                                      split_far_finalists)
from planner.search.forked_workers import can_fork, run_beside
from planner.search.pipeline_search import (NO_PIPELINE, SearchOptions, accumulates, refine,
                                            runtime_step, search, whole_batch_allowed,
                                            zero_variants)
from planner.search.plan_assembly import (build_plan, model_record, training_record,
                                          whole_batch_price)
from planner.search.settings import SearchSettings
from planner.search.stage_dp import PipelineCandidate, stage_mesh_options
from planner.search.stage_reuse import total_memory

__all__ = ["best_single_stage", "check_zero_stages", "search_plan", "two_processes",
           "unpipelinable"]


def two_processes(here: Callable[[], Any], there: Callable[[], Any]) -> tuple[Any, Any]:
    """``(here(), there())``, ``there`` run by a forked child meanwhile
    (:func:`planner.search.forked_workers.run_beside`): the first capture's two
    probes take both cores, while nothing else can run yet (llama3-8b: ~1 s
    each)."""
    done_here, done_there, _, _ = run_beside(here, there)
    return done_here, done_there


def best_single_stage(graph: Graph, cluster: Cluster, shapes: list[tuple[int, ...]],
                      dtype: str, time_limit_s: float, budget: float, optimizer: str,
                      recompute: bool | None = None
                      ) -> tuple[IntraOpResult | None, list[MemoryInfeasibleError]]:
    """The fastest single stage of the whole batch ``graph`` over the mesh
    ``shapes`` (the intra-op ILP on each, within ``budget`` bytes per
    device; ranked by the step its plan predicts,
    :func:`planner.search.plan_assembly.whole_batch_price`), None if none
    fits; and why each that did not fit does not."""
    best: IntraOpResult | None = None
    best_s = math.inf
    too_big: list[MemoryInfeasibleError] = []
    for shape in shapes:
        try:
            result = solve_intra_op(graph, cluster, shape, dtype=dtype, time_limit_s=time_limit_s,
                                    memory_budget=budget, optimizer=optimizer,
                                    recompute=recompute)
        except MemoryInfeasibleError as err:
            too_big.append(err)
            continue
        step_s = whole_batch_price(result, IntraOpCost(graph, cluster, shape, dtype,
                                                       optimizer)).step_s
        if step_s < best_s:
            best, best_s = result, step_s
    return best, too_big


def _pipeline_sizes(pp: Sequence[int] | None, model: torch.nn.Module) -> Sequence[int] | None:
    """The pipeline sizes to search: ``pp`` (None: all), or only 1 (no pipeline)
    for a model with tied parameters, which the pipeline runtime cannot split
    over stages (GPT-2's embedding and head would be one tensor in the first
    and the last stage), said in a warning; a :class:`PlanningError` where
    ``pp`` asks for pipelines only."""
    why = unpipelinable(model)
    if why is None or (pp is not None and list(pp) == [1]):
        return pp
    if pp is not None and 1 not in pp:
        raise PlanningError(f"no pipeline with pp={','.join(map(str, pp))}: {why}; plan "
                            f"pp=1, or untie them")
    warnings.warn(f"no pipeline plans: {why}; single-stage plans only", stacklevel=3)
    return [1]


def unpipelinable(model: torch.nn.Module) -> str | None:
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
    layers = len(ctx.program(1).layers)
    sizes = ",".join(map(str, opts.pp))
    wanted = opts.schedule_choices
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


def search_plan(req: PlanRequest, model: torch.nn.Module, cluster: Cluster,
                example_inputs: tuple, graph: Graph, dtype: Precision, budget: float,
                progress: Callable[[str], None] | None, info: dict[str, Any],
                training: dict[str, Any]) -> Plan:
    """The two-level search of :func:`planner.api.plan` (single stages and pipelines), its
    finalists solved exactly, without context parallelism and with each cp
    size of :func:`planner.search.cp_search.search_sizes` (the request's, or
    automatic); the fastest plan by predicted step time (the smaller cp of
    equal ones). The automatic sizes are tried largest first (the least
    memory per rank), then smaller, until one is slower than (or does not
    fit where) the one before it fitted."""
    requested = req.context_parallel
    seq = sequence_length(example_inputs)
    if requested is not None:  # refused before any search
        search_sizes(requested, seq, cluster.num_devices, fits_without=True)
    without = requested is None or 1 in requested

    def search_without() -> tuple[list[Plan], list[PlanningError]]:
        if not without:
            return [], []
        ctx = SearchContext(model, example_inputs,
                            SearchSettings(cluster, dtype, req.optimizer, budget,
                                           req.time_limit_s),
                            progress=progress, whole_batch_graph=graph)
        build = functools.partial(_build_plan, info=info, training=training)
        assembled: dict[int, Plan] = {}

        def fits(exact: ExactPipeline) -> bool:
            assembled[id(exact)] = _assembled(exact, ctx, build)
            return assembled[id(exact)].predicted["memory_bytes_per_device"]["peak"] <= budget

        try:
            winner = _search_winner(req, ctx, model, graph, fits=fits)
            return [build(winner, cluster, True) if isinstance(winner, IntraOpResult)
                    else assembled[id(winner)]], []
        except PlanningError as err:
            return [], [err]

    def search_with(sizes: list[int], say: Callable[[str], None] | None
                    ) -> tuple[list[Plan], list[PlanningError]]:
        found_plans: list[Plan] = []
        found_errors: list[PlanningError] = []
        before: Plan | None = None
        # automatic: the largest first (the least memory per rank), then smaller
        for cp in (sizes if requested is not None else sizes[::-1]):
            try:
                found = _context_parallel_plan(req, model, cluster, example_inputs, dtype,
                                               budget, say, cp, like=graph)
            except PlanningError as err:
                found_errors.append(err)
                found = None
            if found is not None:
                found_plans.append(found)
            if requested is None and before is not None and (
                    found is None or _step(found) > _step(before)):
                break
            before = found or before
        return found_plans, found_errors

    # the cp sizes when the search without cp finds a plan; where they are
    # what its outcome gives anyway (all but short automatic sequences), the
    # cp searches run meanwhile in a forked process (_beside_search)
    ahead = search_sizes(requested, seq, cluster.num_devices, fits_without=True)
    sure = not without or requested is not None or seq is None or seq >= CP_MIN_SEQ
    if ahead and sure and can_fork():
        if progress is not None:
            progress(f"searching context parallel sizes {', '.join(map(str, ahead[::-1]))} "
                     f"in a second process meanwhile")
        (plans, errors), (more, more_errors) = _beside_search(
            search_without, lambda: search_with(ahead, None))
    else:
        plans, errors = search_without()
        more, more_errors = search_with(
            search_sizes(requested, seq, cluster.num_devices, fits_without=bool(plans)),
            progress)
    plans += more
    errors += more_errors
    if not plans:
        raise errors[0]
    return min(plans, key=lambda p: (round(_step(p), 12), _cp_size(p)))


def _beside_search(here: Callable[[], Any], there: Callable[[], Any]) -> tuple[Any, Any]:
    """``(here(), there())``, ``there`` (the context-parallel searches) run by
    a forked process meanwhile (:func:`planner.search.forked_workers.run_beside`),
    each search forking its own workers as it would alone: the searches share
    nothing, and each alone leaves a core idle while it captures and writes
    out programs (llama3-405b at 131,072 tokens on 16,384 GPUs: three
    searches, ~150 s of CPU in ~100 s). The warnings ``there`` raises are
    raised here afterwards, in their order, as they would come after
    ``here``'s."""
    def quietly() -> tuple[Any, list[warnings.WarningMessage]]:
        me = os.getpid()
        heard: list[warnings.WarningMessage] = []
        show = warnings.showwarning

        def keep(message: Any, category: Any, filename: str, lineno: int, file: Any = None,
                 line: Any = None) -> None:
            if os.getpid() != me:  # a worker of this process's own search
                show(message, category, filename, lineno, file, line)
                return
            heard.append(warnings.WarningMessage(message, category, filename, lineno))

        with warnings.catch_warnings():
            warnings.showwarning = keep
            return there(), heard

    done_here, (done_there, heard), _, _ = run_beside(here, quietly)
    for w in heard:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return done_here, done_there


def _step(plan: Plan) -> float:
    return float(plan.predicted["step_time_s"])


def _cp_size(plan: Plan) -> int:
    """The plan's context-parallel size (1 without)."""
    return int(((plan.training or {}).get("context_parallel") or {}).get("size", 1))


def _build_plan(result: IntraOpResult, cluster: Cluster, whole_batch: bool = False, *,
                info: dict[str, Any], training: dict[str, Any]) -> Plan:
    return build_plan(result, cluster, info, training, whole_batch)


def _assembled(winner: ExactPipeline, ctx: SearchContext,
               build: Callable[..., Plan]) -> Plan:
    """The Plan of an exactly solved candidate (a single stage's, whose step
    runs the whole batch at once, or a pipeline's); ``build(result, cluster,
    whole_batch)`` writes one stage's."""
    if winner.candidate.schedule == NO_PIPELINE:
        return build(winner.results[0], ctx.settings.cluster, True)
    return assemble(winner, ctx, build)


def _search_winner(req: PlanRequest, ctx: SearchContext, model: torch.nn.Module, graph: Graph,
                   finish: Callable[[list[ExactPipeline]], list[ExactPipeline]] | None = None,
                   fits: Callable[[ExactPipeline], bool] | None = None
                   ) -> ExactPipeline | IntraOpResult:
    """The fastest exactly solved candidate of the search in ``ctx`` (each
    passed through ``finish`` first, which may re-price or drop it; the
    fastest for which ``fits`` holds, where given and any does), or, where
    no candidate has a plan and ``ctx`` has no context parallelism, the best
    single stage of the whole batch ``graph``: only where the request allows
    it (ZeRO 0 and one micro-batch among those asked, or none asked); else a
    :class:`PlanningError` saying nothing asked fits."""
    cluster = ctx.settings.cluster
    opts = SearchOptions(pp=_pipeline_sizes(req.pp, model), schedules=req.schedules,
                         num_microbatches=req.num_microbatches,
                         zero_stages=check_zero_stages(req.zero_stages))
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
    # micro-batches (with and without FSDP2 ZeRO, and of each micro-batch count
    # not far behind; apart, so that they take no pipeline's place): candidates
    # are priced from layer profiles, the exact solve decides
    fastest_s = min((c.step_time_s for c in priced + variants + accumulating_variants),
                    default=math.inf)
    accumulating_finalists = accumulating[:1] + accumulating_variants[:1] + _fastest_each_count(
        accumulating + accumulating_variants, ACCUMULATING_MARGIN * fastest_s)
    finalists = list({_finalist_key(c): c for c in
                      ranked[:opts.finalists] + first[:opts.finalists] + singles[:1]
                      + variants[:opts.zero_finalists] + accumulating_finalists}.values())
    finish = finish or (lambda exact: exact)
    # finalists with a stage that has no plan within limits are dropped; those
    # predicted far behind the fastest are solved only if no other has a plan
    close, far = split_far_finalists(finalists)
    solved = solve_finalists(ctx, close)
    exact = finish([e for e in solved if e is not None] + _next_accumulating(
        ctx, close, solved, accumulating + accumulating_variants, finalists))
    if not exact and far:
        exact = finish([e for e in solve_finalists(ctx, far) if e is not None])
    if not exact and pipelines_only:
        raise PlanningError(f"no pipeline with pp={','.join(map(str, req.pp))} fits in memory "
                            f"or runs under torch's schedules; add pp 1 (--pp 1,{req.pp[0]}) to "
                            f"allow a single stage, or give the devices more memory")
    cp = ctx.settings.context_parallel
    if not exact and not whole_batch_allowed(opts):  # no fallback to the whole batch
        raise PlanningError(_nothing_asked_fits(req, ctx))
    if not exact and cp > 1:  # every single stage exactly, pinned as ctx pins
        exact = finish(_exact_single_stages(ctx))
        if not exact:
            raise PlanningError(f"no plan with context parallel size {cp} fits in memory")
    if not exact:  # the layer profiles are coarse: try every single stage exactly
        best, too_big = best_single_stage(graph, cluster, candidate_mesh_shapes(cluster.num_devices),
                                          ctx.settings.dtype, req.time_limit_s,
                                          ctx.settings.budget, req.optimizer)
        if best is not None:
            return best
        least = min(too_big, key=lambda e: e.least_bytes) if too_big else None
        raise PlanningError((str(least) if least else "no plan fits in memory")
                            + " (no pipeline of its layers fits either)")
    return fastest(exact) if fits is None else _fastest_fitting(exact, fits)


def _finalist_key(cand: PipelineCandidate) -> tuple:
    """What makes two candidates the same finalist: configuration and cut."""
    return cand.label(), tuple(cand.split.bounds)


def _fastest_fitting(exact: list[ExactPipeline], fits: Callable[[ExactPipeline], bool]
                     ) -> ExactPipeline:
    """The first of ``exact``, fastest first (as :func:`fastest` orders them),
    whose plan ``fits`` its budget, else the fastest: a stage's exact solve
    bounds the sum of its parts, while the plan's peak (the schedule's walk
    over its ranks, :func:`costmodel.memory.step_peak_bytes`) also counts the
    optimizer's step, which can lift it above that sum."""
    ordered = sorted(exact, key=fastest_key)
    return next((e for e in ordered if fits(e)), ordered[0])


def _fastest_each_count(candidates: list[PipelineCandidate], within_s: float
                        ) -> list[PipelineCandidate]:
    """The fastest of ``candidates`` (single stages accumulating micro-batches)
    of each micro-batch count, where predicted within ``within_s`` seconds.
    Their prices come from layer profiles that each meet a share of the
    memory budget, and how far such a price is from its exact solve depends on
    the micro-batch (the smaller the share, the more the profiles shard or
    recompute that the whole stage need not), so the fastest of one count can
    solve slower than another count's."""
    first: dict[int, PipelineCandidate] = {}
    for cand in sorted(candidates, key=lambda c: c.step_time_s):
        first.setdefault(cand.num_microbatches, cand)
    return [c for c in first.values() if c.step_time_s <= within_s]


def _next_accumulating(ctx: SearchContext, close: list[PipelineCandidate],
                       solved: list[ExactPipeline | None],
                       accumulating: list[PipelineCandidate],
                       finalists: list[PipelineCandidate]) -> list[ExactPipeline]:
    """Where every single stage accumulating micro-batches among the finalists
    ``close`` had no plan within limits when solved exactly (``solved``; the
    layer profiles, which sum their layers' memory, put it under the budget),
    the first of the other ``accumulating`` candidates (not among
    ``finalists``; fastest first) that has one, solved one by one; else none."""
    tried = [e for c, e in zip(close, solved) if accumulates(c)]
    if not tried or any(e is not None for e in tried):
        return []
    taken = {_finalist_key(c) for c in finalists}
    spare = sorted((c for c in accumulating if _finalist_key(c) not in taken),
                   key=lambda c: c.step_time_s)
    for cand in spare:
        found = solve_finalists(ctx, [cand])[0]
        if found is not None:
            return [found]
    return []


def _nothing_asked_fits(req: PlanRequest, ctx: SearchContext) -> str:
    """Why the search has no plan when the request rules out its fallback,
    one stage of the whole batch (``--zero`` without 0, or ``--microbatches``
    without 1), in one line."""
    asked = []
    if req.zero_stages is not None:
        asked.append(f"--zero {','.join(map(str, req.zero_stages))}")
    if req.num_microbatches is not None:
        asked.append(f"--microbatches {','.join(map(str, req.num_microbatches))}")
    batch = ctx.global_batch
    if req.num_microbatches is not None and all(batch % m for m in req.num_microbatches):
        return (f"no count of --microbatches {','.join(map(str, req.num_microbatches))} "
                f"divides the batch of {batch}: give counts that divide it")
    devices = ctx.settings.cluster.num_devices
    if devices == 1 and req.zero_stages is not None and 0 not in req.zero_stages:
        return ("ZeRO shards over a stage mesh's first axis, which has one rank on a cluster "
                "of 1 device: leave out --zero")
    cp = ctx.settings.context_parallel
    with_cp = f" and context parallel size {cp}" if cp > 1 else ""
    return (f"no plan with {' and '.join(asked)}{with_cp} fits in memory on {devices} "
            f"device(s): add 0 to --zero or 1 to --microbatches (or leave them out) to allow "
            f"one stage of the whole batch, or give the devices more memory")


def _exact_single_stages(ctx: SearchContext) -> list[ExactPipeline]:
    """Every single stage of the whole batch that fits, solved exactly by
    ``ctx`` (so with its layout) on each stage mesh it allows."""
    prog = ctx.program(1, traced=True)
    out = []
    for mesh in stage_mesh_options(ctx.settings.cluster, 1):
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
                           progress: Callable[[str], None] | None, cp: int,
                           like: Graph | None = None) -> Plan:
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

    ``like``: the capture of the whole batch without cp; one cp rank's
    program is the same model on shorter sequences, so its capture reuses
    the method checked on that capture's probes (:func:`ir.trace.trace`'s
    ``like``: one probe, captured in one pass, instead of two; the same
    Graph either way).

    Raises:
        PlanningError: no plan with this cp fits, or cp does not cut the inputs.
    """
    say = progress or (lambda msg: None)
    say(f"context parallel {cp}: capturing one cp rank's program")
    cut = context_parallel_inputs(example_inputs, cp)
    graph = trace(model, cut, like=like, beside=two_processes)
    reserve = min(kv_buffer_bound(graph, cp, t, (cluster.num_devices,)) for t in CP_COMM_TYPES)
    ctx = SearchContext(model, cut,
                        SearchSettings(cluster, dtype, req.optimizer, budget - reserve,
                                       req.time_limit_s, context_parallel=cp),
                        progress=progress, whole_batch_graph=graph)
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
    stage_cluster = cand.mesh.cluster(ctx.settings.cluster)
    link = cp_link(stage_cluster, shape[0] // cp, cp, math.prod(shape[1:]))
    times, extra, held = [], [], 0.0
    for r, t in zip(exact.results, exact.times):
        cost = IntraOpCost(r.graph, stage_cluster, r.mesh_shape, ctx.settings.dtype,
                           ctx.settings.optimizer)
        f, b, kv = context_parallel_seconds(r, cost, cp, comm_type, link)
        if total_memory(r) + kv > budget / cand.stages_per_rank:
            return None
        times.append(dataclasses.replace(t, forward_s=t.forward_s + f,
                                         backward_input_s=t.backward_input_s + b))
        extra.append(f + b)
        held = max(held, kv)
    step, bubble = runtime_step(ctx, cand.schedule, cand.pp, cand.num_microbatches,
                                cand.stages_per_rank, times, exact.p2p)
    return (dataclasses.replace(exact, times=times, step_time_s=step, bubble_s=bubble),
            {"comm_type": comm_type, "kv_buffer_bytes": held,
             "exchange_s_per_microbatch": extra})
