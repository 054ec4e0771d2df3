"""Per-strategy prices: what each sharding strategy of each op costs on one mesh.

:class:`IntraOpCost` prices one traced program on one logical mesh of one
cluster, strategy by strategy: the seconds of an op's forward and backward
compute (:mod:`costmodel.strategy_compute`), of the collectives its strategy
implies (gradient all-reduces over the axes its inputs are replicated on,
ZeRO's once-per-step reduce-scatter/all-gather: :mod:`costmodel.strategy_sync`),
of resharding along each edge, and its bytes per device by kind (parameters,
gradients, optimizer states, activations: :mod:`costmodel.strategy_memory`).
This module holds the ZeRO stages, sets the settings those parts read
(:mod:`costmodel.strategy_settings`) from the constructor's arguments, and
keeps the caches: the prices of each (node, strategy) pair and the shared
resharding pricer. The intra-op solver (:mod:`planner.ilp.intra_op`) turns these prices
into its ILP.

Units: seconds, bytes. Costs are of one training step (forward, backward and
gradient synchronisation) on one device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

from costmodel.cluster import Cluster
from costmodel.collectives import axis_links
from costmodel.fusion import fused_shares
from costmodel.resharding import ReshardPricer
from costmodel.saved_tensors import saved_outputs
from costmodel.strategy_compute import ComputePricing
from costmodel.strategy_memory import MemoryPricing
from costmodel.strategy_sync import GradientSyncPricing
from ir.graph import OP, PARAM, Graph, Node, TensorInfo
from ir.precision import get_precision
from ir.shard_units import ShardUnit, shard_units
from ir.strategy import Placements, Strategy

__all__ = ["CostBreakdown", "FSDP_STAGES", "IntraOpCost", "NodePrices", "ZERO_STAGES",
           "zero3_param_sets"]


# ZeRO stages the cost model prices (IntraOpCost's zero_stage).
ZERO_STAGES = (0, 1, 2, 3)

# ZeRO stages a pipeline stage runs with FSDP2 ``fully_shard`` over mesh axis 0
# (codegen.pipeline): FSDP2 stores the parameters sharded at both, so the
# stage's parameters must be replicated on that axis. Stage 2 shards the whole
# stage module as one unit; stage 3 each layer as a unit of its own too
# (codegen.zero3_units).
FSDP_STAGES = (2, 3)

# Units whose parameters FSDP2 holds gathered at once under ZeRO-3: the one
# computing and the next, prefetched (its default prefetch depth of one); their
# gradients likewise: the unit's own and the previous one's in reduce-scatter.
ZERO3_UNITS_GATHERED = 2


def zero3_param_sets(graph: Graph, units: Sequence[ShardUnit] | None = None
                     ) -> tuple[frozenset[str], frozenset[str]]:
    """Under ZeRO-3, the parameter nodes of ``graph`` (one stage) that FSDP2
    keeps gathered for a whole forward and backward, and those whose whole
    copy and gradient count toward the step's peak.

    The first: those in none of the units :func:`ir.shard_units.shard_units`
    finds (read across units, such as a tied embedding and head), which the
    stage's own unit holds. The second: those and the parameters of the
    :data:`ZERO3_UNITS_GATHERED` consecutive units (in program order, the
    order FSDP2 gathers them, forward and backward) that hold the most bytes
    (the first such run on ties). ``units``: ``shard_units(graph)``, where
    the caller has them."""
    units = shard_units(graph) if units is None else units
    in_units = {p for u in units for p in u.params}
    whole_pass = frozenset(n.name for n in graph.nodes
                           if n.kind == PARAM and n.name not in in_units)
    k = min(ZERO3_UNITS_GATHERED, len(units))
    runs = [units[i: i + k] for i in range(len(units) - k + 1)]
    largest = max(runs, key=lambda run: sum(graph[p].output.nbytes for u in run
                                            for p in u.params), default=[])
    return whole_pass, whole_pass.union(*(u.params for u in largest))


@dataclass
class CostBreakdown:
    """Predicted seconds of one training step on one device, by kind."""

    compute_s: float = 0.0
    communication_s: float = 0.0
    resharding_s: float = 0.0

    @property
    def total_s(self) -> float:
        return self.compute_s + self.communication_s + self.resharding_s


@dataclass(frozen=True)
class NodePrices:
    """What one node costs under one strategy (:meth:`IntraOpCost.prices`):
    seconds of :meth:`IntraOpCost.compute`, of its forward alone, of its
    backward (input gradient, weight gradient), of its gradient collectives,
    and bytes per device by kind (:meth:`IntraOpCost.memory_breakdown`)."""

    compute_s: float
    forward_s: float
    backward_s: tuple[float, float]
    collectives_s: float
    memory: Mapping[str, float]


class IntraOpCost(ComputePricing, GradientSyncPricing, MemoryPricing):
    """Prices strategies and edges of one graph on one mesh of one cluster (seconds).

    Its parts price a node under a strategy: :class:`ComputePricing` its
    kernels, :class:`GradientSyncPricing` its gradient collectives,
    :class:`MemoryPricing` its bytes; this class holds the settings they read
    and the caches (:meth:`prices`, the shared :class:`ReshardPricer` of the
    edges).

    ``zero_stage``: how the parameter states and gradient sums use mesh axis 0
    (the data-parallel axis; parameters replicated on it):

    * 0: every device holds whole states; the gradient sums on axis 0
      accumulate over the step's micro-batches and are all-reduced once, at
      its end, in buckets (:mod:`codegen.grad_reduction`, as Megatron's and
      torch's DDP reduce them);
    * 1: the optimizer states are sharded over axis 0; the gradient sums on
      it wait for the end of the step, are reduce-scattered once and the
      updated parameters all-gathered once (Megatron's distributed optimizer);
    * 2: FSDP2 ``fully_shard(reshard_after_forward=False)`` with the whole
      stage as one unit: optimizer states and gradients sharded over axis 0,
      the parameters not re-sharded between forward and backward. FSDP2
      stores the fp32 master parameters sharded too, all-gathers them whole
      in the compute dtype at the first forward and keeps them until the last
      backward (torch's pipeline stage asks FSDP2 not to reshard after a
      backward that is not the step's last); the gradient sums are
      reduce-scattered once per step;
    * 3: FSDP2 ``fully_shard`` unit by unit (:mod:`codegen.zero3_units`):
      parameters, gradients and optimizer states sharded over axis 0; whole,
      at the peak, the parameters and gradients of :attr:`gathered_params`
      only. Every micro-batch all-gathers the parameters in its forward and
      again in its backward, and reduce-scatters the gradients
      (:meth:`zero3_layer_collectives`; the ILP weighs the step's collectives
      once, as for the other stages).

    The properties these differ by (:attr:`state_shards`,
    :attr:`params_sharded`, :attr:`step_sync_ranks`) set the prices.
    """

    def __init__(self, graph: Graph, cluster: Cluster, mesh_shape: Sequence[int], dtype: str,
                 optimizer: str = "adam", activation_copies: float = 1.0,
                 pricer: ReshardPricer | None = None, zero_stage: int = 0,
                 step_share: float = 1.0,
                 units_gathered: bool = True):
        """``dtype``: the training precision's name (:func:`ir.precision.get_precision`;
        a plain dtype name too). ``optimizer``: its name
        (:data:`costmodel.memory.OPTIMIZER_ACCESSES`). ``activation_copies``:
        micro-batches whose saved activations are alive at once (a pipeline's
        in-flight ones). ``pricer``: a :class:`ReshardPricer` of this mesh and
        cluster to share (its prices are memoised, so graphs priced on the same
        mesh one after another reuse them); a new one when None.
        ``zero_stage``: see the class.

        ``units_gathered`` (ZeRO-3): False prices ``graph`` as one layer of a
        stage that holds other units too (a layer profile of the pipeline
        search): its units' parameters and gradients as shards alone, the
        units gathered at the peak being the stage's to count.

        ``step_share``: what the once-per-step seconds of a parameter node
        (the optimizer update and casts, ZeRO's collectives) weigh against
        one micro-batch's seconds in the intra-op ILP's objective, ``1/m``
        for a stage that runs ``m`` micro-batches a step: the objective is
        then the stage's step over ``m``, and a layout that saves one
        gradient sync per step by gathering parameters in every micro-batch
        pays for all ``m`` gathers. The prices themselves stay in seconds.
        """
        if not 0.0 < step_share <= 1.0:
            raise ValueError(f"step_share must be in (0, 1], got {step_share!r}")
        self.step_share = float(step_share)
        if zero_stage not in ZERO_STAGES:
            raise ValueError(f"zero_stage must be one of {ZERO_STAGES}, got {zero_stage!r}")
        self.graph = graph
        self._set_zero(zero_stage, mesh_shape, units_gathered)
        # micro-batches whose saved activations are alive at once (pipeline in-flight)
        self.activation_copies = float(activation_copies)
        self.optimizer = optimizer
        self.cluster = cluster
        self.mesh_shape = tuple(int(d) for d in mesh_shape)
        self.links = axis_links(cluster, self.mesh_shape)
        self.redistribute_links = [link.for_redistribute() for link in self.links]
        self._set_precision(dtype)
        # seconds of ZeRO's once-per-step collectives of one byte: their per-message latency
        self._zero_latency = self.zero_collectives(1.0)
        self.requires_grad = graph.gradient_path
        self.param_derived = graph.parameter_views
        # node -> indices of its outputs autograd keeps for backward
        self.saved = saved_outputs(graph, self.requires_grad)
        self.transient_node = self._largest_transient()
        self.fused_shares = fused_shares(graph, self.eager_ops) if cluster.device.compiled else {}
        self._pricer = self._own_pricer(pricer)
        # NodePrices of the (node, strategy) pairs asked for by prices()
        self._prices: dict[tuple[str, int], tuple[Strategy, NodePrices]] = {}

    def _set_zero(self, zero_stage: int, mesh_shape: Sequence[int], units_gathered: bool) -> None:
        """The settings that follow from the ZeRO stage (see the class)."""
        self.zero_stage = zero_stage
        # ranks the parameter states are sharded over (mesh axis 0 under ZeRO)
        self.state_shards = int(mesh_shape[0]) if zero_stage else 1
        # whether the master parameters are stored sharded over axis 0 (FSDP2),
        # gathered whole in the compute dtype for the step
        self.params_sharded = zero_stage in FSDP_STAGES
        # ZeRO-3: the parameters gathered for the whole pass, not unit by unit
        self.pass_params: frozenset[str] = frozenset()
        # the parameters whose whole copy and gradient count toward the peak:
        # all (None) under ZeRO-2, whose stage is one FSDP2 unit; under ZeRO-3
        # those FSDP2 keeps gathered at once (zero3_param_sets)
        self.gathered_params: frozenset[str] | None = None
        # compiled regions a pass of the stage calls: one, or under ZeRO-3 one
        # per unit (codegen.executor compiles each unit inside its FSDP2 hooks)
        self.compiled_regions = 1
        # ops a compiled stage runs eagerly: under ZeRO-3 those between its units
        self.eager_ops: frozenset[str] = frozenset()
        # ZeRO-3's collective calls a micro-batch, (forward, backward): each unit's
        # all-gather; its all-gather again and reduce-scatter (and the stage's own
        # unit, holding the parameters outside them: one of each)
        self.zero3_calls = (0, 0)
        if zero_stage == 3:
            units = shard_units(self.graph)
            self.pass_params, at_peak = zero3_param_sets(self.graph, units)
            self.gathered_params = at_peak if units_gathered else self.pass_params
            self.compiled_regions = max(1, len(units))
            own = int(bool(self.pass_params))
            self.zero3_calls = (len(units) + own, 2 * len(units) + own)
            inside = {op for unit in units for op in unit.ops}
            self.eager_ops = frozenset(n.name for n in self.graph.nodes
                                       if n.kind == OP and n.name not in inside)

    def region_calls(self, checkpointed: Sequence[str]) -> tuple[int, int]:
        """Compiled calls (dynamo frames entered) in one pass of a compiled
        stage whose layers ``checkpointed`` are checkpointed: ``(forward,
        backward)``. On one device the checkpoints trace into the program's one
        region. On a mesh each such layer is a region of its own, run inside an
        eager checkpoint the program's compile leaves out
        (:class:`codegen.program_code.CheckpointedLayer`): the layer's call
        enters three frames in the forward (the layer module's, whose body
        breaks; its region's; the program's again, resumed after it) and its
        region once more for the recomputation in the backward (ZeRO-3: its
        unit's region, called again)."""
        if self.zero_stage == 3:
            return self.compiled_regions, len(checkpointed)
        if math.prod(self.mesh_shape) > 1:
            return self.compiled_regions + 3 * len(checkpointed), len(checkpointed)
        return self.compiled_regions, 0

    def _set_precision(self, dtype: str) -> None:
        """The training precision ``dtype`` names, and the byte ratios of the
        gradient collectives under it."""
        self.precision = get_precision(dtype)
        self.dtype = self.precision.compute_dtype_name
        # bytes of a reduced gradient element over a compute-dtype one (fp32 sums of
        # bf16 gradients under bf16-mixed: 2)
        self.reduce_scale = self.precision.reduce_dtype.itemsize / self.precision.compute_dtype.itemsize
        # once per step, the parameters are all-gathered in the compute dtype after
        # ZeRO's update; DDP's all-reduce is all in the reduce dtype
        self.gather_scale = 1.0 if self.zero_stage else self.reduce_scale

    def _own_pricer(self, pricer: ReshardPricer | None) -> ReshardPricer:
        """``pricer``, checked to be of this mesh and links, or a new one."""
        if pricer is None:
            return ReshardPricer(self.mesh_shape, self.links)
        if pricer.mesh_shape != self.mesh_shape or pricer.links != self.links:
            raise ValueError(f"the shared pricer is for mesh {pricer.mesh_shape} and other "
                             f"links; this cost is for mesh {self.mesh_shape}")
        return pricer

    def prices(self, node: Node, s: Strategy) -> NodePrices:
        """:class:`NodePrices` of ``node`` under ``s``, made once per pair: the
        solutions of one problem (its memory levels, and the stage times of
        each) price mostly the same chosen strategies."""
        key = (node.name, id(s))
        known = self._prices.get(key)
        if known is not None and known[0] is s:
            return known[1]
        forward = self.forward_time(node, s)
        b, w = self.backward_times(node, s)
        # as compute() adds them
        compute = forward + b + w if node.kind == OP else self.compute(node, s)
        prices = NodePrices(compute, forward, (b, w), self.backward_collectives(node, s),
                            self.memory_breakdown(node, s))
        self._prices[key] = (s, prices)
        return prices

    def spec_id(self, placements: Placements) -> int:
        """A small int naming ``placements`` (equal placements, equal ids), so that
        prices are cached under int keys instead of hashing Placement objects."""
        return self._pricer.spec_id(placements)

    def reshard(self, src: Placements, dst: Placements, info: TensorInfo) -> float:
        """Seconds to redistribute ``info`` from ``src`` to ``dst`` placements."""
        if src == dst:
            return 0.0
        return self._pricer.time(src, dst, info.shape, info.itemsize)

    def edge(self, producer_out: Placements, consumer_in: Placements, info: TensorInfo,
             requires_grad: bool) -> float:
        """Seconds of an edge: forward reshard of ``info`` from the producer's output
        placements into the consumer's input placements, plus (``requires_grad``)
        the reverse reshard of its gradient."""
        return self.edge_seconds((self.spec_id(producer_out),), (self.spec_id(consumer_in),),
                                 info, requires_grad)[0][0]

    def gradient_reshard(self, src: Placements, dst: Placements, info: TensorInfo,
                         weight: bool = False) -> float:
        """Seconds of an edge's gradient reshard, from the consumer's input
        placements ``dst`` back to the producer's output placements ``src``
        (:meth:`ReshardPricer.gradient_seconds`): for a ``weight`` gathered on
        mesh axis 0 for its use, the reduce-scatter of its gradient in each
        micro-batch (:func:`costmodel.resharding.weight_gradient_placements`)."""
        return self._pricer.gradient_seconds(self.spec_id(src), self.spec_id(dst), info.shape,
                                             info.itemsize, weight)

    @property
    def edge_matrices(self) -> dict[tuple, tuple]:
        """Edge matrices of strategy lists priced on this mesh
        (:func:`_edge_matrix`), kept by the shared :class:`ReshardPricer`."""
        return self._pricer.memo("edge_matrices")

    def edge_seconds(self, srcs: tuple[int, ...], dsts: tuple[int, ...], info: TensorInfo,
                     requires_grad: bool, weight: bool = False) -> tuple[tuple[float, ...], ...]:
        """:meth:`edge` for every (producer output, consumer input) pair of
        placements given by :meth:`spec_id`: seconds, ``[i][j]`` for ``srcs[i]``
        and ``dsts[j]`` (memoised by the mesh's :class:`ReshardPricer`,
        :meth:`ReshardPricer.edge_seconds`)."""
        return self._pricer.edge_seconds(srcs, dsts, info.shape, info.itemsize, requires_grad,
                                         weight)
