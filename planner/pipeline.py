"""The two-level search: pipeline configurations (stages, stage meshes,
schedules, micro-batches, ZeRO) priced from layer profiles by the inter-op DP,
on two CPU cores. The leading candidates are solved exactly per stage by
:mod:`planner.finalists`.

Units: seconds, bytes. See :mod:`planner.inter_op` for the pieces and
:mod:`planner.search_context` for what the search shares.
"""

from __future__ import annotations

import dataclasses
import math
import pickle
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from costmodel.cluster import Cluster
from costmodel.schedules import (adopt_orders, canonical_schedule, default_stages_per_rank,
                                 orders_cached, simulate, torch_orders)
from planner.forked import run_beside, run_forked
from planner.inter_op import (SEARCH_SCHEDULES, PipelineCandidate, StageMeshOption, StageTimes,
                              config_label, in_flight, split_layers, stage_mesh_options)
from planner.search_context import (ChildMark, MicrobatchProgram, SearchContext,
                                     held_by_both, pricing_scope)


def p2p_seconds(prog: MicrobatchProgram, bounds: list[tuple[int, int]], mesh: StageMeshOption,
                 cluster: Cluster) -> list[float]:
    """Seconds to send one micro-batch's boundary values between consecutive
    stages (each device sends its 1/size share; across nodes when a stage
    fills whole nodes or the next stage is on another node)."""
    link = cluster.inter_node if mesh.size >= cluster.devices_per_node and cluster.num_nodes > 1 \
        else cluster.intra_node
    out = []
    for a, b in bounds[:-1]:
        nbytes = sum(prog.graph[v].outputs[0].nbytes for v in prog.boundaries[b - 1][1]
                     if prog.graph[v].outputs and prog.graph[v].outputs[0].is_float)
        out.append(link.latency + nbytes / mesh.size / link.bandwidth)
    return out


# The schedule name of a one-stage candidate (no pipeline).
NO_PIPELINE = "none"


def stage_in_flight(schedule: str, pp: int, m: int, v: int) -> list[float]:
    """In-flight micro-batches of each stage (1 for a single stage)."""
    return [1.0] if schedule == NO_PIPELINE else in_flight(schedule, pp, m, v)


def simulate_step(schedule: str, pp: int, m: int, v: int, times: list[StageTimes],
              p2p: list[float]) -> tuple[float, float]:
    """(step seconds including the slowest gradient sync and optimizer update,
    bubble seconds)."""
    if schedule == NO_PIPELINE:
        return times[0].microbatch_s + times[0].step_end_s, 0.0
    r = simulate(schedule, pp, m, [t.forward_s for t in times],
                 [t.backward_input_s for t in times], [t.backward_weight_s for t in times],
                 p2p if p2p else 0.0, stages_per_rank=v, timeline=False)
    end = max(t.step_end_s for t in times)
    return r.step_time + end, r.step_time - max(r.busy)


