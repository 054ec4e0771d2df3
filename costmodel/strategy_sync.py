"""Per-strategy gradient collectives: all-reduces in each backward, ZeRO's per step.

:class:`GradientSyncPricing` is the part of
:class:`costmodel.strategy_cost.IntraOpCost` that prices the collectives a
strategy implies for gradients: the all-reduce of each input gradient that
comes out partial in a micro-batch's backward (and the all-to-alls of an
expert-parallel grouped matmul, forward and backward), and the collectives over mesh
axis 0 that every stage issues once per step for its parameters' gradient
sums (the runtime lets them accumulate over the step's micro-batches, as
Megatron's and torch's DDP do): their all-reduce, or under ZeRO the
reduce-scatter of the sums and the all-gather of the updated parameters, or
ZeRO-3's layer by layer gathers in every micro-batch.

A parameter replicated on axis 0 is taken to get a pending sum there (its
users' rows split over the data-parallel ranks), one gathered for its use a
reduce-scatter of it (:meth:`IntraOpCost.gradient_reshard`); an op that
computes on whole rows on every rank (no sum to make) is rare and priced
so too.

Gradient communication is not overlapped with backward: the code generator
reduces gradients after backward, so the model charges it in full.

Units: seconds, bytes.
"""

from __future__ import annotations

from torch.distributed.tensor.placement_types import Replicate

from costmodel.collectives import collective_time
from costmodel.strategy_settings import StrategySettings
from ir.graph import OP, PARAM, Node
from ir.grouped_mm import BACKWARD_EXCHANGES, exchange_axis
from ir.strategy import Strategy, local_numel

__all__ = ["GradientSyncPricing"]


