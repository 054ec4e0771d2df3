"""A Megatron-LM pipeline plan (:func:`pipeline_plan`): the layers split
into model chunks as Megatron splits them (:func:`chunk_bounds`), each chunk
solved by the intra-op ILP on the (dp, tp) stage mesh with the Megatron layout
fixed, in the memory its rank gives it (:class:`_Chunks`), priced by the
schedule's simulation; with context parallelism, the exchange of K/V added
to each chunk (:mod:`planner.search.cp_search`).

Units: seconds, bytes.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Collection, Sequence

import torch

from costmodel.cluster import Cluster, Link
from costmodel.schedules import ScheduleBook, rank_orders
from costmodel.schedules.peaks import stage_counts_at_peak
from costmodel.schedules.specs import schedule_spec
from costmodel.strategy_cost import IntraOpCost
from ir.graph import Graph
from ir.layers import block_count
from plan.format import Plan
from planner.baselines.megatron_memory import MegatronDoesNotFit, correct, zero1_correction
from planner.ilp.fixed_layout import FixedPlacementError
from planner.ilp.intra_op import IntraOpResult, MemoryInfeasibleError
from planner.megatron_layout import MegatronConfig
from planner.request import PlanningError
from planner.search.context import SearchContext
from planner.search.cp_search import context_parallel_seconds, cp_link, kv_buffer_bound
from planner.search.finalists import ExactPipeline, assemble
from planner.search.microbatch_programs import MicrobatchProgram
from planner.search.pipeline_search import p2p_seconds, schedule_action_s, simulate_step
from planner.search.plan_assembly import build_plan
from planner.search.settings import SearchSettings
from planner.search.stage_dp import PipelineCandidate, StageMeshOption, stage_mesh_options
from planner.search.stage_times import StageTimes

__all__ = ["PAD_HINT", "chunk_bounds", "pipeline_plan", "stage_copies"]

PAD_HINT = (" (Megatron pads the vocabulary to a multiple of 128 x tp: "
            "--make-vocab-size-divisible-by)")


def cp_rank_link(stage_cluster: Cluster, cfg: MegatronConfig) -> Link:
    """The link a cp group's ring or all-gather runs over: Megatron's rank order
    (tp fastest, then cp, then dp) laid on the stage's devices."""
    return cp_link(stage_cluster, cfg.dp, cfg.cp, cfg.tp)


def chunk_bounds(layers: Sequence[Any], counts: Sequence[int]) -> list[tuple[int, int]]:
    """``(first, end)`` layer indices of the model chunks holding ``counts[c]``
    blocks each, the end layers (embedding; head and loss) joining the first
    and the last chunk, as :func:`ir.layers.manual_bounds`; the first chunk may
    hold no block (the embedding alone) and the last none (the head and loss
    alone), where there is such an end layer.

    Raises:
        PlanningError: the counts do not split the blocks that way.
    """
    blocks = [i for i, layer in enumerate(layers) if not layer.end]
    ok = (sum(counts) == len(blocks) and min(counts[1:-1], default=1) >= 1
          and min(counts) >= 0 and (counts[0] >= 1 or blocks[0] > 0)
          and (counts[-1] >= 1 or blocks[-1] < len(layers) - 1) and len(counts) >= 1)
    if not ok:
        raise PlanningError(f"blocks per model chunk {list(counts)} do not split the "
                            f"{len(blocks)} blocks (only the first and last chunk may hold none, "
                            f"where an embedding or a head is there to hold)")
    cuts, done = [0], 0
    for c in counts[:-1]:
        done += c
        cuts.append(blocks[done] if done < len(blocks) else blocks[-1] + 1)
    cuts.append(len(layers))
    return list(zip(cuts[:-1], cuts[1:]))


