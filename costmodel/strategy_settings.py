"""The settings every part of :class:`costmodel.strategy_cost.IntraOpCost` prices with.

:class:`StrategySettings` names them once, with their meaning; the parts
(:mod:`costmodel.strategy_compute`, :mod:`costmodel.strategy_sync`,
:mod:`costmodel.strategy_memory`) read them, and ``IntraOpCost``'s
constructor sets them from its arguments.
"""

from __future__ import annotations

from costmodel.cluster import Cluster, Link
from ir.graph import Graph
from ir.precision import Precision
from ir.strategy import Strategy

__all__ = ["StrategySettings"]


class StrategySettings:
    """What the prices of one graph on one mesh of one cluster depend on."""

    # the program priced, the cluster, the logical mesh and each mesh axis's link
    graph: Graph
    cluster: Cluster
    mesh_shape: tuple[int, ...]
    links: list[Link]
    # each link as DTensor's redistribute sees it (Link.for_redistribute)
    redistribute_links: list[Link]
    # the training precision, its compute dtype's name, and the optimizer's name
    precision: Precision
    dtype: str
    optimizer: str
    # the ZeRO stage; the ranks the parameter states are sharded over (mesh axis
    # 0 under ZeRO); whether the master parameters are stored sharded (FSDP2)
    zero_stage: int
    state_shards: int
    params_sharded: bool
    # the parameters whose whole copy and gradient count toward the peak (None: all)
    gathered_params: frozenset[str] | None
    # bytes of a reduced gradient element, and of a gathered parameter element
    # once per step, over a compute-dtype one
    reduce_scale: float
    gather_scale: float
    # micro-batches whose saved activations are alive at once
    activation_copies: float
    # the values a gradient flows back to; parameters and the views of them
    requires_grad: frozenset[str]
    param_derived: frozenset[str]
    # node -> indices of its outputs autograd keeps for backward
    saved: dict[str, frozenset[int]]
    # the op whose backward transient counts toward the peak
    transient_node: str | None
    # op -> its share (bytes, kernels, elements) of its fused chain when the program runs
    # compiled (costmodel.fusion.fused_shares); empty when it runs eagerly
    fused_shares: dict[str, tuple[float, float, float]]
    # ops a compiled program runs eagerly (ZeRO-3: those between its units)
    eager_ops: frozenset[str]

    @property
    def step_sync_ranks(self) -> int:
        """Ranks whose gradient sums on mesh axis 0 wait for the end of the
        step (every stage reduces them once per step): axis 0's size."""
        return self.mesh_shape[0]

    def shard_factor(self, s: Strategy) -> int:
        """Devices one op instance is split over under strategy ``s``."""
        f = 1
        for split, size in zip(s.split_axes, self.mesh_shape):
            if split:
                f *= size
        return f
