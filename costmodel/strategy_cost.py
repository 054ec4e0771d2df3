"""Per-strategy prices: what each sharding strategy of each op costs on one mesh.

:class:`IntraOpCost` prices one traced program on one logical mesh of one
cluster, strategy by strategy: the seconds of an op's forward and backward
compute, of the collectives its strategy implies (gradient all-reduces over
the axes its inputs are replicated on, ZeRO's once-per-step
reduce-scatter/all-gather), of resharding along each edge, and its bytes per
device by kind (parameters, gradients, optimizer states, activations). The
intra-op solver (:mod:`planner.ilp.intra_op`) turns these prices into its ILP.

Units: seconds, bytes. Costs are of one training step (forward, backward and
gradient synchronisation) on one device.

Gradient communication is not overlapped with backward: the code generator
reduces gradients after backward, so the model charges it in full.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from torch.distributed.tensor.placement_types import Partial, Placement, Replicate

from costmodel.cluster import Cluster
from costmodel.collectives import axis_links, collective_time
from costmodel.compute import (FUSED_ATTENTION, attention_times, backward_kernels,
                               backward_op_times, gemm_aligned, op_time)
from costmodel.memory import (OPTIMIZER_ACCESSES, backward_timeline_excess, step_copy_bytes,
                              training_state_bytes)
from costmodel.resharding import ReshardPricer
from costmodel.saved_tensors import extra_saved_bytes, release_points, saved_outputs
from ir.graph import INPUT, OP, PARAM, Graph, Node, TensorInfo
from ir.precision import get_precision
from ir.repeated_blocks import shard_units
from ir.strategy import Placements, Strategy, is_shard

__all__ = ["CostBreakdown", "FSDP_STAGES", "IntraOpCost", "NodePrices", "ZERO_STAGES",
           "local_numel"]


def local_numel(info: TensorInfo, placements: Sequence[Placement], mesh_shape: Sequence[int],
                skip_axis: int | None = None) -> float:
    """Elements of ``info`` held by one device (ignoring mesh axis ``skip_axis``)."""
    n = float(info.numel)
    for a, (p, size) in enumerate(zip(placements, mesh_shape)):
        if a != skip_axis and is_shard(p):
            n /= size
    return n


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


def zero3_param_sets(graph: Graph) -> tuple[frozenset[str], frozenset[str]]:
    """Under ZeRO-3, the parameter nodes of ``graph`` (one stage) that FSDP2
    keeps gathered for a whole forward and backward, and those whose whole
    copy and gradient count toward the step's peak.

    The first: those in none of the units :func:`ir.repeated_blocks.shard_units`
    finds (read across units, such as a tied embedding and head), which the
    stage's own unit holds. The second: those and the parameters of the
    :data:`ZERO3_UNITS_GATHERED` consecutive units (in program order, the
    order FSDP2 gathers them, forward and backward) that hold the most bytes
    (the first such run on ties)."""
    units = shard_units(graph)
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
    bytes per device by kind (:meth:`IntraOpCost.memory_breakdown`), and the
    part of its collectives that all-reduces weight gradients over mesh axis 0
    in each micro-batch (what ZeRO or ``reduce_once`` does once per step)."""

    compute_s: float
    forward_s: float
    backward_s: tuple[float, float]
    collectives_s: float
    memory: Mapping[str, float]
    weight_sync_s: float = 0.0