def stage_copies(schedule: str, pp: int, m: int, v: int, book: ScheduleBook,
                  act_b: dict[int, float] | None = None) -> list[float]:
    """In-flight micro-batches of each chunk: its live activations at its
    rank's peak in torch's order (:func:`costmodel.schedules.peaks.stage_counts_at_peak`;
    weighted by the chunks' activation bytes per micro-batch ``act_b`` when
    given), at least one.

    Not the rank's peak shared evenly among its chunks (what the automatic
    search's :func:`planner.search.stage_dp.in_flight` assumes of its uniform
    stages): under torch's interleaved 1F1B, which is Llama 3's schedule with
    N = m / max(1, m // pp) micro-batches per round, the last rank's head
    chunk holds one micro-batch at a time, and an even share counted 14 of
    its logits (31 GB of Llama 3 405B's row 1), which made every other
    chunk recompute."""
    orders, _ = rank_orders(schedule, pp, m, v, book=book)
    counts = stage_counts_at_peak(orders, pp, act_b)
    return [float(max(1, counts.get(s, 0))) for s in range(pp * v)]


def pipeline_plan(model: torch.nn.Module, cluster: Cluster, cfg: MegatronConfig,
                  example_inputs: tuple, graph: Graph, layout: dict[str, tuple],
                  experts: Collection[str], m: int, dtype: str, optimizer: str, budget: float,
                  time_limit_s: float, cache: dict, info: dict, training: dict) -> Plan:
    """A Megatron pipeline: uniform layer split, fixed layout, 1F1B / interleaved
    (with pp = 1: one stage accumulating the gradients of its micro-batches;
    or ``cfg.pipeline_schedule``)."""

    options = stage_mesh_options(cluster, cfg.pp)
    if not options:
        raise PlanningError(f"{cfg.label()}: pp={cfg.pp} does not cut cluster '{cluster.name}' "
                            f"into sub-meshes inside a node or of whole nodes")
    # the distributed optimizer: optimizer states sharded over dp (mesh axis 0),
    # gradients reduced once per step (ZeRO-1); without it DDP's all-reduce,
    # also once per step (as every stage's, see IntraOpCost)
    zero = 1 if cfg.use_distributed_optimizer and cfg.dp > 1 else 0
    mesh = StageMeshOption(cfg.mesh_shape, options[0].num_nodes, options[0].devices_per_node,
                           zero_stage=zero)
    ctx = _search_context(cache, cfg, model, example_inputs, cluster, dtype, optimizer, budget,
                          time_limit_s, layout, graph)
    prog = ctx.program(m, traced=True)
    v = cfg.stages_per_rank
    bounds = chunk_bounds(prog.layers, cfg.layer_split(block_count(prog.layers)))
    try:
        copies = stage_copies(cfg.schedule, cfg.pp, m, v, ctx.schedule_book)
    except ValueError as err:
        raise PlanningError(f"{cfg.label()}: torch's {cfg.schedule} schedule rejects pp={cfg.pp} "
                            f"with {m} micro-batches: {err}") from None
    stage_cluster = mesh.cluster(cluster)
    link = cp_rank_link(stage_cluster, cfg) if cfg.cp > 1 else None
    chunks = _Chunks(cfg, ctx, prog, mesh, bounds, layout, experts, dtype, optimizer, budget,
                     copies, schedule_spec(cfg.schedule).stage_to_rank(cfg.pp, v))
    solved = chunks.solve_all()
    if v > 1:
        # the rank's peak weighted by each chunk's own activation bytes per
        # micro-batch: the counts at that moment, solved again where they differ
        act_b = {s: r.memory.get("activations", 0.0) / chunks.copies[s]
                 for s, r in solved.items()}
        weighted = stage_copies(cfg.schedule, cfg.pp, m, v, ctx.schedule_book, act_b)
        if weighted != chunks.copies:
            chunks.copies = weighted
            solved = chunks.solve_all()
    results = [solved[s] for s in range(len(bounds))]
    times, held = _chunk_times(results, ctx, mesh, cfg, stage_cluster, link)
    p2p = p2p_seconds(prog, bounds, mesh, cluster)
    step, bubble = simulate_step(cfg.schedule, cfg.pp, m, v, times, p2p, ctx.schedule_book,
                                 schedule_action_s(cfg.schedule, cluster))
    cand = PipelineCandidate(cfg.pp, v, mesh, cfg.schedule, m, None, step, bubble, sum(p2p))
    exact = ExactPipeline(cand, prog, bounds, results, times, chunks.copies, step, bubble, p2p)
    plan = assemble(exact, ctx, lambda r, c: build_plan(r, c, info, training),
                    walk_schedule=False)
    if cfg.cp > 1:
        _record_exchange(plan, held, times, results, ctx, cfg, stage_cluster, link)
    return plan


