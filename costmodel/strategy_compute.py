"""Per-strategy compute prices: the seconds of one op's kernels on one device.

:class:`ComputePricing` is the part of :class:`costmodel.strategy_cost.IntraOpCost`
that prices a node's own work under one sharding strategy: an op's forward and
backward kernels (split over the devices its strategy spreads it on), the
re-run of its forward in a checkpointed layer, a parameter's optimizer update
and mixed-precision casts, and a user input's load into memory.

Units: seconds, of one training step on one device.
"""

from __future__ import annotations

from typing import Callable, Sequence

from torch.distributed.tensor.placement_types import Partial

from costmodel.collectives import collective_time
from costmodel.compute import (FUSED_ATTENTION, attention_times, backward_kernels,
                               backward_op_times, gemm_aligned, op_time)
from costmodel.fusion import fused_seconds
from costmodel.memory import OPTIMIZER_ACCESSES
from costmodel.strategy_settings import StrategySettings
from ir.graph import INPUT, OP, PARAM, Node
from ir.strategy import Strategy, local_numel

__all__ = ["ComputePricing"]


class ComputePricing(StrategySettings):
    """Compute seconds of a node under a strategy; a part of
    :class:`costmodel.strategy_cost.IntraOpCost`."""

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

    def compute_each(self, node: Node, strategies: Sequence[Strategy]) -> list[float]:
        """:meth:`compute` of ``node`` under each of ``strategies``: an op's
        depends on its strategy only through :meth:`shard_factor`, so each
        factor is priced once (a layer's ops have tens of strategies and a
        few factors)."""
        return self._per_shard_factor(node, strategies, self.compute)

    def recompute_each(self, node: Node, strategies: Sequence[Strategy]) -> list[float]:
        """Seconds of re-running ``node``'s forward in a checkpointed layer's
        backward, under each of ``strategies``: its kernel (:meth:`forward_time`)
        and the reduction of each output it leaves partial on a mesh axis (a
        row-parallel linear's all-reduce) and an expert-parallel grouped
        matmul's all-to-alls, which the re-run issues again. A compiled
        program re-runs the layer compiled (its checkpoint traced into the
        program's graph, or on a mesh the layer compiled on its own:
        :mod:`codegen.executor`), so the re-run is priced as the compiled
        forward; the calls of a layer compiled on its own are the host's
        (:func:`costmodel.compute.compiled_call_seconds`)."""
        out = []
        for t, s in zip(self._per_shard_factor(node, strategies, self.forward_time),
                        strategies):
            t += self.expert_exchange(node, s)[0]
            for info, placements in zip(node.outputs, s.outputs):
                for a, (p, size) in enumerate(zip(placements or (), self.mesh_shape)):
                    if size > 1 and type(p) is Partial:
                        nbytes = local_numel(info, placements, self.mesh_shape,
                                             skip_axis=a) * info.itemsize
                        t += collective_time("all_reduce", nbytes, size,
                                             self.redistribute_links[a])
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
        return nbytes / self.cluster.device.streaming_bandwidth

    def accumulate_time(self, node: Node, s: Strategy) -> float:
        """Seconds of adding one micro-batch's gradient of this device's part of
        a parameter into the gradient of the step's micro-batches before it
        (autograd's in-place accumulation): a memory-bound pass reading both and
        writing one, in the master dtype, over the whole local gradient, or
        under ZeRO-3 (reduce-scattered every micro-batch) over its shard."""
        numel = local_numel(node.output, s.outputs[0], self.mesh_shape)
        if self.zero_stage == 3:
            numel /= self.state_shards
        return 3 * numel * self.precision.master_bytes / self.cluster.device.streaming_bandwidth

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
        """Host seconds the distributed runtime adds to running the op once
        (none in a compiled program: DTensor's dispatch ran when it was traced;
        an op the compiled program runs eagerly, between ZeRO-3's units, pays it)."""
        if node.target == "getitem" or (self.cluster.device.compiled
                                          and node.name not in self.eager_ops):
            return 0.0
        return self.cluster.device.dispatch_overhead

    def _compiled_op(self, node: Node) -> bool:
        """Whether ``node`` is an op a compiled program runs in its graphs."""
        return (self.cluster.device.compiled and node.kind == OP
                and node.name not in self.eager_ops)

    def _aligned(self, node: Node) -> bool:
        """Whether the op's GEMMs run at the aligned rate (:func:`gemm_aligned`).
        A compiled program's are: inductor pads a matmul's operands to the
        tensor cores' alignment where that is faster (``shape_padding``, on by
        default on GPUs; the pad's copy is not priced)."""
        return self._compiled_op(node) or gemm_aligned(node)

    def price_context(self, node: Node) -> tuple:
        """What ``node``'s prices depend on beyond its own shapes and
        strategy: the backward kernels it runs (an op whose activation input
        needs no gradient, as the first layer's reading a user input, runs no
        input-gradient kernel) and its part of a fused chain. Copies of a
        repeated block price alike only where these agree."""
        if node.kind != OP:
            return ()
        return (backward_kernels(node, self.requires_grad, self.param_derived)
                if node.name in self.requires_grad else None,
                self.fused_shares.get(node.name))

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
        share = self.fused_shares.get(node.name)
        if share is not None:  # the backward's chain fuses as the forward's
            one = fused_seconds(share, f, self.cluster.device)
            return input_grad * one, weight_grad * one
        b, w = backward_op_times(node.flops / f, node.bytes_moved / f, self.cluster.device,
                                 self.dtype, input_grad=input_grad, weight_grad=weight_grad,
                                 aligned=self._aligned(node))
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
        share = self.fused_shares.get(node.name)
        if share is not None:
            return fused_seconds(share, f, self.cluster.device)
        return (op_time(node.flops / f, node.bytes_moved / f, self.cluster.device, self.dtype,
                        aligned=self._aligned(node))
                + self._dispatch(node))
