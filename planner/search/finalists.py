"""The finalists of a pipeline search solved exactly, stage by stage, with
the intra-op ILP, and the winner written as one Plan.

Units: seconds, bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from costmodel.cluster import Cluster
from costmodel.memory import optimizer_step_bytes
from costmodel.schedules.book import ScheduleBook, rank_orders
from costmodel.schedules.peaks import StageBytes, rank_step_peaks
from costmodel.schedules.specs import schedule_spec
from costmodel.strategy_cost import IntraOpCost
from ir.graph import INPUT
from ir.placements import placement_strs
from planner.search.stage_dp import PipelineCandidate
from planner.search.stage_times import StageTimes
from planner.ilp.solve import InfeasibleError
from planner.ilp.intra_op import IntraOpResult, MemoryInfeasibleError
from planner.search.microbatch_programs import MicrobatchProgram
from planner.search.pipeline_search import (accumulates, p2p_seconds, runtime_step,
                                            schedule_action_s, split_backward_s, stage_in_flight)
from plan.format import PipelinePlan, Plan, SolverReport, StagePlan, training_precision
from planner.search.context import SearchContext
from planner.search.phase_runner import Phase, PhaseTask
from planner.search.plan_assembly import step_copy_of, whole_batch_peak


@dataclass
class ExactPipeline:
    """A candidate with every stage solved exactly on its own sub-graph."""

    candidate: PipelineCandidate
    program: MicrobatchProgram
    bounds: list[tuple[int, int]]
    results: list[IntraOpResult]
    times: list[StageTimes]
    copies: list[float]
    step_time_s: float
    bubble_s: float
    p2p: list[float]


def fastest(exact: Sequence[ExactPipeline]) -> ExactPipeline:
    """The fastest of ``exact``; of equally fast ones (a ZeRO-1 and a ZeRO-3
    variant of one pipeline, whose collectives are the same) the one whose
    fullest stage holds least, then the first. Step times are compared to
    the picosecond, so that sums made in another order still tie."""
    return min(exact, key=fastest_key)


def fastest_key(exact: ExactPipeline) -> tuple[float, float]:
    """What :func:`fastest` orders by: the step time to the picosecond, then
    the fullest stage's bytes."""
    return (round(exact.step_time_s, 12),
            max(t.memory(c) for t, c in zip(exact.times, exact.copies)))


def solve_exact(ctx: SearchContext, cand: PipelineCandidate,
                bounds: list[tuple[int, int]] | None = None,
                recompute: bool | None = None) -> ExactPipeline:
    """Solve each stage of ``cand`` (or of the given layer ``bounds``) with the
    intra-op ILP under its share of memory and in-flight activations;
    ``recompute`` True or False pins its activation checkpointing (every
    layer, or none: :func:`planner.ilp.intra_op.solve_prepared`; no solution
    is then reused), None lets the ILP choose."""
    prog, bounds, copies = _stages(ctx, cand, bounds)
    results = [None] * len(bounds)
    for s in _solve_order(copies):
        results[s] = _exact_stage(ctx, prog, cand, bounds[s], copies[s], s, recompute)
    return _exact_pipeline(ctx, cand, prog, bounds, copies, results)


# a candidate's program, the layer bounds and in-flight micro-batches of its stages
Staged = tuple[MicrobatchProgram, list[tuple[int, int]], list[float]]


def _stages(ctx: SearchContext, cand: PipelineCandidate,
            bounds: list[tuple[int, int]] | None = None) -> Staged:
    """The captured program, the layer bounds and the in-flight micro-batches
    of each stage of ``cand``."""
    prog = ctx.program(cand.num_microbatches, traced=True)
    copies = stage_in_flight(cand.schedule, cand.pp, cand.num_microbatches, cand.stages_per_rank,
                             ctx.schedule_book)
    return prog, list(bounds or cand.split.bounds), copies


def _solve_order(copies: list[float]) -> list[int]:
    """Stages with fewer in-flight micro-batches first: their solutions may
    carry over to stages of the same layers that hold more."""
    return sorted(range(len(copies)), key=lambda s: copies[s])


def _exact_stage(ctx: SearchContext, prog: MicrobatchProgram, cand: PipelineCandidate,
                 bounds: tuple[int, int], copies: float, s: int,
                 recompute: bool | None = None) -> IntraOpResult:
    a, b = bounds
    ctx.progress(f"stage {s}: layers {a}..{b - 1}")
    budget = ctx.settings.budget / cand.stages_per_rank
    if recompute is not None:
        return ctx.solve_stage(prog, a, b, cand.mesh, budget, copies, recompute)
    return ctx.exact_stage(prog, a, b, cand.mesh, budget, copies)


