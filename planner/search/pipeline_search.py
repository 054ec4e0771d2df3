"""The candidates of the two-level search (:mod:`planner.search.two_level`):
pipeline configurations (stages, stage meshes, schedules, micro-batches,
ZeRO) priced from layer profiles by the inter-op DP, in phases of independent
tasks (:mod:`planner.search.phases`). The leading candidates are solved
exactly per stage by :mod:`planner.search.finalists`.

Units: seconds, bytes. See :mod:`planner.search.stage_dp` for the pieces and
:mod:`planner.search.context` for what the search shares.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Sequence

from costmodel.cluster import Cluster
from costmodel.schedules.specs import canonical_schedule, default_stages_per_rank, schedule_spec
from costmodel.schedules import ScheduleBook, simulate
from costmodel.memory import training_state_bytes
from costmodel.strategy_cost import FSDP_STAGES
from planner.search.stage_dp import (ACCUMULATING_SCHEDULE, NO_PIPELINE, SEARCH_SCHEDULES,
                                     PipelineCandidate, StageMeshOption, StageTimes, config_label,
                                     in_flight, split_layers, stage_mesh_options)
from planner.search.microbatch_programs import MicrobatchProgram
from planner.search.context import SearchContext
from planner.search.phases import own_profiles_of, price_all


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


def stage_in_flight(schedule: str, pp: int, m: int, v: int,
                    book: ScheduleBook | None = None) -> list[float]:
    """In-flight micro-batches of each stage (1 for a single stage).
    ``book``: the search's schedule orders (:attr:`SearchContext.schedule_book`)."""
    return [1.0] if schedule == NO_PIPELINE else in_flight(schedule, pp, m, v, book)


def schedule_action_s(schedule: str, cluster: Cluster) -> float:
    """Seconds torch.distributed.pipelining's schedule adds to each forward
    and backward of a stage under ``schedule`` on ``cluster``
    (``DeviceSpec.pipeline_action_overhead``, or its compiled counterpart where
    the stages run compiled and it was measured; none without a schedule)."""
    if schedule == NO_PIPELINE:
        return 0.0
    device = cluster.device
    if device.compiled and device.compiled_pipeline_action_overhead:
        return device.compiled_pipeline_action_overhead
    return device.pipeline_action_overhead


def split_backward_s(schedule: str, cluster: Cluster, times: Sequence[StageTimes]) -> list[float]:
    """Seconds torch's split backward adds to each stage's weight pass under
    ``schedule`` on ``cluster``: ``DeviceSpec.split_backward_group_overhead``
    per parameter group (:attr:`StageTimes.weight_groups`), where the
    schedule splits its backward (``ScheduleSpec.splits_backward``) and the
    stages run eager (a compiled stage's backward is one graph); none for the
    first stage, whose backward torch runs whole."""
    device = cluster.device
    if schedule == NO_PIPELINE or device.compiled or not schedule_spec(schedule).splits_backward:
        return [0.0] * len(times)
    return [0.0] + [t.weight_groups * device.split_backward_group_overhead for t in times[1:]]


def simulate_step(schedule: str, pp: int, m: int, v: int, times: list[StageTimes],
                  p2p: list[float], book: ScheduleBook | None = None,
                  action_s: float = 0.0, split_s: Sequence[float] | None = None
                  ) -> tuple[float, float]:
    """(step seconds including the slowest gradient sync and optimizer update,
    each stage's after its gradient accumulation over the ``m - 1`` micro-batches
    after the first, bubble seconds). ``book``: as for :func:`stage_in_flight`;
    ``action_s``: :func:`schedule_action_s`, added to each stage's forward and
    backward; ``split_s``: :func:`split_backward_s`, added to each stage's
    weight pass."""
    if schedule == NO_PIPELINE:
        return times[0].microbatch_s + times[0].step_end_s, 0.0
    split_s = split_s or [0.0] * len(times)
    r = simulate(schedule, pp, m, [t.forward_s + action_s for t in times],
                 [t.backward_input_s + action_s for t in times],
                 [t.backward_weight_s + s for t, s in zip(times, split_s)],
                 p2p if p2p else 0.0, stages_per_rank=v, timeline=False, book=book)
    end = max(t.step_end_s + t.accumulation_s(m) for t in times)
    return r.step_time + end, r.step_time - max(r.busy)