def _search_context(cache: dict, cfg: MegatronConfig, model: torch.nn.Module,
                    example_inputs: tuple, cluster: Cluster, dtype: str, optimizer: str,
                    budget: float, time_limit_s: float, layout: dict[str, tuple],
                    graph: Graph) -> SearchContext:
    """The search context of ``cfg``'s layout and settings, one per ``cache``
    (its programs and schedule orders shared by the configurations of a grid)."""
    # what the layout (fixed in the context) depends on, and the context's settings
    key = ("ctx", cfg.dp, cfg.cp, cfg.tp, cfg.ep, cfg.sequence_parallel, budget, time_limit_s,
           optimizer)
    ctx = cache.get(key)
    if ctx is None:
        settings = SearchSettings(cluster, dtype, optimizer, budget, time_limit_s,
                                  fixed=layout, context_parallel=cfg.cp)
        ctx = cache[key] = SearchContext(model, example_inputs, settings,
                                         programs=cache.setdefault("programs", {}),
                                         schedule_book=cache.setdefault("schedule_book",
                                                                        ScheduleBook()),
                                         whole_batch_graph=graph)
    return ctx


@dataclasses.dataclass
class _Chunks:
    """The model chunks of a Megatron pipeline and what solving them shares:
    each chunk's layers (``bounds``), its in-flight micro-batches
    (``copies``) and its pipeline rank (``ranks``)."""

    cfg: MegatronConfig
    ctx: SearchContext
    prog: MicrobatchProgram
    mesh: StageMeshOption
    bounds: list[tuple[int, int]]
    layout: dict[str, tuple]
    experts: Collection[str]
    dtype: str
    optimizer: str
    budget: float
    copies: list[float]
    ranks: Sequence[int]

    def solve(self, s: int, share: float) -> IntraOpResult:
        """Chunk ``s`` solved in ``share`` bytes per device, its memory as
        Megatron holds it (:func:`planner.baselines.megatron_memory.zero1_correction`)."""
        cfg, zero = self.cfg, self.mesh.zero_stage
        modelled = cfg.mesh_shape[0] if zero else 1  # the stage mesh's ZeRO-1 axis
        a, b = self.bounds[s]
        sub = self.ctx.stage_graph(self.prog, a, b)
        correction = zero1_correction(sub, self.layout, cfg, self.experts, zero, modelled,
                                      self.optimizer, self.dtype)
        # the K/V buffers under the layout's split (heads over tp, rows over dp x cp)
        buffers = kv_buffer_bound(sub, cfg.cp, cfg.cp_comm_type, cfg.mesh_shape)
        try:
            r = self.ctx.solve_stage(self.prog, a, b, self.mesh,
                                     share - sum(correction.values()) - buffers,
                                     self.copies[s], cfg.recompute)
        except FixedPlacementError as err:
            raise PlanningError(f"{cfg.label()} does not divide the model: {err}{PAD_HINT}"
                                ) from err
        correct(r.memory, correction)
        return r

    def solve_all(self) -> dict[int, IntraOpResult]:
        """Every chunk solved in an even share of its rank's memory; a chunk
        that needs more takes its least and the rank's others share the rest."""
        solved: dict[int, IntraOpResult] = {}
        need = self._solve_evenly(solved)
        # a rank's chunks share its memory: a chunk that needs more than an even
        # share (the head of an uneven layout) takes its least, the rank's other
        # chunks are solved again in what is left, evenly, and the short chunk then
        # gets all the others leave
        for rank in sorted({self.ranks[s] for s in need}):
            self._share_rank(rank, solved, need)
        return solved

    def _solve_evenly(self, solved: dict[int, IntraOpResult]) -> dict[int, float]:
        """Each chunk solved in an even share of its rank's memory, into
        ``solved``; the least share of those that do not fit."""
        v, budget = self.cfg.stages_per_rank, self.budget
        need: dict[int, float] = {}  # a short chunk's least share of its rank's memory
        for s in range(len(self.bounds)):
            try:
                solved[s] = self.solve(s, budget / v)
            except MemoryInfeasibleError as err:
                if v == 1:
                    raise MegatronDoesNotFit(
                        f"{self.cfg.label()}: stage {s} does not fit: {err}") from None
                # the ILP's least, plus what solve() kept back from the share
                need[s] = err.least_bytes + (budget / v - err.budget_bytes)
        return need

    def _share_rank(self, rank: int, solved: dict[int, IntraOpResult],
                    need: dict[int, float]) -> None:
        """The chunks of ``rank`` solved again: those that fit in what its
        short chunks (``need``) leave, evenly, then each short one in what
        the others leave."""
        label, budget = self.cfg.label(), self.budget
        mine = [s for s in range(len(self.bounds)) if self.ranks[s] == rank]
        others = [s for s in mine if s not in need]
        rest = budget - sum(need[s] for s in mine if s in need)
        for s in others:
            if others and sum(solved[s].memory.values()) > rest / len(others):
                try:
                    solved[s] = self.solve(s, rest / len(others))
                except MemoryInfeasibleError as err:
                    raise MegatronDoesNotFit(
                        f"{label}: stage {s} does not fit beside its "
                        f"rank's larger stages: {err}") from None
        for s in mine:
            if s in need:
                left = (budget - sum(sum(solved[o].memory.values()) for o in mine
                                     if o in solved)
                        - sum(need[o] for o in mine
                              if o in need and o not in solved and o != s))
                try:
                    solved[s] = self.solve(s, left)
                except MemoryInfeasibleError as err:
                    raise MegatronDoesNotFit(f"{label}: stage {s} does not fit in the "
                                             f"{left / 2**30:.1f} GiB its rank's other stages "
                                             f"leave: {err}") from None