class IntraOpCost:
    """Prices strategies and edges of one graph on one mesh of one cluster (seconds)."""

    def __init__(self, graph: Graph, cluster: Cluster, mesh_shape: Sequence[int], dtype: str,
                 optimizer: str = "adam", activation_copies: float = 1.0,
                 pricer: ReshardPricer | None = None, zero_stage: int = 0,
                 reduce_once: bool = False, step_share: float = 1.0,
                 units_gathered: bool = True):
        """``pricer``: a :class:`ReshardPricer` of this mesh and cluster to share
        (its prices are memoised, so graphs priced on the same mesh one after
        another reuse them); a new one when None. ``zero_stage``: how the
        parameter states and gradient sums use mesh axis 0 (the data-parallel
        axis; parameters replicated on it):

        * 0: every device holds whole states; the gradients are all-reduced in
          each micro-batch's backward (DTensor's Partial -> Replicate);
        * 1: the optimizer states are sharded over axis 0; the gradient sums
          on it wait for the end of the step, are reduce-scattered once and
          the updated parameters all-gathered once (Megatron's distributed
          optimizer);
        * 2: FSDP2 ``fully_shard(reshard_after_forward=False)`` with the whole
          stage as one unit: optimizer states and gradients sharded over axis
          0, the parameters not re-sharded between forward and backward. FSDP2
          stores the fp32 master parameters sharded too, all-gathers them
          whole in the compute dtype at the first forward and keeps them until
          the last backward (torch's pipeline stage asks FSDP2 not to reshard
          after a backward that is not the step's last); the gradient sums
          are reduce-scattered once per step;
        * 3: FSDP2 ``fully_shard`` unit by unit (:mod:`codegen.zero3_units`):
          parameters, gradients and optimizer states sharded over axis 0;
          whole, at the peak, the parameters and gradients of
          :attr:`gathered_params` only. Every micro-batch all-gathers the
          parameters in its forward and again in its backward, and
          reduce-scatters the gradients
          (:meth:`zero3_layer_collectives`; the ILP weighs the step's
          collectives once, as for the other stages).

        The properties these differ by (:attr:`state_shards`,
        :attr:`params_sharded`, :attr:`step_sync_ranks`) set the prices.

        ``reduce_once`` (with ``zero_stage`` 0): whole states, but the gradient
        sums on axis 0 accumulate over the micro-batches and are all-reduced
        once per step (Megatron's DDP; torch DDP under ``no_sync``), priced as
        the reduce-scatter and all-gather a ring all-reduce is made of.

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
        if zero_stage == 3:
            self.pass_params, at_peak = zero3_param_sets(graph)
            self.gathered_params = at_peak if units_gathered else self.pass_params
        # ranks whose gradient sums on mesh axis 0 wait for the end of the step
        self.step_sync_ranks = int(mesh_shape[0]) if zero_stage or reduce_once else 1
        # micro-batches whose saved activations are alive at once (pipeline in-flight)
        self.activation_copies = float(activation_copies)
        self.optimizer = optimizer
        self.cluster = cluster
        self.mesh_shape = tuple(int(d) for d in mesh_shape)
        self.links = axis_links(cluster, self.mesh_shape)
        # the training precision (``dtype`` names it; older callers pass a dtype name)
        self.precision = get_precision(dtype)
        self.dtype = self.precision.compute_dtype_name
        # bytes of a reduced gradient element over a compute-dtype one (fp32 sums of
        # bf16 gradients under bf16-mixed: 2)
        self.reduce_scale = self.precision.reduce_dtype.itemsize / self.precision.compute_dtype.itemsize
        # once per step, the parameters are all-gathered in the compute dtype after
        # ZeRO's update; DDP's all-reduce is all in the reduce dtype
        self.gather_scale = 1.0 if zero_stage else self.reduce_scale
        # seconds of ZeRO's once-per-step collectives of one byte: their per-message latency
        self._zero_latency = self.zero_collectives(1.0)
        self.requires_grad = graph.gradient_path
        self.param_derived = graph.parameter_views
        # node -> indices of its outputs autograd keeps for backward
        self.saved = saved_outputs(graph, self.requires_grad)
        self.transient_node = self._largest_transient()
        if pricer is None:
            pricer = ReshardPricer(self.mesh_shape, self.links)
        elif pricer.mesh_shape != self.mesh_shape or pricer.links != self.links:
            raise ValueError(f"the shared pricer is for mesh {pricer.mesh_shape} and other "
                             f"links; this cost is for mesh {self.mesh_shape}")
        self._pricer = pricer
        # NodePrices of the (node, strategy) pairs asked for by prices()
        self._prices: dict[tuple[str, int], tuple[Strategy, NodePrices]] = {}

    def spec_id(self, placements: Placements) -> int:
        """A small int naming ``placements`` (equal placements, equal ids), so that
        prices are cached under int keys instead of hashing Placement objects."""
        return self._pricer.spec_id(placements)

    def reshard(self, src: Placements, dst: Placements, info: TensorInfo) -> float:
        """Seconds to redistribute ``info`` from ``src`` to ``dst`` placements."""
        if src == dst:
            return 0.0
        return self._pricer.time(src, dst, info.shape, info.itemsize)

    def shard_factor(self, s: Strategy) -> int:
        """Devices one op instance is split over under strategy ``s``."""
        f = 1
        for split, size in zip(s.split_axes, self.mesh_shape):
            if split:
                f *= size
        return f

    def compute(self, node: Node, s: Strategy) -> float:
        """Seconds of the node's forward and backward on one device."""
        if node.kind == INPUT:  # each device loads its part of the batch into memory
            local = local_numel(node.output, s.outputs[0], self.mesh_shape) * node.output.itemsize
            return local / self.cluster.device.memory_bandwidth
        if node.kind == PARAM:
            return self.cast_time(node, s) + self.optimizer_time(node, s)
        if node.kind != OP:
            return 0.0
        b, w = self.backward_times(node, s)
        return self.forward_time(node, s) + b + w

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
        weight_sync = sum(t for arg, a, t in self._gradient_all_reduces(node, s)
                          if a == 0 and arg in self.param_derived)
        prices = NodePrices(compute, forward, (b, w), self.backward_collectives(node, s),
                            self.memory_breakdown(node, s), weight_sync)
        self._prices[key] = (s, prices)
        return prices

    def compute_each(self, node: Node, strategies: Sequence[Strategy]) -> list[float]:
        """:meth:`compute` of ``node`` under each of ``strategies``: an op's
        depends on its strategy only through :meth:`shard_factor`, so each
        factor is priced once (a layer's ops have tens of strategies and a
        few factors)."""
        return self._per_shard_factor(node, strategies, self.compute)

    def forward_each(self, node: Node, strategies: Sequence[Strategy]) -> list[float]:
        """:meth:`forward_time` of ``node`` under each of ``strategies``
        (each shard factor priced once, as :meth:`compute_each`)."""
        return self._per_shard_factor(node, strategies, self.forward_time)

    def recompute_each(self, node: Node, strategies: Sequence[Strategy]) -> list[float]:
        """Seconds of re-running ``node``'s forward in a checkpointed layer's
        backward, under each of ``strategies``: its kernel (:meth:`forward_time`)
        and the reduction of each output it leaves partial on a mesh axis (a
        row-parallel linear's all-reduce), which the re-run issues again."""
        out = []
        for t, s in zip(self.forward_each(node, strategies), strategies):
            for info, placements in zip(node.outputs, s.outputs):
                for a, (p, size) in enumerate(zip(placements or (), self.mesh_shape)):
                    if size > 1 and type(p) is Partial:
                        nbytes = local_numel(info, placements, self.mesh_shape,
                                             skip_axis=a) * info.itemsize
                        t += collective_time("all_reduce", nbytes, size, self.links[a])
            out.append(t)
        return out

    def _per_shard_factor(self, node: Node, strategies: Sequence[Strategy],
                          price: Callable[[Node, Strategy], float]) -> list[float]:
        if node.kind != OP:
            return [price(node, s) for s in strategies]
        by_factor: dict[int, float] = {}
        out = []
        for s in strategies:
            f = self.shard_factor(s)
            if f not in by_factor:
                by_factor[f] = price(node, s)
            out.append(by_factor[f])
        return out

    def optimizer_time(self, node: Node, s: Strategy) -> float:
        """Seconds of the optimizer's update of this device's part of a
        parameter: a memory-bound pass over the tensors of its size the update
        reads and writes (:data:`costmodel.memory.OPTIMIZER_ACCESSES`), in the
        master dtype, over the shard ZeRO leaves this device."""
        numel = local_numel(node.output, s.outputs[0], self.mesh_shape) / self.state_shards
        nbytes = numel * OPTIMIZER_ACCESSES.get(self.optimizer, 0) * self.precision.master_bytes
        if nbytes <= 0:
            return 0.0
        memory = self.cluster.device.memory_bandwidth * self.cluster.device.memory_efficiency
        return nbytes / memory

    def cast_time(self, node: Node, s: Strategy) -> float:
        """Seconds of a mixed-precision step's two casts of a parameter: the
        master copy to the compute dtype before the forward reads it, and its
        gradient back to the master dtype (each reads one dtype and writes the
        other); 0 when the parameter is kept in the compute dtype."""
        if not self.precision.mixed:
            return 0.0
        numel = local_numel(node.output, s.outputs[0], self.mesh_shape)
        one = op_time(0.0, numel * (self.precision.master_bytes
                                    + self.precision.compute_dtype.itemsize),
                      self.cluster.device, self.dtype)
        return 2 * one

    def _dispatch(self, node: Node) -> float:
        """Host seconds the distributed runtime adds to running the op once."""
        return 0.0 if node.target == "getitem" else self.cluster.device.dispatch_overhead

    def _view_time(self, node: Node) -> float:
        """Seconds of a view op in one pass: no kernel, but the distributed
        runtime dispatches it (the host's own time to issue it counts in
        :func:`costmodel.compute.host_seconds`)."""
        return self._dispatch(node)

    def backward_times(self, node: Node, s: Strategy) -> tuple[float, float]:
        """(input-gradient, weight-gradient) seconds of the op's backward under ``s``."""
        if node.kind != OP or node.name not in self.requires_grad:
            return 0.0, 0.0
        if node.is_view:
            return self._view_time(node), 0.0
        f = self.shard_factor(s)
        input_grad, weight_grad = backward_kernels(node, self.requires_grad, self.param_derived)
        if node.target == FUSED_ATTENTION:
            b = attention_times(node.flops / f, node.bytes_moved / f, self.cluster.device,
                                self.dtype)[1] if input_grad else 0.0
            return b + self._dispatch(node), 0.0
        b, w = backward_op_times(node.flops / f, node.bytes_moved / f, self.cluster.device,
                                 self.dtype, input_grad=input_grad, weight_grad=weight_grad,
                                 aligned=gemm_aligned(node))
        return b + self._dispatch(node), w

    def forward_time(self, node: Node, s: Strategy) -> float:
        """Seconds of the op's forward alone (what activation checkpointing re-runs)."""
        if node.kind != OP:
            return 0.0
        if node.is_view:
            return self._view_time(node)
        f = self.shard_factor(s)
        if node.target == FUSED_ATTENTION:
            return (attention_times(node.flops / f, node.bytes_moved / f, self.cluster.device,
                                    self.dtype)[0] + self._dispatch(node))
        return (op_time(node.flops / f, node.bytes_moved / f, self.cluster.device, self.dtype,
                        aligned=gemm_aligned(node))
                + self._dispatch(node))

    def backward_collectives(self, node: Node, s: Strategy) -> float:
        """Seconds of the all-reduce of input gradients that come out partial
        under ``s``, in each micro-batch's backward. Under ZeRO
        (:attr:`zero_stage` > 0) or ``reduce_once`` a parameter's gradient sum
        on mesh axis 0 waits for the end of the step instead, and the parameter
        node itself carries that step's collectives over axis 0
        (:meth:`state_collectives`)."""
        if node.kind == PARAM:
            return self.state_collectives(node, s)
        return sum(t for _, _, t in self._gradient_all_reduces(node, s))

    def _gradient_all_reduces(self, node: Node, s: Strategy) -> list[tuple[str, int, float]]:
        """(argument, mesh axis, seconds) of each all-reduce of an input gradient
        that comes out partial under ``s`` in a micro-batch's backward."""
        if node.kind != OP:
            return []
        out_split = s.output_split_axes
        if not any(out_split):  # replicated outputs: no input gradient comes out partial
            return []
        out = []
        for arg, info, pin, replicated in zip(node.args, node.inputs, s.inputs,
                                              s.replicated_inputs):
            if arg not in self.requires_grad:
                continue
            for a, size in enumerate(self.mesh_shape):
                if a == 0 and self.step_sync_ranks > 1 and arg in self.param_derived:
                    continue  # a pending sum, reduced once per step
                if size > 1 and out_split[a] and replicated[a]:
                    nbytes = local_numel(info, pin, self.mesh_shape, skip_axis=a) * info.itemsize
                    if arg in self.param_derived:  # a weight's gradient, in the reduce dtype
                        nbytes *= self.reduce_scale
                    out.append((arg, a, collective_time("all_reduce", nbytes, size,
                                                        self.links[a])))
        return out

    def zero_bytes(self, node: Node, s: Strategy) -> float:
        """Bytes per device of a parameter whose gradient sum on mesh axis 0
        (where it is replicated) is reduced once per step, under ZeRO or
        ``reduce_once``; 0 for anything else."""
        if node.kind != PARAM or self.step_sync_ranks == 1 or not isinstance(s.outputs[0][0],
                                                                             Replicate):
            return 0.0
        return local_numel(node.output, s.outputs[0], self.mesh_shape) * node.output.itemsize

    def zero_collectives(self, nbytes: float) -> float:
        """Seconds of the once-per-step collectives over mesh axis 0 for
        ``nbytes`` of parameters in the compute dtype: the reduce-scatter of
        their gradients (in the reduce dtype) and the all-gather of the
        parameters (in the compute dtype), one collective each (as FSDP2 issues
        them for a stage; ring: together the bytes and time of the one
        all-reduce, in the reduce dtype, Megatron's DDP issues under ``reduce_once``)."""
        if self.step_sync_ranks == 1 or nbytes <= 0:
            return 0.0
        n, link = self.step_sync_ranks, self.links[0]
        return (collective_time("reduce_scatter", nbytes * self.reduce_scale, n, link)
                + collective_time("all_gather", nbytes * self.gather_scale, n, link))

    def zero3_layer_collectives(self, nbytes: float, layer_bytes: float) -> tuple[float, float]:
        """``(forward, backward)`` seconds per micro-batch of ZeRO-3's collectives
        over mesh axis 0, FSDP2 layer by layer (:mod:`codegen.zero3_units`,
        every micro-batch's backward resharding and reduce-scattering): the
        all-gather of ``nbytes`` of parameters (compute dtype) in the forward;
        in the backward the all-gather again of the ``layer_bytes`` of them in
        layers (the others stay gathered for the pass) and the reduce-scatter
        of all their gradients (reduce dtype)."""
        if self.step_sync_ranks == 1 or nbytes <= 0:
            return 0.0, 0.0
        n, link = self.step_sync_ranks, self.links[0]
        gather = collective_time("all_gather", nbytes * self.gather_scale, n, link)
        again = (collective_time("all_gather", layer_bytes * self.gather_scale, n, link)
                 if layer_bytes > 0 else 0.0)
        return gather, again + collective_time("reduce_scatter", nbytes * self.reduce_scale,
                                               n, link)

    def state_collectives(self, node: Node, s: Strategy) -> float:
        """Seconds one parameter adds to :meth:`zero_collectives` of its stage:
        those of its bytes less their per-message latency, which the stage's
        one pair of collectives pays once (:func:`planner.search.stage_dp.stage_times`
        adds it)."""
        nbytes = self.zero_bytes(node, s)
        if nbytes == 0:
            return 0.0
        return max(0.0, self.zero_collectives(nbytes) - self._zero_latency)

    def memory_breakdown(self, node: Node, s: Strategy) -> dict[str, float]:
        """Bytes per device that ``node`` holds under ``s`` during a training step.

        Parameters bring their gradient and optimizer states (sharded like the
        parameter); a user input its local batch; an op the outputs that
        autograd keeps for some op's backward (:mod:`costmodel.saved_tensors`).

        With n ranks on mesh axis 0, for a parameter replicated on it: under
        ZeRO-1 the optimizer states count ``1/n`` (under a mixed precision
        with the fp32 master parameters, the model's parameters in the
        compute dtype: Megatron's distributed optimizer); under ZeRO-2 and ZeRO-3
        (FSDP2 with the whole stage as one unit, :attr:`params_sharded`)
        parameters, gradients and optimizer states are kept 1/n each, and on
        top the stage's parameters are all-gathered whole for the step and its
        gradients stay whole until they are reduce-scattered: params and grads
        count ``1 + 1/n`` times, optimizer states ``1/n`` (in fp32; see
        :func:`costmodel.memory.training_state_bytes` for the dtypes).
        """
        if node.kind == PARAM:
            numel, zero, n = self._state_layout(node, s)
            state = training_state_bytes(numel, precision=self.precision,
                                         optimizer=self.optimizer, zero_stage=zero, dp_size=n,
                                         params_sharded=self.params_sharded,
                                         gathered=self._gathered(node))
            return {k: float(v) for k, v in state.items() if k != "total"}
        if node.kind == INPUT:
            return {"activations": local_numel(node.output, s.outputs[0], self.mesh_shape)
                    * node.output.itemsize}
        out: dict[str, float] = {}
        kept = self.saved.get(node.name)
        if node.kind == OP and kept:
            f = self.shard_factor(s)
            out["activations"] = sum(local_numel(o, p, self.mesh_shape) * o.itemsize
                                     for i, (o, p) in enumerate(zip(node.outputs, s.outputs))
                                     if i in kept) + extra_saved_bytes(node) / f
        if node.name == self.transient_node:
            out["backward_transient"] = self.backward_transient(node, s)
        return out

    def _gathered(self, node: Node) -> bool:
        """Whether parameter ``node``'s whole copy and gradient count toward the
        peak when it is sharded (:attr:`gathered_params`)."""
        return self.gathered_params is None or node.name in self.gathered_params

    def _state_layout(self, node: Node, s: Strategy) -> tuple[int, int, int]:
        """(parameters this device holds, ZeRO stage, ZeRO group size) of
        parameter ``node`` under strategy ``s``."""
        numel = int(math.ceil(local_numel(node.output, s.outputs[0], self.mesh_shape)))
        # ZeRO shards the states over axis 0 where the parameter is replicated;
        # a parameter sharded there already holds the states of its shard alone
        n = self.state_shards if isinstance(s.outputs[0][0], Replicate) else 1
        # ZeRO-1 under a mixed precision keeps the distributed optimizer's layout
        # (working params in the compute dtype, the master copy with the states)
        # for a parameter sharded on axis 0 too, its states then split over 1
        zero = self.zero_stage if n > 1 or self.zero_stage == 1 else 0
        return numel, zero, n

    def step_copy(self, node: Node, s: Strategy) -> float:
        """Bytes of parameter ``node``'s ``params`` under ``s`` that the step frees
        before the optimizer step (:func:`costmodel.memory.step_copy_bytes`);
        none at stage 1 under a mixed precision, which stores the compute-dtype
        parameters."""
        numel, zero, n = self._state_layout(node, s)
        if zero == 1 and self.precision.mixed and not self.params_sharded:
            return 0.0
        if n > 1 and not self._gathered(node):
            return 0.0
        return float(step_copy_bytes(numel, precision=self.precision, dp_size=n,
                                     params_sharded=self.params_sharded))

    def _largest_transient(self) -> str | None:
        """The op whose backward holds the most transient gradient bytes,
        unsharded (in a language model the vocabulary projection and the
        loss, at the start of the backward, while every activation is alive).
        Its :meth:`backward_transient` under its chosen strategy counts
        toward the step's peak memory; a linear term, so the ILP's memory
        budget covers it exactly (other ops' transients are assumed smaller)."""
        best, name = 0.0, None
        for n in self.graph.nodes:
            if n.kind != OP or n.is_view or n.name not in self.requires_grad:
                continue
            nbytes = sum(o.nbytes for o in n.outputs if o.is_float) + sum(
                t.nbytes for a, t in zip(n.args, n.inputs)
                if t.is_float and a in self.requires_grad and a not in self.param_derived)
            if nbytes > best:
                best, name = nbytes, n.name
        return name

    def backward_transient(self, node: Node, s: Strategy) -> float:
        """Bytes per device the backward of ``node`` holds on top of the saved
        activations while it runs: the gradient of its outputs and the
        gradients it writes for its activation inputs (the largest of these, at
        the loss, is what lifts the step's peak above the states and saved
        activations). 0 off the gradient path and for views."""
        if node.kind != OP or node.is_view or node.name not in self.requires_grad:
            return 0.0
        out = sum(local_numel(o, p, self.mesh_shape) * o.itemsize
                  for o, p in zip(node.outputs, s.outputs) if o.is_float)
        ins = sum(local_numel(t, p, self.mesh_shape) * t.itemsize
                  for a, t, p in zip(node.args, node.inputs, s.inputs)
                  if t.is_float and a in self.requires_grad and a not in self.param_derived)
        return float(out + ins)

    def backward_excess(self, chosen: Mapping[str, Strategy] | None = None,
                        checkpointed: Sequence[str] = ()) -> float:
        """Bytes per device, at the worst op of the backward, that the backward
        holds beyond the saved activations (the backward's timeline,
        :func:`costmodel.memory.backward_timeline_excess`): the gradients made so
        far, that op's :meth:`backward_transient`, less the activations freed by
        the ops that ran before it. The backward runs the ops in the reverse of
        the forward's order; an op makes the gradient of a parameter it is the
        last reader of, and frees the saved tensors it is the first keeper of
        (:func:`costmodel.saved_tensors.release_points`). At the loss it is the
        loss's transient; at a mixture-of-experts layer near the end of the model
        its experts' gradients, made at once while the earlier layers'
        activations are alive, can lift it far above that (DeepSeek-V3's MoE
        layer: 22 GB of bf16 gradients). Under the ``chosen`` strategies (None:
        every value whole, as captured). Ops of ``checkpointed`` layers (names
        of the graph's layers) free nothing: their activations were not kept (their
        recomputation is :func:`costmodel.memory.step_peak_bytes`'
        ``recomputed_layer``).

        Gradients count as :meth:`memory_breakdown` has them, less the fp32
        main-gradient slice of ZeRO-1 under a mixed precision, which exists at
        the optimizer step only; the compute-dtype copy of a parameter
        (:meth:`step_copy`) is freed by the first op in the forward that reads
        it, the last of its readers to run backward."""
        graph = self.graph

        def strategy(node: Node) -> Strategy:
            if chosen is not None:
                return chosen[node.name]
            whole = tuple(Replicate() for _ in self.mesh_shape)
            return Strategy(inputs=tuple(whole for _ in node.args),
                            outputs=tuple(whole for _ in node.outputs))

        recomputed = graph.layer_ops(checkpointed)
        # the parameter a value is (through views)
        root: dict[str, str] = {}
        for n in graph.nodes:
            if n.kind == PARAM:
                root[n.name] = n.name
            elif n.name in self.param_derived and n.args and n.args[0] in root:
                root[n.name] = root[n.args[0]]
        ops = [n for n in graph.nodes
               if n.kind == OP and not n.is_view and n.name in self.requires_grad]
        last_reader: dict[str, str] = {}
        first_reader: dict[str, str] = {}
        for n in ops:
            for a in n.args:
                if a in root:
                    last_reader[root[a]] = n.name
                    first_reader.setdefault(root[a], n.name)
        freed: dict[str, float] = {}
        for param, op in first_reader.items():
            # the compute-dtype copy the step made (a mixed precision's cast, FSDP2's
            # gathered parameters) is freed once the last op that reads it has run
            copy = self.step_copy(graph[param], strategy(graph[param]))
            if copy:
                freed[op] = freed.get(op, 0.0) + copy
        made: dict[str, float] = {}
        for param, op in last_reader.items():
            node = graph[param]
            s = strategy(node)
            grads = self.memory_breakdown(node, s).get("grads", 0.0)
            numel, zero, _ = self._state_layout(node, s)
            p = self.precision
            if zero == 1 and p.mixed and not self.params_sharded:
                grads = float(p.reduce_dtype.itemsize * numel)  # the main-grad slice: at the step
            made[op] = made.get(op, 0.0) + grads
        for base, op in release_points(graph, self.requires_grad).items():
            node = graph[base]
            if node.kind != OP or base in recomputed:
                continue
            kept = self.memory_breakdown(node, strategy(node)).get("activations", 0.0)
            freed[op] = freed.get(op, 0.0) + kept
        return backward_timeline_excess(
            (made.get(n.name, 0.0), self.backward_transient(n, strategy(n)),
             freed.get(n.name, 0.0)) for n in reversed(ops))

    def memory(self, node: Node, s: Strategy) -> float:
        """Bytes per device of :meth:`memory_breakdown`, activations counted once per
        micro-batch in flight (``activation_copies``)."""
        return float(sum(v * (self.activation_copies if k == "activations" else 1.0)
                         for k, v in self.memory_breakdown(node, s).items()))

    def edge(self, producer_out: Placements, consumer_in: Placements, info: TensorInfo,
             requires_grad: bool) -> float:
        """Seconds of an edge: forward reshard of ``info`` from the producer's output
        placements into the consumer's input placements, plus (``requires_grad``)
        the reverse reshard of its gradient."""
        return self.edge_seconds((self.spec_id(producer_out),), (self.spec_id(consumer_in),),
                                 info, requires_grad)[0][0]

    @property
    def edge_matrices(self) -> dict[tuple, tuple]:
        """Edge matrices of strategy lists priced on this mesh
        (:func:`_edge_matrix`), kept by the shared :class:`ReshardPricer`."""
        return self._pricer.memo("edge_matrices")

    def edge_seconds(self, srcs: tuple[int, ...], dsts: tuple[int, ...], info: TensorInfo,
                     requires_grad: bool) -> tuple[tuple[float, ...], ...]:
        """:meth:`edge` for every (producer output, consumer input) pair of
        placements given by :meth:`spec_id`: seconds, ``[i][j]`` for ``srcs[i]``
        and ``dsts[j]`` (memoised by the mesh's :class:`ReshardPricer`,
        :meth:`ReshardPricer.edge_seconds`)."""
        return self._pricer.edge_seconds(srcs, dsts, info.shape, info.itemsize, requires_grad)