def runtime_step(ctx: SearchContext, schedule: str, pp: int, m: int, v: int,
                 times: list[StageTimes], p2p: list[float]) -> tuple[float, float]:
    """:func:`simulate_step` of a pipeline as the planner's runtime runs it on
    the search's cluster: each action pays :func:`schedule_action_s` and each
    eager stage's weight pass :func:`split_backward_s`."""
    cluster = ctx.settings.cluster
    return simulate_step(schedule, pp, m, v, times, p2p, ctx.schedule_book,
                         schedule_action_s(schedule, cluster),
                         split_backward_s(schedule, cluster, times))


def _microbatch_options(global_batch: int, pp: int, v: int, schedule: str,
                        limit: int, stage_devices: int = 1) -> list[int]:
    """Micro-batch counts tried, fewest first: the batch split into
    micro-batches of 1, 4, 16, ... sequences, at most ``limit`` of them, and
    into micro-batches of one sequence per device of the stage mesh
    (``stage_devices``: Megatron's micro-batch of one sequence per
    data-parallel rank, which a stage can split by batch alone) where that
    size lies between those (no larger than the largest of the ``limit``
    sizes), where the count is a multiple of pp, and of the fewest torch's
    schedule accepts where that is more (DualPipeV: 2pp). Micro-batches of one sequence keep
    the bubble and the in-flight activations smallest: with counts pp, 2pp
    and 4pp instead, gpt3-175b on 1024 A100s chose 516.10 s/step where
    pp=16 with 1536 micro-batches gives 277.74, and llama3-8b on 64 H100s
    71.10 where pp=2 with 256 gives 58.25."""
    first = max(pp, schedule_spec(schedule).min_microbatches(pp, v))

    def fits(size: int) -> bool:
        return global_batch % size == 0 and (global_batch // size) % first == 0

    counts = []
    size = 1  # sequences per micro-batch
    while global_batch // size >= first and len(counts) < limit:
        if fits(size):
            counts.append(global_batch // size)
        size *= 4
    largest = 4 ** (limit - 1)
    if (1 < stage_devices <= largest and fits(stage_devices)
            and global_batch // stage_devices not in counts):
        counts.append(global_batch // stage_devices)
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


# ZeRO stages the search tries for pipeline stages: none; ZeRO-1 (optimizer
# states sharded over stage mesh axis 0, codegen.zero1); FSDP2 over axis 0 as
# ZeRO-2 (optimizer states and gradients sharded, parameters not re-sharded
# between forward and backward) or ZeRO-3 (parameters sharded too).
SEARCH_ZERO_STAGES = (0, 1, 2, 3)

# Parameters of the probe zero_stages_priced() weighs the stages' state bytes with
# (bytes per parameter are the same at any count).
_STATE_PROBE = 1 << 20


def zero_stages_priced(zero_stages: Sequence[int], precision: str, optimizer: str,
                       ranks: int) -> list[int]:
    """The ZeRO stages (1, 2 or 3) the search prices for stages whose mesh
    axis 0 has ``ranks`` ranks, of those ``zero_stages`` allows, the one
    holding the least state bytes first; empty if it allows none.

    They differ in three ways:

    * when they reduce the gradients and gather the parameters: ZeRO-1 and
      ZeRO-2 once per step, ZeRO-3 unit by unit in every micro-batch,
      overlapped with the compute (:class:`costmodel.strategy_cost.IntraOpCost`);
    * the state bytes a device holds
      (:func:`costmodel.memory.training_state_bytes`): under bf16-mixed
      FSDP2's stages hold less (the fp32 master parameters sharded, a whole
      bf16 copy gathered); under fp32 and bf16 ZeRO-1 does where FSDP2's
      gathered copies are counted whole (this weighs them so: a stage of two
      units or fewer);
    * FSDP2's stages need every parameter replicated on axis 0; ZeRO-1 takes
      parameters sharded there too (expert weights under expert
      parallelism on the data-parallel axis, as Megatron-Core and DeepSeek
      run it), keeping the states of their own shard.

    So ZeRO-1 alone is priced where it holds no more than FSDP2, and both
    where FSDP2 holds less. Of FSDP2's two stages one is priced, 3 where
    allowed: it holds the least (unit by unit), and plans made before ZeRO-2
    was a choice keep their stage."""
    fsdp = max((z for z in FSDP_STAGES if z in zero_stages), default=None)
    if 1 not in zero_stages or fsdp is None:
        return [z for z in (fsdp, 1 if 1 in zero_stages else None) if z is not None]

    def held(z: int) -> int:
        return training_state_bytes(_STATE_PROBE, precision=precision, optimizer=optimizer,
                                    zero_stage=z, dp_size=max(int(ranks), 2),
                                    params_sharded=z in FSDP_STAGES)["total"]

    return [1] if held(1) <= held(fsdp) else [fsdp, 1]


@dataclass
class SearchOptions:
    """What the pipeline search may choose from (None = everything valid)."""

    pp: Sequence[int] | None = None
    schedules: Sequence[str] | None = None
    num_microbatches: Sequence[int] | None = None
    stage_mesh: Sequence[int] | None = None
    # ZeRO stages of pipeline stages and of single stages (SEARCH_ZERO_STAGES when None)
    zero_stages: Sequence[int] | None = None
    microbatch_options: int = 3
    finalists: int = 3
    # ZeRO-3 variants (zero_variants) solved exactly besides the finalists
    zero_finalists: int = 2

    @property
    def schedule_choices(self) -> list[str]:
        """The schedules allowed (canonical names): ``schedules``, or all the search tries."""
        return [canonical_schedule(s) for s in (self.schedules or SEARCH_SCHEDULES)]

    @property
    def zero_choices(self) -> list[int]:
        """The ZeRO stages allowed: ``zero_stages``, or all the search knows."""
        return list(SEARCH_ZERO_STAGES if self.zero_stages is None else self.zero_stages)


def configurations(ctx: SearchContext, opts: SearchOptions
                   ) -> list[tuple[int, int, StageMeshOption, str, int]]:
    """Every (pp, stages per rank, stage mesh, schedule, micro-batches) the
    search prices, in a fixed order: pp = 1 is the single stage of the whole
    batch (where :func:`whole_batch_allowed`), then the pipelines, then one
    stage accumulating the gradients of several micro-batches
    (:func:`accumulates`; last, so that the profiles they make change no
    other price; with a ZeRO stage asked for without 0, also one stage of
    one micro-batch under that ZeRO stage). The stage meshes are without ZeRO
    where ``opts`` allows it (:func:`zero_variants` adds ZeRO for the
    leading candidates), else with each ZeRO stage :func:`zero_stages_priced`
    gives (on meshes whose axis 0 has more than one rank). Pipelines of more stages than the
    program has layers are left out before any program is made for them
    (llama3-8b's 32 layers: 29 configurations, which under earlier
    micro-batch options alone asked for a capture at size 1, 2.7 s). With
    context parallelism (:attr:`SearchContext.context_parallel` > 1)
    micro-batches are counted in whole sequences (cp rows of the program
    each) and only the configurations :meth:`SearchContext.allows` are kept."""
    n = ctx.settings.cluster.num_devices
    schedules = opts.schedule_choices
    pps = list(opts.pp) if opts.pp else [p for p in range(1, n + 1) if n % p == 0]
    zeros = opts.zero_choices
    num_layers = len(ctx.program(1).layers)
    # with context parallelism the program's batch rows are cp per sequence:
    # micro-batches are counted in whole sequences, and the one of a sequence
    # per data-parallel rank holds axis 0 / cp of them (Megatron's, with cp)
    cp = ctx.settings.context_parallel
    sequences = ctx.global_batch // cp
    out, accumulating = [], []
    for pp in pps:
        meshes = stage_mesh_options(ctx.settings.cluster, pp)
        if opts.stage_mesh is not None:  # any logical view of the sub-mesh
            want = tuple(opts.stage_mesh)
            meshes = [StageMeshOption(want, mo.num_nodes, mo.devices_per_node)
                      for mo in meshes[:1] if mo.size == math.prod(want)]
        for whole in meshes:
            if pp == 1 and whole_batch_allowed(opts):  # one stage: the whole batch at once
                out.append((1, 1, whole, NO_PIPELINE, 1))
            stages = [0] if 0 in zeros else zero_stages_priced(
                zeros, ctx.settings.dtype, ctx.settings.optimizer, whole.shape[0])
            for zero in stages:
                if zero and whole.shape[0] == 1:
                    continue
                mesh = dataclasses.replace(whole, zero_stage=zero)
                if pp == 1:  # or micro-batches with their gradients accumulated (1F1B of one stage)
                    ms = list(opts.num_microbatches) if opts.num_microbatches else \
                        ([1] if zero else []) + _accumulation_options(sequences,
                                                                      opts.microbatch_options)
                    if ACCUMULATING_SCHEDULE in schedules:  # ZeRO's stage of one micro-batch too
                        accumulating.extend((1, 1, mesh, ACCUMULATING_SCHEDULE, m) for m in ms
                                            if m > 1 or zero)
                    continue
                for schedule in schedules:
                    v = default_stages_per_rank(schedule)
                    if pp * v > num_layers or schedule_spec(schedule).zero_stage_problem(zero):
                        continue
                    ms = list(opts.num_microbatches) if opts.num_microbatches else \
                        _microbatch_options(sequences, pp, v, schedule,
                                            opts.microbatch_options,
                                            mesh.shape[0] // cp if cp > 1 else mesh.size)
                    out.extend((pp, v, mesh, schedule, m) for m in ms)
    # context parallelism places whole sequences' rows on stage mesh axis 0
    return [c for c in out + accumulating if ctx.allows(c[2].shape, c[4])]


def whole_batch_allowed(opts: SearchOptions) -> bool:
    """Whether ``opts`` allows one stage of the whole batch (no ZeRO, one
    micro-batch): 0 among its ZeRO stages and 1 among its micro-batch counts
    (either left to the search allows it)."""
    return 0 in opts.zero_choices and (not opts.num_microbatches
                                       or 1 in opts.num_microbatches)


def accumulates(cand: PipelineCandidate) -> bool:
    """Whether ``cand`` is one stage accumulating the gradients of its micro-batches."""
    return cand.pp == 1 and cand.schedule != NO_PIPELINE


def search(ctx: SearchContext, opts: SearchOptions) -> list[PipelineCandidate]:
    """Every priced configuration (from layer profiles and the stage DP), best first."""
    configs = configurations(ctx, opts)
    candidates = [c for c in price_all(ctx, configs, _price, lambda k, config: (
        f"[{k + 1}/{len(configs)}] {config_label(*config)}")) if c is not None]
    candidates.sort(key=lambda c: c.step_time_s)
    return candidates


# The leading configurations whose ZeRO variants zero_variants() prices.
ZERO_CANDIDATES = 6


def zero_variants(ctx: SearchContext, groups: Sequence[list[PipelineCandidate]],
                  opts: SearchOptions) -> list[list[PipelineCandidate]]:
    """For each group of candidates (ranked fastest first), the ZeRO variants (each stage
    :func:`zero_stages_priced` gives for their mesh) of the fastest candidate
    of each of its first :data:`ZERO_CANDIDATES` configurations
    (:func:`_leading_configurations`; without ZeRO, stage mesh with more
    than one rank on axis 0), priced, best first; none unless
    ``opts`` allows 0 and a ZeRO stage. The
    variant of a single stage of the whole batch (:data:`NO_PIPELINE`) is
    :func:`_zero_variant_schedule`. The groups are priced together
    (:func:`planner.search.phases.price_all`; in their order within each
    pricing scope, as if one after the other).

    ZeRO shards the parameters' states over axis 0, and reduce-scatters
    their gradients where the plain stage all-reduces them
    (:class:`costmodel.strategy_cost.IntraOpCost`). Its layer profiles are ILPs of
    their own (a mesh family of its own). Only the leading configurations
    are tried: the ILP without ZeRO may already shard parameter states on any
    axis, so ZeRO mostly changes how fast a configuration is, not whether it
    fits."""
    zeros = opts.zero_choices
    if 0 not in zeros or not zero_stages_priced(zeros, ctx.settings.dtype,
                                                ctx.settings.optimizer, 2):
        return [[] for _ in groups]
    schedules = opts.schedule_choices

    def eligible(c: PipelineCandidate) -> bool:
        return (not c.mesh.zero_stage and c.mesh.shape[0] > 1
                and (c.schedule != NO_PIPELINE or ACCUMULATING_SCHEDULE in schedules))

    def variants(c: PipelineCandidate) -> list[tuple]:
        pp, v, schedule, m = _zero_variant_schedule(c)
        # a schedule that splits the backward runs ZeRO-2 where ZeRO-3 cannot run
        allowed = [z for z in zeros if not schedule_spec(schedule).zero_stage_problem(z)]
        return [(pp, v, dataclasses.replace(c.mesh, zero_stage=zero), schedule, m)
                for zero in zero_stages_priced(allowed, ctx.settings.dtype, ctx.settings.optimizer,
                                               c.mesh.shape[0])]

    per_group = [[v for c in _leading_configurations([c for c in ranked if eligible(c)])
                  for v in variants(c)] for ranked in groups]
    configs = [config for group in per_group for config in group]
    priced = price_all(ctx, configs, _price, lambda k, config: (
        f"ZeRO-{config[2].zero_stage} variant {k + 1}/{len(configs)}: {config_label(*config)}"),
        traced=True)
    out, start = [], 0
    for group in per_group:
        variants = [c for c in priced[start:start + len(group)] if c is not None]
        variants.sort(key=lambda c: c.step_time_s)
        out.append(variants)
        start += len(group)
    return out


def _leading_configurations(ranked: list[PipelineCandidate]) -> list[PipelineCandidate]:
    """The fastest candidate of each of the first :data:`ZERO_CANDIDATES`
    configurations (stage mesh, pp, stages a rank, micro-batches) of
    ``ranked``: the schedules of one configuration gain alike from ZeRO, so
    the variants cover as many configurations as they can instead of one
    configuration's schedules."""
    best: dict[tuple, PipelineCandidate] = {}
    for c in ranked:
        if len(best) == ZERO_CANDIDATES:
            break
        best.setdefault((c.mesh.key, c.pp, c.stages_per_rank, c.num_microbatches), c)
    return list(best.values())


def _zero_variant_schedule(c: PipelineCandidate) -> tuple[int, int, str, int]:
    """(pp, stages per rank, schedule, micro-batches) of ``c``'s ZeRO
    variants: ``c``'s own, except for a single stage of the whole batch
    (:data:`NO_PIPELINE`, which runs no schedule and so no ZeRO), whose ZeRO
    variant is a pipeline of that one stage with one micro-batch
    (:data:`ACCUMULATING_SCHEDULE`), as :func:`configurations` builds it for a
    ZeRO stage asked for without 0."""
    if c.schedule == NO_PIPELINE:
        return 1, 1, ACCUMULATING_SCHEDULE, 1
    return c.pp, c.stages_per_rank, c.schedule, c.num_microbatches


# The leading candidates whose (stage mesh, micro-batches) get ILP profiles of
# their own before the finalists are chosen, and at most how many such pairs.
REFINE_CANDIDATES = 6
REFINE_PAIRS = 3


def refine(ctx: SearchContext, ranked: list[PipelineCandidate]) -> list[PipelineCandidate]:
    """Re-price the leading candidates with ILP profiles of their own (mesh,
    micro-batch size) and all :data:`planner.search.memory_levels.PROFILE_LEVELS`
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
    changed = own_profiles_of(ctx, pairs)
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


def _price(ctx: SearchContext, pp: int, v: int, mesh: StageMeshOption, schedule: str,
           m: int) -> PipelineCandidate | None:
    """One configuration priced from layer profiles and the stage DP; None
    where it does not fit or torch rejects its schedule."""
    if ctx.global_batch % m:
        return None
    prog = ctx.program(m)
    S = pp * v
    if S > len(prog.layers):
        return None
    try:
        copies = stage_in_flight(schedule, pp, m, v, ctx.schedule_book)
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
                             ctx.settings.budget / v - ctx.pricing.zero3_headroom(prog, mesh),
                             known)
        if split is not None:
            break
    if split is None:
        return None
    p2p = p2p_seconds(prog, split.bounds, mesh, ctx.settings.cluster)
    step, bubble = runtime_step(ctx, schedule, pp, m, v, split.times, p2p)
    return PipelineCandidate(pp, v, mesh, schedule, m, split, step, bubble, sum(p2p))


