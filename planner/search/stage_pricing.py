"""How one search prices a stage (:class:`StagePricing`): its intra-op
problem on a stage mesh (DTensor's strategies, pinned as the search's layout
pins them), the resharding pricer each stage mesh shares, and the times of a
solved stage.

Units: seconds, bytes.
"""

from __future__ import annotations

from torch.distributed.tensor.placement_types import Replicate

from costmodel.collectives import axis_links
from costmodel.memory import training_state_bytes
from costmodel.resharding import ReshardPricer
from costmodel.strategy_cost import FSDP_STAGES, IntraOpCost, zero3_param_sets
from ir.graph import PARAM, Graph
from planner.ilp.intra_op import IntraOpResult, PreparedIntraOp, prepare_intra_op
from planner.ilp.strategies import NodeStrategies, build_strategies
from planner.search.cp_search import pinned_strategies
from planner.search.microbatch_programs import MicrobatchProgram
from planner.search.search_caches import SearchCaches
from planner.search.settings import SearchSettings
from planner.search.stage_dp import StageMeshOption, stage_times, step_collectives
from planner.search.stage_times import StageTimes

__all__ = ["StagePricing"]


class StagePricing:
    """The pricing of one search's stages, by its ``settings``, filling its
    ``caches`` (strategies, expansions, pricers); ``global_batch``: the
    search's batch."""

    def __init__(self, settings: SearchSettings, caches: SearchCaches, global_batch: int):
        self.settings = settings
        self.caches = caches
        self.global_batch = global_batch

    def prepare(self, sub: Graph, prog: MicrobatchProgram, mesh: StageMeshOption,
                copies: float, profile: bool = False) -> PreparedIntraOp:
        """The priced intra-op problem of ``sub``, a stage of the captured
        program ``prog`` (strategies come from its fake tensors), on ``mesh``;
        ``profile``: of one layer's profile, whose ZeRO-3 units count as
        shards (the stage DP keeps :meth:`zero3_headroom` for those gathered)."""
        settings = self.settings
        strategies = build_strategies(sub, mesh.shape,
                                      self.caches.strategies.setdefault(mesh.shape, {}),
                                      self.caches.expansions)
        if mesh.zero_stage in FSDP_STAGES:  # FSDP2 shards parameters replicated on axis 0
            strategies = [ns if ns.node.kind != PARAM else NodeStrategies(
                ns.node, [s for s in ns.strategies if isinstance(s.outputs[0][0], Replicate)],
                ns.fallback) for ns in strategies]
        if settings.context_parallel > 1:
            strategies = pinned_strategies(strategies, prog.microbatch_size)
        return prepare_intra_op(sub, mesh.cluster(settings.cluster), mesh.shape,
                                dtype=settings.dtype, optimizer=settings.optimizer,
                                fixed=settings.fixed or None, activation_copies=copies,
                                strategies=strategies, pricer=self.pricer(mesh),
                                zero_stage=mesh.zero_stage,
                                step_share=self.step_share(prog), units_gathered=not profile)

    def zero3_headroom(self, prog: MicrobatchProgram, mesh: StageMeshOption) -> float:
        """Bytes per device a ZeRO-3 stage on ``mesh`` holds beyond its layers'
        profiles (which count its units as shards): the whole parameters and
        gradients FSDP2 holds gathered at once
        (:func:`costmodel.strategy_cost.zero3_param_sets` of the whole
        program, unsharded on the other mesh axes: an upper bound). 0 for
        other stages."""
        if mesh.zero_stage != 3 or mesh.shape[0] == 1:
            return 0.0
        numel = sum(prog.graph[p].output.numel for p in zero3_param_sets(prog.graph)[1])
        state = {gathered: training_state_bytes(numel, precision=self.settings.dtype,
                                                optimizer=self.settings.optimizer,
                                                zero_stage=3, dp_size=int(mesh.shape[0]),
                                                gathered=gathered)
                 for gathered in (True, False)}
        return float(state[True]["total"] - state[False]["total"])

    def step_share(self, prog: MicrobatchProgram) -> float:
        """The weight of once-per-step seconds against one micro-batch's in the
        ILPs of ``prog``'s stages (:class:`IntraOpCost`): one over the
        micro-batches of a step."""
        return prog.microbatch_size / self.global_batch

    def pricer(self, mesh: StageMeshOption) -> ReshardPricer:
        """The resharding pricer every problem on ``mesh`` shares."""
        key = (mesh.shape, mesh.num_nodes, mesh.devices_per_node)
        pricers = self.caches.pricers
        if key not in pricers:
            pricers[key] = ReshardPricer(
                mesh.shape, axis_links(mesh.cluster(self.settings.cluster), mesh.shape))
        return pricers[key]

    def times_of(self, result: IntraOpResult, mesh: StageMeshOption,
                 cost: IntraOpCost | None = None) -> StageTimes:
        """:func:`stage_times` of a stage on ``mesh`` (with its ZeRO stage);
        ``cost``: the one ``result`` was solved with, to share."""
        settings = self.settings
        return stage_times(result, mesh.cluster(settings.cluster), settings.dtype,
                           settings.optimizer, cost=cost or self._stage_cost(result, mesh))

    def step_collectives_of(self, result: IntraOpResult, mesh: StageMeshOption) -> float:
        """:func:`planner.search.stage_dp.step_collectives` of a stage solved on ``mesh``."""
        return step_collectives(result, self._stage_cost(result, mesh))

    def _stage_cost(self, result: IntraOpResult, mesh: StageMeshOption) -> IntraOpCost:
        """An :class:`IntraOpCost` pricing ``result``'s graph as its stage on
        ``mesh`` is priced (its ZeRO stage, gradient reduction and pricer)."""
        settings = self.settings
        return IntraOpCost(result.graph, mesh.cluster(settings.cluster), result.mesh_shape,
                           settings.dtype, settings.optimizer, zero_stage=mesh.zero_stage,
                           pricer=self.pricer(mesh))