def _exact_pipeline(ctx: SearchContext, cand: PipelineCandidate, prog: MicrobatchProgram,
                    bounds: list[tuple[int, int]], copies: list[float],
                    results: list[IntraOpResult],
                    times: list[StageTimes] | None = None) -> ExactPipeline:
    """The step time of ``cand`` with its stages' exact solutions ``results``
    (whose :meth:`SearchContext.times_of` are ``times`` where given)."""
    if times is None:
        times = [ctx.pricing.times_of(r, cand.mesh) for r in results]
    p2p = p2p_seconds(prog, bounds, cand.mesh, ctx.settings.cluster)
    step, bubble = runtime_step(ctx, cand.schedule, cand.pp, cand.num_microbatches,
                                cand.stages_per_rank, times, p2p)
    return ExactPipeline(cand, prog, bounds, results, times, copies, step, bubble, p2p)


def solve_finalists(ctx: SearchContext, finalists: Sequence[PipelineCandidate]
                    ) -> list[ExactPipeline | None]:
    """:func:`solve_exact` of every finalist (None where a stage has no plan
    within limits), one task per chain of stages (:meth:`SearchContext.run_phase`).

    A stage's exact solve reads and writes only the solutions filed under
    its :meth:`SearchContext.stage_key` (its layer kinds on its stage mesh
    at its micro-batch size). The stages of all finalists are
    therefore cut into chains by that key, each chain in the order
    :func:`solve_exact` of the finalists one after another would reach them;
    chains share nothing, so each gives the same answers whichever process
    runs it. The programs are captured first, here, so that both processes
    hold them and results refer to them instead of copying them."""
    ctx.progress(f"exact stage solves of {len(finalists)} finalists")
    staged = [_stages(ctx, cand) for cand in finalists]
    chains: dict[tuple, list[tuple[int, int]]] = {}
    for i, (cand, (prog, bounds, copies)) in enumerate(zip(finalists, staged)):
        for s in _solve_order(copies):
            chains.setdefault(ctx.stage_key(prog, *bounds[s], cand.mesh), []).append((i, s))
    solved: list[list[tuple[IntraOpResult, StageTimes] | None]] = [
        [None] * len(b) for _, b, _ in staged]
    # the longest chains first, so that the last chain to start is short
    ctx.run_phase(Phase([_StageChain(ctx, finalists, staged, items, solved)
                         for items in sorted(chains.values(), key=len, reverse=True)]),
                  [prog for prog, _, _ in staged])
    return [None if any(r is None for r in rs) else
            _exact_pipeline(ctx, cand, prog, bounds, copies, [r for r, _ in rs],
                            [t for _, t in rs])
            for cand, (prog, bounds, copies), rs in zip(finalists, staged, solved)]


class _StageChain(PhaseTask):
    """The exact solves of the stages ``items`` ((finalist, stage) pairs of
    one :meth:`SearchContext.stage_key`), in order, each with its times, or
    None after a stage of its finalist had no plan within limits; filed into
    ``solved[finalist][stage]``. A forked child sends back how many ILPs it
    solved and stages it reused."""

    def __init__(self, ctx: SearchContext, finalists: Sequence[PipelineCandidate],
                 staged: Sequence[Staged], items: list[tuple[int, int]],
                 solved: list[list[tuple[IntraOpResult, StageTimes] | None]]):
        self.ctx = ctx
        self.finalists = finalists
        self.staged = staged
        self.items = items
        self.solved = solved

    def run(self) -> tuple[list[tuple[IntraOpResult, StageTimes] | None], int, int]:
        """The stages' solutions and times, the ILPs solved and the stages reused."""
        ctx = self.ctx
        solves, reused = ctx.ilp_solves, ctx.stages_reused
        failed: set[int] = set()  # finalists with a stage that has no plan
        out: list[tuple[IntraOpResult, StageTimes] | None] = []
        for i, s in self.items:
            prog, bounds, copies = self.staged[i]
            solved = None
            if i not in failed:
                try:
                    result = _exact_stage(ctx, prog, self.finalists[i], bounds[s], copies[s], s)
                    solved = result, ctx.pricing.times_of(result, self.finalists[i].mesh)
                except (MemoryInfeasibleError, InfeasibleError):  # no plan within limits
                    failed.add(i)
            out.append(solved)
        return out, ctx.ilp_solves - solves, ctx.stages_reused - reused

    def file(self, result: tuple) -> None:
        for (i, s), stage in zip(self.items, result[0]):
            self.solved[i][s] = stage

    def file_sent(self, sent: tuple) -> None:
        self.ctx.ilp_solves += sent[1]
        self.ctx.stages_reused += sent[2]
        self.file(sent)