def _microbatch_options(global_batch: int, pp: int, v: int, schedule: str,
                        limit: int) -> list[int]:
    """Micro-batch counts tried, fewest first: the batch split into
    micro-batches of 1, 4, 16, ... sequences, at most ``limit`` of them,
    where the count is a multiple of pp (DualPipeV: 2pp), as torch's
    schedules accept. Micro-batches of one sequence (Megatron's usual
    size) keep the bubble and the in-flight activations smallest: with
    counts pp, 2pp and 4pp instead, gpt3-175b on 1024 A100s chose 516.10
    s/step where pp=16 with 1536 micro-batches gives 277.74, and llama3-8b
    on 64 H100s 71.10 where pp=2 with 256 gives 58.25."""
    first = pp * (2 if canonical_schedule(schedule) == "dualpipev" else 1)
    counts = []
    size = 1  # sequences per micro-batch
    while global_batch // size >= first and len(counts) < limit:
        if global_batch % size == 0 and (global_batch // size) % first == 0:
            counts.append(global_batch // size)
        size *= 4
    return sorted(counts)


def _accumulation_options(global_batch: int, limit: int) -> list[int]:
    """Micro-batch counts tried for one stage with gradient accumulation: 2,
    8, 32, ... (a quarter of the micro-batch each time) dividing the batch,
    at most ``limit`` of them."""
    out = []
    m = 2
    while m <= global_batch and len(out) < limit:
        if global_batch % m == 0:
            out.append(m)
        m *= 4
    return out


# ZeRO stages the search tries for pipeline stages: none, and FSDP2 (ZeRO-3)
# over stage mesh axis 0.
SEARCH_ZERO_STAGES = (0, 3)


@dataclass
class SearchOptions:
    """What the pipeline search may choose from (None = everything valid)."""

    pp: Sequence[int] | None = None
    schedules: Sequence[str] | None = None
    num_microbatches: Sequence[int] | None = None
    stage_mesh: Sequence[int] | None = None
    # ZeRO stages of pipeline stages (SEARCH_ZERO_STAGES when None)
    zero_stages: Sequence[int] | None = None
    microbatch_options: int = 3
    finalists: int = 3
    # ZeRO-3 variants (zero_variants) solved exactly besides the finalists
    zero_finalists: int = 2

    @property
    def zero_choices(self) -> list[int]:
        """The ZeRO stages allowed: ``zero_stages``, or all the search knows."""
        return list(SEARCH_ZERO_STAGES if self.zero_stages is None else self.zero_stages)


def configurations(ctx: SearchContext, opts: SearchOptions
                   ) -> list[tuple[int, int, StageMeshOption, str, int]]:
    """Every (pp, stages per rank, stage mesh, schedule, micro-batches) the
    search prices, in a fixed order: pp = 1 is the single stage of the whole
    batch, then the pipelines, then one stage accumulating the gradients of
    several micro-batches (:func:`accumulates`; last, so that the profiles
    they make change no other price). The stage meshes are without ZeRO
    where ``opts`` allows it (:func:`zero_variants` adds ZeRO-3 for the
    leading candidates), else with the ZeRO stage it names (on meshes whose
    axis 0 has more than one rank). Pipelines of more stages than the
    program has layers are left out before any program is made for them
    (llama3-8b's 32 layers: 29 configurations, which under earlier
    micro-batch options alone asked for a capture at size 1, 2.7 s)."""
    n = ctx.cluster.num_devices
    schedules = [canonical_schedule(s) for s in (opts.schedules or SEARCH_SCHEDULES)]
    pps = list(opts.pp) if opts.pp else [p for p in range(1, n + 1) if n % p == 0]
    zeros = opts.zero_choices
    zero = 0 if 0 in zeros else zeros[0]
    num_layers = len(ctx.program(1).layers)
    out, accumulating = [], []
    for pp in pps:
        meshes = stage_mesh_options(ctx.cluster, pp)
        if opts.stage_mesh is not None:  # any logical view of the sub-mesh
            want = tuple(opts.stage_mesh)
            meshes = [StageMeshOption(want, mo.num_nodes, mo.devices_per_node)
                      for mo in meshes[:1] if mo.size == math.prod(want)]
        for mesh in meshes:
            if pp == 1:  # one stage: the whole batch at once, no schedule (no ZeRO)
                out.append((1, 1, mesh, NO_PIPELINE, 1))
            if zero and mesh.shape[0] == 1:
                continue
            mesh = dataclasses.replace(mesh, zero_stage=zero)
            if pp == 1:  # or micro-batches with their gradients accumulated (1F1B of one stage)
                ms = list(opts.num_microbatches) if opts.num_microbatches else \
                    _accumulation_options(ctx.global_batch, opts.microbatch_options)
                if "1f1b" in schedules:
                    accumulating.extend((1, 1, mesh, "1f1b", m) for m in ms if m > 1)
                continue
            for schedule in schedules:
                v = default_stages_per_rank(schedule)
                if pp * v > num_layers:
                    continue
                ms = list(opts.num_microbatches) if opts.num_microbatches else \
                    _microbatch_options(ctx.global_batch, pp, v, schedule, opts.microbatch_options)
                out.extend((pp, v, mesh, schedule, m) for m in ms)
    return out + accumulating


def accumulates(cand: PipelineCandidate) -> bool:
    """Whether ``cand`` is one stage accumulating the gradients of its micro-batches."""
    return cand.pp == 1 and cand.schedule != NO_PIPELINE


def search(ctx: SearchContext, opts: SearchOptions) -> list[PipelineCandidate]:
    """Every priced configuration (from layer profiles and the stage DP), best first."""
    configs = configurations(ctx, opts)
    candidates = [c for c in _price_all(ctx, configs, lambda k, config: (
        f"[{k + 1}/{len(configs)}] {config_label(*config)}")) if c is not None]
    candidates.sort(key=lambda c: c.step_time_s)
    return candidates


Config = tuple[int, int, StageMeshOption, str, int]  # (pp, v, stage mesh, schedule, m)


def _price_all(ctx: SearchContext, configs: Sequence[Config],
               label: Callable[[int, Config], str], traced: bool = False
               ) -> list[PipelineCandidate | None]:
    """``[_price(ctx, *config) for config in configs]``, on two CPU cores
    (:mod:`planner.forked`), one task per pricing scope.

    A configuration's price depends on the profiles of its pricing scope
    only (:func:`pricing_scope`: references are made and re-priced within a
    mesh family, and at micro-batch size 1 within a stage mesh), so pricing
    each scope's configurations in their order, in either process, gives the
    same prices as pricing all in order. The programs are made here first,
    in that order (which decides what is captured and what derived), size 1
    last, so that both processes hold them before they price; while this
    process captures, the forked child prices what needs no program still
    to come: the leading configurations (they come first in every scope's
    order) and, beside the capture of size 1, the scopes of other sizes.
    A task run by the child sends back its
    scopes' profiles, without their priced problems (remade if they are
    extended, :meth:`SearchContext._extend`), and its strategy caches.

    ``traced``: the configurations are of mesh families without references
    (ZeRO-3 variants), so their scopes make them, with ILPs of their own on
    captured or written-out programs (:meth:`SearchContext.program`). Those
    only derived so far are written out here while the child prices the
    scopes that have theirs; then both price the rest."""

    def scope_of(config: Config) -> tuple:
        mesh, m = config[2], config[4]
        return pricing_scope(mesh.key, ctx.global_batch // m)

    ms = list(dict.fromkeys(m for *_, m in configs if ctx.global_batch % m == 0))
    ready = 0  # the leading configurations whose programs exist
    while ready < len(configs) and not ctx.will_capture(configs[ready][4]):
        ready += 1
    child = ChildMark(ctx)

    def task(ks: list[int]) -> Callable[[], tuple]:
        def run() -> tuple:
            solves = ctx.ilp_solves
            out = []
            for k in ks:
                ctx.progress(label(k, configs[k]))
                out.append(_price(ctx, *configs[k]))
            if not child.in_child:  # its profiles and ILP count are here already
                return out, None, 0
            return (out, ctx.scope_state({scope_of(configs[k]) for k in ks}),
                    ctx.ilp_solves - solves)
        return run

    priced: list[PipelineCandidate | None] = [None] * len(configs)

    def file(ks: list[int], done: tuple) -> None:
        out, state, solves = done
        if state is not None:  # priced by the child
            ctx.adopt_scope_state(state)
            ctx.ilp_solves += solves
        for k, cand in zip(ks, out):
            priced[k] = cand

    Job = tuple[Callable[[], Any], Callable[[Any], None]]  # a task, and what files its result

    def make(counts: list[int], traced: bool = False) -> None:
        for m in counts:
            ctx.program(m, traced=traced)

    def settle(jobs: list[Job], results: list[Any]) -> None:
        for (_, on_done), result in zip(jobs, results):
            on_done(result)

    def beside(counts: list[int], there: list[int], jobs: list[Job],
               after: Sequence[Job] = (), traced: bool = False) -> None:
        """Make the programs of micro-batch ``counts`` (``traced``: captured
        or written out) here while the forked child prices the
        configurations ``there``; then both take ``jobs``, and this process
        (and, once the child is done with those, a new one) the jobs
        ``after``, which need those programs."""
        _, done, results, results_after = run_beside(
            lambda: make(counts, traced), task(there), held_by_both(ctx, ctx.programs()), child,
            then=[job for job, _ in jobs], after_here=[job for job, _ in after])
        file(there, done)
        settle(jobs, results)
        settle(after, results_after)

    def forked(jobs: list[Job]) -> None:
        settle(jobs, run_forked([job for job, _ in jobs], held_by_both(ctx, ctx.programs()),
                                child))

    # torch's schedule orders, made once on both cores before the scopes are
    # priced (each asks for many of them; each process made them all for
    # itself: gpt3-175b on 1024 GPUs, 96 shapes, ~16 s in each)
    shapes = _missing_schedule_shapes(configs)
    orders: list[Job] = [(_orders_task(shape), lambda blob, shape=shape: _file_order(shape, blob))
                         for shape in shapes]
    # micro-batches of one sequence: another program, captured last (see
    # SearchContext.program); the scopes that need it, priced last
    one = [m for m in ms if ctx.global_batch // m == 1]
    others = [m for m in ms if m not in one]
    capture_others = any(ctx.will_capture(m) for m in others)
    capture_one = any(ctx.will_capture(m) for m in one)
    first = list(range(ready)) if capture_others or capture_one else []
    scopes: dict[tuple, list[int]] = {}
    for k in range(len(first), len(configs)):
        scopes.setdefault(scope_of(configs[k]), []).append(k)
    # the largest scopes first, so that the last task to start is short; those
    # at micro-batch size 1 apart (their program may be captured after the others)
    # (a scope names its stage mesh, last, only at size 1: see pricing_scope)
    ordered = sorted(scopes.items(), key=lambda item: len(item[1]), reverse=True)

    def job(ks: list[int]) -> Job:
        return task(ks), lambda done: file(ks, done)

    early = [ks for scope, ks in ordered if scope[-1] is None]
    late = [ks for scope, ks in ordered if scope[-1] is not None]
    # the child works while this process captures: on the leading
    # configurations whose programs exist (``first``) and the schedule orders
    # beside the first captures; on the scopes not at size 1 beside the
    # capture of size 1 (once ``first`` is filed: a scope's configurations
    # are priced in their order), while this process, done capturing, prices
    # the scopes at size 1
    if capture_others:
        beside(others, first, orders)
        if capture_one:
            beside(one, [], [job(ks) for ks in early], [job(ks) for ks in late])
            early = late = []
        else:
            make(one)
    else:
        make(others)
        if capture_one:
            beside(one, first, orders)
        else:
            forked(orders)
    rest = early + late
    # (traced) made here first: each program only derived so far that a
    # scope may price on (where no reference divides its shapes, another
    # size of its scope makes one too)
    unwritten = [m for m in ms if traced and not ctx.has_traced(m)]
    waiting = [ks for ks in rest if any(configs[k][4] in unwritten for k in ks)]
    if waiting:
        beside(unwritten, [], [job(ks) for ks in rest if ks not in waiting],
               [job(ks) for ks in waiting], traced=True)
    else:
        forked([job(ks) for ks in rest])
    return priced


def _missing_schedule_shapes(configs: Sequence[Config]) -> list[tuple[str, int, int, int]]:
    """The schedule shapes ``(schedule, pp, m, v)`` of ``configs`` whose
    torch orders (:func:`costmodel.schedules.torch_orders`) this process
    lacks, the longest first."""
    return sorted({(s, pp, m, v) for pp, v, _, s, m in configs
                   if s != NO_PIPELINE and not orders_cached(s, pp, m, v)},
                  key=lambda shape: (-shape[1] * shape[2] * shape[3], shape))


def _orders_task(shape: tuple[str, int, int, int]) -> Callable[[], bytes | None]:
    """A task giving torch's orders of ``shape`` pickled (:func:`_file_order`
    reads them), or None where torch rejects it (the pricing reads that as no
    candidate). Pickled here by the C pickler in one piece: the forked
    child's results go through :mod:`planner.forked`'s pickler, which asks
    which object it is for each of the ~600k tuples and ints of a large
    shape (gpt3-175b: 2.2 s for all shapes, against 0.1 s)."""
    def run() -> bytes | None:
        try:
            return pickle.dumps(torch_orders(*shape), protocol=pickle.HIGHEST_PROTOCOL)
        except ValueError:
            return None
    return run


def _file_order(shape: tuple[str, int, int, int], blob: bytes | None) -> None:
    """File in this process the orders :func:`_orders_task` made for ``shape``."""
    if blob is not None:
        adopt_orders(*shape, pickle.loads(blob))


# The leading candidates whose ZeRO-3 variants zero_variants() prices.
ZERO_CANDIDATES = 6


def _zero3_estimate(c: PipelineCandidate) -> float:
    """What ``c``'s step would take if its weight gradients were reduced once per
    step rather than in each of its micro-batches (ZeRO-3's main change): its
    step less all but one micro-batch's weight-gradient all-reduces of its
    slowest-syncing stage. Ranks the candidates whose ZeRO-3 variants are priced."""
    if c.split is None:
        return c.step_time_s
    sync = max(t.weight_sync_s for t in c.split.times)
    return c.step_time_s - (c.num_microbatches - 1) * sync


def zero_variants(ctx: SearchContext, groups: Sequence[list[PipelineCandidate]],
                  opts: SearchOptions) -> list[list[PipelineCandidate]]:
    """For each group of ranked candidates, the ZeRO-3 variants of its
    :data:`ZERO_CANDIDATES` pipelines (without ZeRO, stage mesh with more than
    one rank on axis 0) that ZeRO-3 promises most (:func:`_zero3_estimate`),
    priced, best first; none unless
    ``opts`` allows both ZeRO stages. The groups are priced together, in
    one forked phase (in their order within each pricing scope, as if one
    after the other).

    ZeRO-3 keeps the parameters replicated on axis 0, shards their states
    there and synchronises gradients once per step instead of in every
    micro-batch (:class:`planner.intra_op.IntraOpCost`). Its layer
    profiles are ILPs of their own (a mesh family of its own). Only the
    leading configurations are tried: the ILP without ZeRO may already shard
    parameter states on any axis, so ZeRO-3 mostly changes how fast a
    configuration is, not whether it fits."""
    zeros = opts.zero_choices
    if not (0 in zeros and 3 in zeros):
        return [[] for _ in groups]
    per_group = [[(c.pp, c.stages_per_rank, dataclasses.replace(c.mesh, zero_stage=3),
                   c.schedule, c.num_microbatches)
                  for c in sorted((c for c in ranked if c.schedule != NO_PIPELINE
                                   and not c.mesh.zero_stage and c.mesh.shape[0] > 1),
                                  key=_zero3_estimate)[:ZERO_CANDIDATES]]
                 for ranked in groups]
    configs = [config for group in per_group for config in group]
    priced = _price_all(ctx, configs, lambda k, config: (
        f"ZeRO-3 variant {k + 1}/{len(configs)}: {config_label(*config)}"), traced=True)
    out, start = [], 0
    for group in per_group:
        variants = [c for c in priced[start:start + len(group)] if c is not None]
        variants.sort(key=lambda c: c.step_time_s)
        out.append(variants)
        start += len(group)
    return out


# The leading candidates whose (stage mesh, micro-batches) get ILP profiles of
# their own before the finalists are chosen, and at most how many such pairs.
REFINE_CANDIDATES = 6
REFINE_PAIRS = 3


def refine(ctx: SearchContext, ranked: list[PipelineCandidate]) -> list[PipelineCandidate]:
    """Re-price the leading candidates with ILP profiles of their own (mesh,
    micro-batch size) and all :data:`planner.search_context.PROFILE_LEVELS`
    memory levels, then rank again.

    Re-priced profiles carry placements the ILP chose at another micro-batch
    size or mesh of the family; they are feasible but can be far from the
    ILP's answer at this size (alpa-gpt3-15b on 32 V100: pp=4 x 8 interleaved
    1F1B was priced 35.9 s re-priced and 32.4 s by its own profile, which
    decided whether it reached the finalists)."""
    top = [c for c in ranked[:REFINE_CANDIDATES] if c.schedule != NO_PIPELINE]
    pairs: dict[tuple, StageMeshOption] = {}
    for c in top:
        pairs.setdefault((c.mesh.key, c.num_microbatches), c.mesh)
    pairs = dict(list(pairs.items())[:REFINE_PAIRS])
    changed = _own_profiles_forked(ctx, pairs)
    if not changed:
        return ranked
    again = []
    for c in ranked:
        if (c.mesh.key, c.num_microbatches) in changed:
            c = _price(ctx, c.pp, c.stages_per_rank, c.mesh, c.schedule, c.num_microbatches)
        if c is not None:
            again.append(c)
    again.sort(key=lambda c: c.step_time_s)
    return again


def _own_profiles_forked(ctx: SearchContext, pairs: dict[tuple, StageMeshOption]
                         ) -> list[tuple]:
    """:meth:`SearchContext.own_profiles` of every (stage mesh, micro-batches)
    pair, on two CPU cores (:mod:`planner.forked`); the pairs whose profiles
    changed.

    The pairs share no profile (each is filed under its own mesh and
    micro-batch size), so each gives the same profiles whichever process
    makes them. The programs whose strategies are enumerated are made here
    first, so that both processes hold them. A forked process's profiles come
    back without their priced problem, which is made again only if they are
    extended later (:meth:`SearchContext._extend`)."""
    progs = {}
    for (shape, m), mesh in pairs.items():
        prog = ctx.program(m)
        progs[shape, m] = ctx.program(m, traced=True) if ctx.has_repriced(prog, mesh) else prog
    child = ChildMark(ctx)

    def task(prog: MicrobatchProgram, mesh: StageMeshOption) -> Callable[[], tuple]:
        def run() -> tuple:
            solves = ctx.ilp_solves
            changed = ctx.own_profiles(prog, mesh)
            if child.in_child:  # sent back by pickling: without the priced problems
                changed = [(layer, dataclasses.replace(p, prepared=None)) for layer, p in changed]
            return changed, ctx.ilp_solves - solves
        return run

    shared = held_by_both(ctx, list(progs.values()))
    solves = ctx.ilp_solves
    done = run_forked([task(progs[key], mesh) for key, mesh in pairs.items()], shared, child)
    ctx.ilp_solves = solves + sum(d[1] for d in done)  # a child's never reach ctx by themselves
    for key, (changed, _) in zip(pairs, done):
        for layer, prof in changed:
            ctx.adopt(progs[key], layer, prof)
    return [key for key, (changed, _) in zip(pairs, done) if changed]


def _price(ctx: SearchContext, pp: int, v: int, mesh: StageMeshOption, schedule: str,
           m: int) -> PipelineCandidate | None:
    if ctx.global_batch % m:
        return None
    prog = ctx.program(m)
    S = pp * v
    if S > len(prog.layers):
        return None
    try:
        copies = stage_in_flight(schedule, pp, m, v)
    except ValueError:  # torch rejects this (schedule, pp, m) combination
        return None
    split = None
    for levels in (1, 2):  # the least-memory points only when the fastest do not fit
        profiles = [ctx.profile(prog, i, mesh, levels) for i in range(len(prog.layers))]
        if any(not p.points for p in profiles):
            return None
        # every point found so far is used; with the least-memory ones among
        # them, no point added later (they use more memory) could make it fit
        known = max(len(p.points) for p in profiles)
        split = split_layers(lambda i, lv: profiles[i].point(lv), len(prog.layers), S, m, copies,
                             ctx.budget / v, known)
        if split is not None:
            break
    if split is None:
        return None
    p2p = p2p_seconds(prog, split.bounds, mesh, ctx.cluster)
    step, bubble = simulate_step(schedule, pp, m, v, split.times, p2p)
    return PipelineCandidate(pp, v, mesh, schedule, m, split, step, bubble, sum(p2p))


