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
        matmul's all-to-alls, which the re-run issues again. In a compiled
        program a checkpointed layer runs eagerly (torch.compile breaks its
        graph at ``codegen.checkpointed_layers.checkpointed``): the re-run is
        eager, and so are the layer's forward and backward
        (:meth:`eager_excess`)."""
        out = []
        for t, s in zip(self._per_shard_factor(node, strategies, self._checkpointed_extra),
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

    def _dispatch(self, node: Node, eager: bool = False) -> float:
        """Host seconds the distributed runtime adds to running the op once
        (none in a compiled program: DTensor's dispatch ran when it was traced;
        an op the compiled program runs eagerly, between ZeRO-3's units or
        ``eager``, pays it)."""
        if node.target == "getitem" or (self.cluster.device.compiled and not eager
                                          and node.name not in self.eager_ops):
            return 0.0
        return self.cluster.device.dispatch_overhead

    def _compiled_op(self, node: Node) -> bool:
        """Whether ``node`` is an op a compiled program runs in its graphs."""
        return (self.cluster.device.compiled and node.kind == OP
                and node.name not in self.eager_ops)

    def _aligned(self, node: Node, eager: bool) -> bool:
        """Whether the op's GEMMs run at the aligned rate (:func:`gemm_aligned`).
        A compiled program's are: inductor pads a matmul's operands to the
        tensor cores' alignment where that is faster (``shape_padding``, on by
        default on GPUs; the pad's copy is not priced)."""
        return (not eager and self._compiled_op(node)) or gemm_aligned(node)

    def eager_excess(self, node: Node, s: Strategy) -> float:
        """Seconds the op's forward and backward under ``s`` take more when
        they run eagerly than in the compiled program (0 where the program
        is not compiled, or runs the op eagerly anyway)."""
        if not self._compiled_op(node):
            return 0.0
        return self._eager_forward_and_excess(node, s)[1]

    def _eager_forward_and_excess(self, node: Node, s: Strategy) -> tuple[float, float]:
        """(seconds of the op's eager forward, :meth:`eager_excess`) of a
        compiled op, its eager forward priced once."""
        forward = self.forward_time(node, s, eager=True)
        eager = forward + sum(self.backward_times(node, s, eager=True))
        return forward, eager - self.forward_time(node, s) - sum(self.backward_times(node, s))

    def _checkpointed_extra(self, node: Node, s: Strategy) -> float:
        """Seconds a checkpointed layer adds for ``node``'s kernels: its
        forward again, and in a compiled program all of it run eagerly."""
        if not self._compiled_op(node):
            return self.forward_time(node, s)
        return sum(self._eager_forward_and_excess(node, s))

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

    def _view_time(self, node: Node, eager: bool = False) -> float:
        """Seconds of a view op in one pass: no kernel, but the distributed
        runtime dispatches it (the host's own time to issue it counts in
        :func:`costmodel.compute.host_seconds`)."""
        return self._dispatch(node, eager)

    def backward_times(self, node: Node, s: Strategy, eager: bool = False) -> tuple[float, float]:
        """(input-gradient, weight-gradient) seconds of the op's backward under
        ``s``; ``eager``: as the eager runtime runs it, in a compiled program too."""
        if node.kind != OP or node.name not in self.requires_grad:
            return 0.0, 0.0
        if node.is_view:
            return self._view_time(node, eager), 0.0
        f = self.shard_factor(s)
        input_grad, weight_grad = backward_kernels(node, self.requires_grad, self.param_derived)
        if node.target == FUSED_ATTENTION:
            b = attention_times(node.flops / f, node.bytes_moved / f, self.cluster.device,
                                self.dtype)[1] if input_grad else 0.0
            return b + self._dispatch(node, eager), 0.0
        share = None if eager else self.fused_shares.get(node.name)
        if share is not None:  # the backward's chain fuses as the forward's
            one = fused_seconds(share, f, self.cluster.device)
            return input_grad * one, weight_grad * one
        b, w = backward_op_times(node.flops / f, node.bytes_moved / f, self.cluster.device,
                                 self.dtype, input_grad=input_grad, weight_grad=weight_grad,
                                 aligned=self._aligned(node, eager))
        return b + self._dispatch(node, eager), w

    def forward_time(self, node: Node, s: Strategy, eager: bool = False) -> float:
        """Seconds of the op's forward alone (what activation checkpointing
        re-runs); ``eager``: as the eager runtime runs it, in a compiled program too."""
        if node.kind != OP:
            return 0.0
        if node.is_view:
            return self._view_time(node, eager)
        f = self.shard_factor(s)
        if node.target == FUSED_ATTENTION:
            return (attention_times(node.flops / f, node.bytes_moved / f, self.cluster.device,
                                    self.dtype)[0] + self._dispatch(node, eager))
        share = None if eager else self.fused_shares.get(node.name)
        if share is not None:
            return fused_seconds(share, f, self.cluster.device)
        return (op_time(node.flops / f, node.bytes_moved / f, self.cluster.device, self.dtype,
                        aligned=self._aligned(node, eager))
                + self._dispatch(node, eager))