# Finalists predicted slower than the fastest prediction by more than this
# factor are solved exactly only when none of the others has a plan. Over the
# 86 finalists of the 12 plan_quality cases (all solved), none of the 26 so
# far behind won (the nearest ended 14.4 % behind the winner), and the
# predictions of pipelines and whole-batch single stages were within 3.3 % of
# their exact solves; gpt3-175b's interleaved finalists, 29 % behind, took a
# third of its exact solve time (with pp, 4pp and 16pp micro-batches, before
# micro-batches of 1, 4 and 16 sequences). One stage accumulating micro-batches is
# always solved: its predictions were up to 85 % above its exact solve.
FINALIST_MARGIN = 1.15

# Besides the fastest single stage accumulating micro-batches (and its fastest
# ZeRO variant), solved whatever their prediction, the fastest of each other
# micro-batch count is solved exactly where predicted within this factor of the
# fastest prediction: such predictions were up to 85 % above their exact solves.
ACCUMULATING_MARGIN = 1.85


def split_far_finalists(finalists: Sequence[PipelineCandidate],
                        margin: float = FINALIST_MARGIN
                        ) -> tuple[list[PipelineCandidate], list[PipelineCandidate]]:
    """``(close, far)``: the finalists that accumulate micro-batches on one
    stage (:func:`accumulates`) or are predicted within ``margin`` times the
    fastest prediction, and the rest (both in their order)."""
    fastest = min((c.step_time_s for c in finalists), default=math.inf)

    def close(c: PipelineCandidate) -> bool:
        return accumulates(c) or c.step_time_s <= margin * fastest

    return [c for c in finalists if close(c)], [c for c in finalists if not close(c)]


def runs_whole_batch(cand: PipelineCandidate) -> bool:
    """Whether ``cand`` is one stage that runs the whole batch in one pass,
    with its gradients whole (ZeRO 0 or 1): they then appear only as the
    activations go, and its peak is a single step's
    (:func:`planner.search.plan_assembly.whole_batch_peak`) rather than the
    sum of its parts."""
    return cand.pp == 1 and cand.num_microbatches == 1 and cand.mesh.zero_stage <= 1


def set_whole_batch_peaks(results: Sequence[IntraOpResult], parts: Sequence[Plan],
                          cluster: Cluster, zero_stage: int) -> None:
    """Set each part's predicted peak to its whole-batch step's, its
    optimizer's states sharded as ZeRO stage ``zero_stage`` shards them."""
    for r, part in zip(results, parts):
        memory = part.predicted["memory_bytes_per_device"]
        memory["peak"] = int(round(whole_batch_peak(r, _stage_cost(r, part, cluster, zero_stage),
                                                    part.training)))


def set_unit_gradient_peaks(results: Sequence[IntraOpResult], parts: Sequence[Plan],
                            cluster: Cluster) -> None:
    """ZeRO-3, unit by unit: set each part's predicted peak to the sum of its
    parts less the smaller of its largest backward transient and the whole
    gradients of its gathered units, where that transient's backward comes
    before any gradient is made (:meth:`IntraOpCost.unit_gradient_bytes`):
    each unit's whole gradients live only through its own backward, after the
    loss's, so the peak holds the larger of the two, not both."""
    for r, part in zip(results, parts):
        memory = part.predicted["memory_bytes_per_device"]
        whole = _stage_cost(r, part, cluster, 3).unit_gradient_bytes(r.chosen)
        memory["peak"] = int(round(memory["peak"] - min(memory.get("backward_transient", 0), whole)))


def walks_schedule(cand: PipelineCandidate) -> bool:
    """Whether ``cand``'s peak is found by walking its schedule
    (:func:`set_schedule_peaks`): one stage a rank, gradients whole (ZeRO 0
    or 1), several micro-batches."""
    return (cand.stages_per_rank == 1 and cand.mesh.zero_stage <= 1
            and not runs_whole_batch(cand))


