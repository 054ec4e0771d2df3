"""Compute time of one kernel: a roofline plus a fixed launch overhead.

Units: seconds, FLOPs, bytes, FLOP/s, bytes/s.

    time = max(flops / (peak_flops[dtype] * efficiency),
               bytes_moved / (memory_bandwidth * memory_efficiency)) + kernel_overhead

This is the device's time. Eager PyTorch's host issues the kernels ahead of the
device, so a device busy with long kernels hides the host's time per op, and a
step of many short ones waits for the host: a step takes the longer of the two
sums (:func:`host_seconds` gives the host's), not the longer of the two per op.

The efficiencies and the overhead default to the :class:`DeviceSpec`'s
(calibrated by profiling later). For GEMMs, :func:`matmul_efficiency` gives a
size-dependent efficiency to pass as ``efficiency``; a GEMM with a dimension not
aligned to 16 bytes (:func:`gemm_aligned`) reaches
``DeviceSpec.unaligned_gemm_efficiency`` of it.
"""

from __future__ import annotations

from typing import Any

from typing import TYPE_CHECKING

from ir.node import PARAM

from .cluster import DEFAULT_FLOP_EFFICIENCY, DeviceSpec

if TYPE_CHECKING:
    from ir.graph import Graph, Node

__all__ = ["op_time", "matmul_efficiency", "attention_times", "backward_op_times", "backward_kernels",
           "dispatch_passes", "host_passes", "host_pass_counts", "host_seconds", "compiled_call_seconds",
           "pass_seconds",
           "gemm_aligned", "GEMM_ALIGNMENT_BYTES",
           "DEFAULT_HALF_SATURATION_FLOPS", "FUSED_ATTENTION", "ATTENTION_BACKWARD_FLOPS"]

#: FLOPs at which a GEMM reaches half its maximum efficiency. ~1e9 FLOPs (a
#: 800^3 GEMM) matches the usual picture on A100-class GPUs: small GEMMs cannot
#: fill the SMs, 4096^3 (1.4e11 FLOPs) is within 1% of the plateau.
DEFAULT_HALF_SATURATION_FLOPS = 1e9


def matmul_efficiency(
    flops: float,
    max_efficiency: float = DEFAULT_FLOP_EFFICIENCY,
    half_saturation_flops: float = DEFAULT_HALF_SATURATION_FLOPS,
) -> float:
    """Fraction of peak FLOP/s a GEMM of ``flops`` FLOPs reaches.

    ``max_efficiency * flops / (flops + half_saturation_flops)``: rises from 0,
    is ``max_efficiency / 2`` at ``half_saturation_flops`` and saturates at
    ``max_efficiency`` for large problems. A placeholder curve until profiling
    calibrates one per device.
    """
    if not flops >= 0:
        raise ValueError(f"flops must be >= 0, got {flops!r}")
    if not 0 < max_efficiency <= 1:
        raise ValueError(f"max_efficiency must be in (0, 1], got {max_efficiency!r}")
    if not half_saturation_flops > 0:
        raise ValueError(f"half_saturation_flops must be > 0, got {half_saturation_flops!r}")
    return max_efficiency * flops / (flops + half_saturation_flops)


def op_time(
    flops: float,
    bytes_moved: float,
    device: DeviceSpec,
    dtype: Any,
    efficiency: float | None = None,
    memory_efficiency: float | None = None,
    aligned: bool = True,
) -> float:
    """Seconds one kernel takes on ``device`` (the device's time; the host's
    is :func:`host_seconds`).

    Args:
        flops: floating-point operations of the kernel, FLOPs.
        bytes_moved: bytes read + written from device memory.
        device: the device (peak FLOP/s per dtype, memory bandwidth, overhead).
        dtype: compute dtype name or ``torch.dtype`` (see ``DeviceSpec.flops``).
        efficiency: fraction of peak FLOP/s reached; default
            ``device.flop_efficiency``, along the size curve
            :func:`matmul_efficiency` when ``device.half_saturation_flops > 0``.
        memory_efficiency: fraction of memory bandwidth reached; default
            ``device.memory_efficiency``.
        aligned: False for a GEMM with a dimension not aligned to 16 bytes
            (:func:`gemm_aligned`): its default efficiency is scaled by
            ``device.unaligned_gemm_efficiency``.

    Returns 0.0 when both ``flops`` and ``bytes_moved`` are 0 (no kernel runs,
    e.g. a view); otherwise the roofline time plus ``device.kernel_overhead``.
    """
    if not flops >= 0 or not bytes_moved >= 0:
        raise ValueError(f"flops and bytes_moved must be >= 0, got {flops!r} and {bytes_moved!r}")
    eff = device.flop_efficiency if efficiency is None else efficiency
    mem_eff = device.memory_efficiency if memory_efficiency is None else memory_efficiency
    if flops > 0 and not 0 < eff <= 1:
        raise ValueError(f"efficiency must be in (0, 1], got {eff!r}")
    if bytes_moved > 0 and not 0 < mem_eff <= 1:
        raise ValueError(f"memory_efficiency must be in (0, 1], got {mem_eff!r}")
    if flops == 0 and bytes_moved == 0:
        return 0.0
    if efficiency is None and flops > 0:
        if device.half_saturation_flops > 0:
            eff = matmul_efficiency(flops, eff, device.half_saturation_flops)
        if not aligned:
            eff *= device.unaligned_gemm_efficiency
    compute = flops / (device.flops(dtype) * eff) if flops > 0 else 0.0
    memory = bytes_moved / (device.memory_bandwidth * mem_eff) if bytes_moved > 0 else 0.0
    return max(compute, memory) + device.kernel_overhead