class GradientSyncPricing(StrategySettings):
    """Gradient collectives of a node under a strategy; a part of
    :class:`costmodel.strategy_cost.IntraOpCost`."""

    # seconds of zero_collectives(1.0): the per-message latency of the step's pair
    _zero_latency: float

    def backward_collectives(self, node: Node, s: Strategy) -> float:
        """Seconds of the all-reduce of input gradients that come out partial
        under ``s``, in each micro-batch's backward. A parameter's gradient
        sum on mesh axis 0 waits for the end of the step instead, and the
        parameter node itself carries that step's collectives over axis 0
        (:meth:`state_collectives`)."""
        if node.kind == PARAM:
            return self.state_collectives(node, s)
        return (sum(t for _, _, t in self._gradient_all_reduces(node, s))
                + sum(self.expert_exchange(node, s)))

    def expert_exchange(self, node: Node, s: Strategy) -> tuple[float, float]:
        """``(forward, backward)`` seconds of the all-to-alls of an
        expert-parallel grouped matmul (:func:`ir.grouped_mm.exchange_axis`;
        0 for any other node and strategy): its rows of x go to the ranks
        holding their experts and its rows of y come back; the backward moves
        x and dy there and dx back (torch's op moves dy twice:
        :data:`ir.grouped_mm.BACKWARD_EXCHANGES`). Each is priced as the zoo MoE's ``S(i) ->
        S(j)`` reshard around its expert matmul is: an all-to-all of this
        device's shard over the axis."""
        if node.kind != OP:
            return 0.0, 0.0
        axis = exchange_axis(node.target, s.inputs, [len(i.shape) for i in node.inputs[:2]])
        if axis is None or self.mesh_shape[axis] == 1:
            return 0.0, 0.0
        size, link = self.mesh_shape[axis], self.redistribute_links[axis]

        def moved(info, placements) -> float:
            nbytes = local_numel(info, placements, self.mesh_shape) * info.itemsize
            return collective_time("all_to_all", nbytes, size, link)

        x, y = moved(node.inputs[0], s.inputs[0]), moved(node.outputs[0], s.outputs[0])
        nx, ny = BACKWARD_EXCHANGES[node.target]
        return x + y, nx * x + ny * y

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
                if a == 0 and arg in self.param_derived:
                    continue  # a pending sum, reduced once per step
                if size > 1 and out_split[a] and replicated[a]:
                    nbytes = local_numel(info, pin, self.mesh_shape, skip_axis=a) * info.itemsize
                    # an activation's gradient is redistributed by DTensor in the
                    # backward; a weight's goes with the step's gradient buckets
                    link = self.redistribute_links[a]
                    if arg in self.param_derived:  # a weight's gradient, in the reduce dtype
                        nbytes *= self.reduce_scale
                        link = self.links[a]
                    out.append((arg, a, collective_time("all_reduce", nbytes, size, link)))
        return out

    def zero_bytes(self, node: Node, s: Strategy) -> float:
        """Bytes per device of a parameter whose gradient sum on mesh axis 0
        (where it is replicated) is reduced once per step; 0 for anything else."""
        if node.kind != PARAM or self.step_sync_ranks == 1 or not isinstance(s.outputs[0][0],
                                                                             Replicate):
            return 0.0
        return local_numel(node.output, s.outputs[0], self.mesh_shape) * node.output.itemsize

    def zero_collectives(self, nbytes: float) -> float:
        """Seconds of the once-per-step collectives over mesh axis 0 for
        ``nbytes`` of parameters in the compute dtype.

        Under ZeRO: the reduce-scatter of their gradients (in the reduce dtype)
        and the all-gather of the parameters (in the compute dtype), one
        collective each (as FSDP2 issues them for a stage). Without: the
        all-reduce of the gradients (in the reduce dtype) that
        :func:`codegen.grad_reduction.redistribute_grads` and Megatron's DDP
        issue, priced as the reduce-scatter and all-gather a ring all-reduce
        is made of. On a backend that reduce-scatters by all-reducing (gloo)
        the gradients are all-reduced as they run: one all-reduce without
        ZeRO, and under ZeRO-1 (:mod:`codegen.zero1`) one before the gather.
        With the copies into and out of their flat buffers
        (:meth:`flat_copy_seconds`)."""
        if self.step_sync_ranks == 1 or nbytes <= 0:
            return 0.0
        n, link = self.step_sync_ranks, self.links[0]
        gradient_bytes, gather_bytes = nbytes * self.reduce_scale, nbytes * self.gather_scale
        copies = self.flat_copy_seconds(gradient_bytes, gather_bytes)
        by_all_reduce = self.cluster.reduce_scatters_by_all_reduce
        if not self.zero_stage and by_all_reduce:
            return collective_time("all_reduce", gradient_bytes, n, link) + copies
        gradients = "all_reduce" if self.zero_stage == 1 and by_all_reduce else "reduce_scatter"
        return (collective_time(gradients, gradient_bytes, n, link)
                + collective_time("all_gather", gather_bytes, n, link) + copies)

    def flat_copy_seconds(self, gradient_bytes: float, gather_bytes: float) -> float:
        """Seconds of the copies between the parameters' own tensors and the
        flat buffers that the once-per-step collectives over mesh axis 0 move
        (:meth:`zero_collectives`: ``gradient_bytes`` of gradients reduced,
        ``gather_bytes`` of parameters gathered), each copy reading and
        writing its bytes once at the device's streaming bandwidth, as the
        runtime makes them. Without ZeRO, the gradient bucket's concatenation
        (:func:`codegen.grad_reduction.all_reduce_flat`; its sums are views of
        it). Under FSDP2 (ZeRO-2/3), the copy into and out of each collective:
        the whole tensors on one side, this rank's shards on the other. Under
        ZeRO-1 (:mod:`codegen.zero1`) the gradients likewise, and the gathered
        parameters twice on the whole side (the gathered rows made contiguous,
        then written into the parameters)."""
        n = self.step_sync_ranks
        if not self.zero_stage:
            copied = gradient_bytes
        elif self.zero_stage == 1:
            copied = gradient_bytes * (1 + 1 / n) + gather_bytes * (2 + 1 / n)
        else:
            copied = (gradient_bytes + gather_bytes) * (1 + 1 / n)
        return 2 * copied / self.cluster.device.streaming_bandwidth

    def zero3_layer_collectives(self, nbytes: float, layer_bytes: float) -> tuple[float, float]:
        """``(forward, backward)`` seconds per micro-batch of ZeRO-3's collectives
        over mesh axis 0, FSDP2 layer by layer (:mod:`codegen.zero3_units`,
        every micro-batch's backward resharding and reduce-scattering): the
        all-gather of ``nbytes`` of parameters (compute dtype) in the forward;
        in the backward the all-gather again of the ``layer_bytes`` of them in
        layers (the others stay gathered for the pass) and the reduce-scatter
        of all their gradients (reduce dtype); each with FSDP2's copies into
        and out of its flat buffer (:meth:`flat_copy_seconds`). Each kind is
        priced as one collective of all its bytes; the units' further calls
        (``zero3_calls``) add ``DeviceSpec.fsdp_call_overhead`` each."""
        if self.step_sync_ranks == 1 or nbytes <= 0:
            return 0.0, 0.0
        n, link = self.step_sync_ranks, self.links[0]
        gather = (collective_time("all_gather", nbytes * self.gather_scale, n, link)
                  + self.flat_copy_seconds(0.0, nbytes * self.gather_scale))
        again = (collective_time("all_gather", layer_bytes * self.gather_scale, n, link)
                 + self.flat_copy_seconds(0.0, layer_bytes * self.gather_scale)
                 if layer_bytes > 0 else 0.0)
        gradients = nbytes * self.reduce_scale
        per_call = self.cluster.device.fsdp_call_overhead
        calls_f, calls_b = self.zero3_calls
        return (gather + max(0, calls_f - 1) * per_call,
                again + collective_time("reduce_scatter", gradients, n, link)
                + self.flat_copy_seconds(gradients, 0.0) + max(0, calls_b - 2) * per_call)

    def step_sync_latency(self, nbytes: float) -> float:
        """Seconds of :meth:`zero_collectives` of ``nbytes`` that no
        parameter's :meth:`state_collectives` carries: the per-message
        latency, which the step's one pair of collectives pays once (0 where
        nothing is reduced)."""
        return self._zero_latency if nbytes > 0 else 0.0

    def state_collectives(self, node: Node, s: Strategy) -> float:
        """Seconds one parameter adds to :meth:`zero_collectives` of its stage:
        those of its bytes less their per-message latency, which the stage's
        one pair of collectives pays once (:func:`planner.search.stage_dp.stage_times`
        adds it)."""
        nbytes = self.zero_bytes(node, s)
        if nbytes == 0:
            return 0.0
        return max(0.0, self.zero_collectives(nbytes) - self._zero_latency)