def set_schedule_peaks(exact: ExactPipeline, parts: Sequence[Plan], cluster: Cluster,
                       book: ScheduleBook) -> None:
    """Set each stage part's predicted peak to its rank's over the step, in
    torch's order of the schedule's actions
    (:func:`costmodel.schedules.peaks.rank_step_peaks`): a stage's gradients
    appear with its first backward, not beside the first micro-batches'
    activations. One stage a rank (:func:`walks_schedule`)."""
    cand = exact.candidate
    orders, s2r = rank_orders(cand.schedule, cand.pp, cand.num_microbatches,
                              cand.stages_per_rank, book=book)
    stages = {s: _stage_bytes(r, part, exact.copies[s], cluster, cand.mesh.zero_stage)
              for s, (r, part) in enumerate(zip(exact.results, parts))}
    peaks = rank_step_peaks(orders, cand.pp, stages)
    for s, part in enumerate(parts):
        part.predicted["memory_bytes_per_device"]["peak"] = int(round(peaks[s2r[s]]))


def _stage_cost(r: IntraOpResult, part: Plan, cluster: Cluster, zero_stage: int) -> IntraOpCost:
    """The cost model of stage ``r`` as its plan ``part`` trains it (one micro-batch)."""
    return IntraOpCost(r.graph, cluster, r.mesh_shape, training_precision(part.training),
                       part.training.get("optimizer", "adam"), zero_stage=zero_stage)


def _stage_bytes(r: IntraOpResult, part: Plan, copies: float, cluster: Cluster,
                 zero_stage: int) -> StageBytes:
    """Stage ``r``'s bytes per device for the schedule walk, from its plan
    ``part``'s memory (its activations of ``copies`` micro-batches). Each
    micro-batch's forward makes its own compute-dtype copy of the parameters
    (the step copy, :meth:`IntraOpCost.step_copy`), which its backward keeps
    until it runs: counted with the micro-batch, not once with the
    parameters."""
    memory = part.predicted["memory_bytes_per_device"]
    cost = _stage_cost(r, part, cluster, zero_stage)
    copy = step_copy_of(r, cost)
    return StageBytes(
        held=memory["params"] + memory["optimizer"] - copy,
        activation=memory["activations"] / copies + copy, grads=memory["grads"],
        first_backward=cost.backward_excess(r.chosen, r.checkpointed),
        later_backward=max(memory.get("backward_transient", 0), memory.get("recomputed_layer", 0)),
        update=optimizer_step_bytes(memory, part.training.get("optimizer", "adam")))


def assemble(exact: ExactPipeline, ctx: SearchContext,
             base_plan: Callable[[IntraOpResult, Cluster], Plan], *,
             walk_schedule: bool = True) -> Plan:
    """One Plan from the exactly solved stages (placements merged by node name).
    ``walk_schedule``: price the stages' peaks as this runtime runs them
    (:func:`set_schedule_peaks`); False keeps the sum of their parts (a
    baseline whose memory follows another runtime's, as Megatron-LM's, which
    keeps its working parameters instead of casting them per micro-batch)."""
    cand = exact.candidate
    prog = exact.program
    mesh_shape = list(cand.mesh.shape)
    world = cand.pp * cand.mesh.size
    s2r = schedule_spec(cand.schedule).stage_to_rank(cand.pp, cand.stages_per_rank)
    stage_cluster = cand.mesh.cluster(ctx.settings.cluster)
    parts = [base_plan(r, stage_cluster) for r in exact.results]
    if runs_whole_batch(cand):
        set_whole_batch_peaks(exact.results, parts, stage_cluster, cand.mesh.zero_stage)
    elif walk_schedule and walks_schedule(cand):
        set_schedule_peaks(exact, parts, stage_cluster, ctx.schedule_book)
    elif cand.mesh.zero_stage == 3:
        set_unit_gradient_peaks(exact.results, parts, stage_cluster)
    action = schedule_action_s(cand.schedule, ctx.settings.cluster)
    split_s = split_backward_s(cand.schedule, ctx.settings.cluster, exact.times)
    stages: list[StagePlan] = []
    for s, (r, part) in enumerate(zip(exact.results, parts)):
        a, b = exact.bounds[s]
        recv, send = prog.boundaries[a][0], prog.boundaries[b - 1][1]
        next_inputs = parts[s + 1] if s + 1 < len(parts) else None
        inputs = {name: placement_strs(r.chosen[name].outputs[0]) for name in recv}
        if next_inputs is None:
            outputs = {name: placement_strs(r.chosen[name].outputs[0]) for name in send}
        else:
            nr = exact.results[s + 1]
            outputs = {name: placement_strs(nr.chosen[name].outputs[0]) for name in send}
        rank = s2r[s]
        ranks = list(range(rank * cand.mesh.size, (rank + 1) * cand.mesh.size))
        t = exact.times[s]
        stages.append(StagePlan(
            index=s, pp_rank=rank, layers=[l.name for l in prog.layers[a:b]],
            nodes=[op for l in prog.layers[a:b] for op in l.ops], ranks=ranks,
            inputs=inputs, outputs=outputs, checkpoint=list(r.checkpointed),
            zero_stage=cand.mesh.zero_stage, zero_axis=0 if cand.mesh.zero_stage else None,
            predicted={"forward_s": t.forward_s + action,
                       "backward_input_s": t.backward_input_s + action,
                       "backward_weight_s": t.backward_weight_s + split_s[s],
                       "grad_sync_s": t.grad_sync_s,
                       "update_s": t.update_s,
                       "accumulate_s": t.accumulation_s(cand.num_microbatches),
                       "in_flight_microbatches": exact.copies[s],
                       "memory_bytes_per_device": part.predicted["memory_bytes_per_device"]}))
    first = parts[0]
    plan = Plan(
        model={**first.model, "fingerprint": prog.graph.fingerprint()},
        cluster=ctx.settings.cluster.to_dict(),
        mesh={"shape": [cand.pp] + mesh_shape,
              "axis_names": ["pp"] + [f"mesh{i}" for i in range(len(mesh_shape))]},
        parameters={k: v for p in parts for k, v in p.parameters.items()},
        inputs={k: v for k, v in first.inputs.items() if prog.graph[k].kind == INPUT},
        nodes={k: v for p in parts for k, v in p.nodes.items()},
        reshards=[r for p in parts for r in p.reshards],
        predicted=_predicted(exact, parts, ctx),
        solver=_solver_report(parts),
        training={**first.training, "microbatch_size": ctx.global_batch // cand.num_microbatches,
                  "global_batch": ctx.global_batch},
        checkpoint=[c for p in parts for c in p.checkpoint],
        pipeline=PipelinePlan(schedule=cand.schedule, num_microbatches=cand.num_microbatches,
                              stages_per_rank=cand.stages_per_rank,
                              stage_mesh={"shape": mesh_shape,
                                          "axis_names": [f"mesh{i}" for i in range(len(mesh_shape))]},
                              stages=stages))
    assert plan.world_size == world
    return plan