def _chunk_times(results: Sequence[IntraOpResult], ctx: SearchContext, mesh: StageMeshOption,
                 cfg: MegatronConfig, stage_cluster: Cluster, link: Link | None
                 ) -> tuple[list[StageTimes], float]:
    """Each chunk's times on ``mesh`` as Megatron runs it (no gradient
    accumulation pass), with context parallelism's exchange
    (:func:`planner.search.cp_search.context_parallel_seconds` over ``link``)
    added to its forward and backward; and the largest K/V buffers of that
    exchange, bytes per device (0 without cp)."""
    times = []
    held = 0.0  # the largest K/V buffers of context parallelism, bytes per device
    for r in results:
        # Megatron's weight-gradient GEMMs add into its fp32 main_grad buffers
        # themselves (gradient_accumulation_fusion, on by default): no separate
        # pass adds a micro-batch's gradients, as autograd's does in our runtime
        t = dataclasses.replace(ctx.pricing.times_of(r, mesh), accumulate_s=0.0)
        if cfg.cp > 1:
            cost = IntraOpCost(r.graph, stage_cluster, r.mesh_shape, ctx.settings.dtype,
                               ctx.settings.optimizer)
            f, bwd, kv_buffers = context_parallel_seconds(r, cost, cfg.cp, cfg.cp_comm_type, link)
            t = dataclasses.replace(t, forward_s=t.forward_s + f,
                                    backward_input_s=t.backward_input_s + bwd)
            held = max(held, kv_buffers)
        times.append(t)
    return times, held


def _record_exchange(plan: Plan, held: float, times: Sequence[StageTimes],
                     results: Sequence[IntraOpResult], ctx: SearchContext, cfg: MegatronConfig,
                     stage_cluster: Cluster, link: Link | None) -> None:
    """Count context parallelism's K/V buffers (``held``) at the plan's peak and
    record its exchange in ``plan.predicted["context_parallel"]``."""
    # the exchange's buffers, held while one attention runs: counted at the peak
    memory = plan.predicted["memory_bytes_per_device"]
    memory["peak"] = int(round(memory["peak"] + held))
    plan.predicted["context_parallel"] = {
        "kv_buffer_bytes": held,
        "forward_s_per_microbatch": [t.forward_s for t in times],
        "exchange_s_per_microbatch": [
            sum(context_parallel_seconds(r, IntraOpCost(r.graph, stage_cluster, r.mesh_shape,
                                                        ctx.settings.dtype, ctx.settings.optimizer),
                                         cfg.cp, cfg.cp_comm_type, link)[:2])
            for r in results]}