#: Row alignment tensor-core GEMM kernels need, bytes (8 bf16 or 4 fp32 elements).
GEMM_ALIGNMENT_BYTES = 16


def gemm_aligned(node: "Node") -> bool:
    """Whether contraction ``node``'s matrices have every row length and row count
    a multiple of :data:`GEMM_ALIGNMENT_BYTES` (the last two dimensions of each
    floating input and output of two or more dimensions; a GEMM's backward
    makes the transposed products of the same matrices, so one answer holds for
    all three). True for a node that is no contraction."""
    if node.flops <= 0 or node.target == FUSED_ATTENTION:
        return True
    for info in (*node.inputs, *node.outputs):
        if not info.is_float or len(info.shape) < 2 or info.itemsize <= 0:
            continue
        align = max(1, GEMM_ALIGNMENT_BYTES // info.itemsize)
        if any(int(d) % align for d in info.shape[-2:]):
            return False
    return True


def backward_op_times(flops: float, bytes_moved: float, device: DeviceSpec, dtype: Any, *,
                      input_grad: int, weight_grad: int, aligned: bool = True
                      ) -> tuple[float, float]:
    """Seconds of one op's backward, split as zero-bubble schedules need it.

    Returns ``(b, w)``: ``b`` computes the gradients of the op's activation inputs,
    ``w`` those of its weights, each as ``input_grad`` / ``weight_grad`` kernels
    (:func:`backward_kernels`) of the forward's size: a contraction costs its
    forward FLOPs again for each operand's gradient (dX = dY W^T and dW = X^T dY;
    dQ = dS K and dK = dS^T Q); a memory-bound op re-reads and re-writes about its
    forward bytes for the input gradient, and as much again when it also has
    weights (layer-norm scale and bias).

    Args:
        flops, bytes_moved: the op's forward FLOPs and bytes.
        input_grad: kernels computing activation-input gradients (0 for none).
        weight_grad: kernels computing weight gradients (0 for none).
        aligned: as :func:`op_time`'s.
    """
    one = (op_time(flops, bytes_moved, device, dtype, aligned=aligned)
           if input_grad or weight_grad else 0.0)
    return int(input_grad) * one, int(weight_grad) * one


def backward_kernels(node: "Node", requires_grad: "set[str] | frozenset[str]",
                     param_derived: "set[str] | frozenset[str]") -> tuple[int, int]:
    """Kernels the backward of op ``node`` runs: ``(input, weight)``, for the
    gradients of its activation inputs and of its weights.

    A contraction (``node.flops > 0``) runs one per operand that needs a
    gradient: one per activation operand (both of ``Q K^T``) and one for the
    weight. Another op runs one kernel for all its activation inputs and one
    for its weights. The fused attention kernel has one backward for q, k and v.
    ``requires_grad``: names of the values that need a gradient;
    ``param_derived``: those computed from parameters alone (weights)."""
    activations = [a for a in dict.fromkeys(node.args)
                   if a in requires_grad and a not in param_derived]
    weights = any(a in param_derived for a in node.args)
    if node.target == FUSED_ATTENTION:
        return int(bool(activations)), 0
    inputs = len(activations) if node.flops > 0 else int(bool(activations))
    return inputs, int(weights)


#: The captured node of ``F.scaled_dot_product_attention``, run as one fused kernel.
FUSED_ATTENTION = "aten.scaled_dot_product_attention.default"

#: Backward FLOPs of the flash-attention kernel over its forward FLOPs: the
#: backward recomputes the scores (``Q K^T``) and computes dV, dP, dQ and dK,
#: five products against the forward's two (Dao, FlashAttention-2, 2023, Sec. 3).
ATTENTION_BACKWARD_FLOPS = 2.5


def attention_times(flops: float, bytes_moved: float, device: DeviceSpec,
                    dtype: Any) -> tuple[float, float]:
    """Seconds of the fused attention kernel's forward and backward.

    ``flops``: forward FLOPs it executes (``ir.exported_graph.attention_flops``: half
    the score matrix under a causal mask); ``bytes_moved``: its forward bytes
    (q, k, v and the output, of order b·h·s·d; the s x s scores stay on chip).
    The backward does :data:`ATTENTION_BACKWARD_FLOPS` times the forward FLOPs
    and reads about twice the bytes (the saved output, the log-sum-exp and the
    output gradient besides q, k, v). Both run at the efficiency the profile
    fitted for the kernel's forward-and-backward FLOPs
    (``device.attention_efficiency`` and ``attention_half_saturation_flops``),
    else along the GEMM efficiency curve.
    """
    eff = None
    if device.attention_efficiency > 0:
        work = (1 + ATTENTION_BACKWARD_FLOPS) * flops  # along the curve the profile fitted
        eff = device.attention_efficiency * work / (work + device.attention_half_saturation_flops)
        if not eff > 0:
            eff = device.attention_efficiency
    forward = op_time(flops, bytes_moved, device, dtype, efficiency=eff)
    backward = op_time(ATTENTION_BACKWARD_FLOPS * flops, 2 * bytes_moved, device, dtype,
                       efficiency=eff)
    return forward, backward


def host_pass_counts(graph: "Graph") -> tuple[int, int]:
    """Ops the host issues in one training step of ``graph``: ``(forward,
    backward)``. Every op but tuple projections once in the forward; in the
    backward a view once and another op's :func:`backward_kernels`."""
    grad, weights = graph.gradient_path, graph.parameter_views
    forward = backward = 0
    for n in graph.nodes:
        if n.kind != "op" or n.target == "getitem":
            continue
        forward += 1
        if n.name not in grad:
            continue
        backward += 1 if n.is_view else sum(backward_kernels(n, grad, weights))
    return forward, backward


def host_passes(graph: "Graph") -> int:
    """Ops the host issues in one training step of ``graph``, forward and
    backward (:func:`host_pass_counts`): what ``planner profile`` divides a
    host-bound step's time by to measure ``DeviceSpec.host_overhead``."""
    return sum(host_pass_counts(graph))


def dispatch_passes(graph: "Graph") -> int:
    """Op passes of one training step of ``graph`` that each pay
    ``DeviceSpec.dispatch_overhead`` (:class:`costmodel.strategy_compute`):
    every op but tuple projections once in the forward, and again in the
    backward where it is on the gradient path. What ``planner profile``
    divides the runtime's extra seconds by (:mod:`codegen.runtime_probe`)."""
    grad = graph.gradient_path
    ops = [n for n in graph.nodes if n.kind == "op" and n.target != "getitem"]
    return len(ops) + sum(1 for n in ops if n.name in grad)


def host_seconds(graph: "Graph", device: DeviceSpec) -> tuple[float, float]:
    """Host seconds to issue one step of ``graph``: ``(forward, backward)``, each
    ``device.host_overhead`` per op pass (0 where the host is never the bottleneck).
    A pass of the step takes at least this long whatever its kernels take.

    A compiled program (``device.compiled``) issues no op through the eager
    runtime: its generated code launches its kernels, without dispatch or
    autograd bookkeeping, and that launch cost is not priced (0, 0)."""
    if device.compiled:
        return 0.0, 0.0
    forward, backward = host_pass_counts(graph)
    return forward * device.host_overhead, backward * device.host_overhead


def pass_seconds(device_s: float, host_s: float, call_s: float, device: DeviceSpec) -> float:
    """Seconds of a pass whose kernels take the device ``device_s``, whose eager
    ops take the host ``host_s`` to issue (:func:`host_seconds`) and whose
    compiled regions' calls cost the host ``call_s`` beyond their kernels
    (:func:`compiled_call_seconds`). Where the host queues kernels ahead of
    the device (a GPU: ``device.host_overhead`` measured), all the host's
    time overlaps the kernels and the pass takes the longer of the two; where
    host and device are one (CPU ranks), the calls add to the kernels' time."""
    if device.host_overhead > 0:
        return max(device_s, host_s + call_s)
    return max(device_s, host_s) + call_s


def compiled_call_seconds(graph: "Graph", device: DeviceSpec,
                          calls: tuple[int, int] = (1, 0)) -> tuple[float, float]:
    """Host seconds of one pass of ``graph`` run as compiled regions, beyond
    their kernels: ``(forward, backward)``. ``calls``: the regions' calls in
    the forward (one, a ZeRO-3 stage's one per unit, or with its checkpointed
    layers compiled on their own) and in the backward (those layers'
    recomputation): :meth:`costmodel.strategy_cost.IntraOpCost.region_calls`.
    Each call costs ``device.compiled_call_overhead``, and each parameter
    ``device.compiled_param_overhead`` in the backward (its guard and the
    eager accumulation of its gradient); (0, 0) for an eager program. A
    stage pays it once per micro-batch."""
    if not device.compiled:
        return 0.0, 0.0
    params = sum(1 for n in graph.nodes if n.kind == PARAM)
    forward, backward = calls
    return (forward * device.compiled_call_overhead,
            backward * device.compiled_call_overhead + params * device.compiled_param_overhead)