def _predicted(exact: ExactPipeline, parts: list[Plan], ctx: SearchContext) -> dict[str, Any]:
    m = exact.candidate.num_microbatches
    v = exact.candidate.stages_per_rank
    pp = exact.candidate.pp
    # memory per device: the stages of the fullest rank
    s2r = schedule_spec(exact.candidate.schedule).stage_to_rank(pp, v)
    per_rank: dict[int, dict[str, int]] = {}
    for s, p in enumerate(parts):
        acc = per_rank.setdefault(s2r[s], {})
        for k, val in p.predicted["memory_bytes_per_device"].items():
            acc[k] = acc.get(k, 0) + int(val)
    memory = dict(max(per_rank.values(), key=lambda d: d.get("total", 0)))
    memory["peak"] = max(d["peak"] for d in per_rank.values())  # the fullest rank's peak
    busiest = max(range(pp), key=lambda r: sum(
        exact.times[s].microbatch_s for s in range(len(parts)) if s2r[s] == r))
    mine = [s for s in range(len(parts)) if s2r[s] == busiest]
    return {
        "step_time_s": exact.step_time_s,
        # the stage plans price one micro-batch and the step's optimizer update
        "compute_s": sum(m * (parts[s].predicted["compute_s"] - exact.times[s].update_s)
                         + exact.times[s].update_s for s in mine),
        # per micro-batch collectives; the once-per-step ones are grad_sync_s
        "communication_s": m * sum(parts[s].predicted["communication_s"]
                                   - ctx.pricing.step_collectives_of(exact.results[s],
                                                             exact.candidate.mesh)
                                   for s in mine),
        "resharding_s": m * sum(parts[s].predicted["resharding_s"] for s in mine),
        "bubble_s": exact.bubble_s,
        "p2p_s": sum(exact.p2p),
        "grad_sync_s": max(t.grad_sync_s for t in exact.times),
        "update_s": max(t.update_s for t in exact.times),
        "accumulate_s": max(t.accumulation_s(m) for t in exact.times),
        "memory_bytes_per_device": memory,
    }


def _solver_report(parts: list[Plan]) -> SolverReport:
    reports = [p.solver for p in parts]
    statuses = sorted({r.status for r in reports})
    return SolverReport(
        solver=reports[0].solver, status="/".join(statuses),
        objective_s=sum(r.objective_s for r in reports), bound_s=sum(r.bound_s for r in reports),
        gap=max(r.gap for r in reports), time_limit_s=reports[0].time_limit_s,
        num_variables=sum(r.num_variables for r in reports),
        num_constraints=sum(r.num_constraints for r in reports))
