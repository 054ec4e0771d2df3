"""Memory-bound kernels as ``planner profile`` times them: the share of the copy's bandwidth they reach.

The cost model prices a memory-bound kernel at its bytes over the device's
``memory_bandwidth`` times ``memory_efficiency``. The profile's bandwidth is a
plain copy's. A layer's memory-bound kernels move their bytes more slowly: a
norm reduces each row and re-reads it in the backward, an activation's
backward reads two tensors, a residual add three. The chain here is such
(a scale, a layer norm, GELU and a residual add over ``[rows, width]``,
summed): ``planner profile`` times its forward and
backward on the device, and the cost model prices the same chain's kernels
on one device (:func:`priced_chain`: their bytes and launches as
:class:`costmodel.strategy_cost.IntraOpCost` counts them).
:func:`chain_efficiency` is the bytes' time at the copy's bandwidth over the
measured time less the launches.

The figure is the eager kernels'; a compiled program's fused kernels are
priced at it too. Timed compiled on a GPU, a chain of this size measures
the host's cost of calling a compiled region (dynamo's guards,
AOTAutograd's wrappers) rather than its kernels, so it is timed eager there.
On CPU ranks the chain is timed compiled (:func:`chain_measurements`'s
``fused_chain``): there its fused kernels are bound by the work of applying
each op to each element (GELU's erf, the norm's divides, on one thread), not
by their bytes, and :func:`fused_element_rate` is the elements the cost
model counts for it (:func:`costmodel.fusion.fused_shares`) over its time.

Units: seconds, bytes, elements.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Mapping

__all__ = ["chain_efficiency", "chain_graph", "chain_measurements", "chain_step",
           "fused_element_rate", "priced_chain"]


def _chain_module(torch: Any, width: int) -> Any:
    """The chain as a module: ``x * scale`` (so the norm's input needs its
    gradient, as inside a model), layer norm, GELU, a residual add, the sum."""
    class MemoryBoundChain(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = torch.nn.Parameter(torch.ones(width))
            self.norm = torch.nn.LayerNorm(width)

        def forward(self, x: Any, residual: Any) -> Any:
            y = torch.nn.functional.gelu(self.norm(x * self.scale))
            return (y + residual).sum()

    return MemoryBoundChain()


def chain_graph(rows: int, width: int, dtype: str) -> Any:
    """The chain over ``[rows, width]`` in ``dtype``, captured (on meta)."""
    import torch

    from ir.trace import trace

    with torch.device("meta"):
        model = _chain_module(torch, width).to(getattr(torch, dtype))
        inputs = tuple(torch.empty(rows, width, dtype=getattr(torch, dtype)) for _ in range(2))
    return trace(model, inputs)


def priced_chain(rows: int, width: int, dtype: str, compiled: bool = False) -> dict[str, float]:
    """``{"bytes", "kernels"}`` the cost model charges one forward and
    backward of the chain over ``[rows, width]`` in ``dtype`` on one device,
    eager or ``compiled`` (then ``"elements"`` too: those its fused kernels
    make), found by pricing it on devices where a byte, a launch or an
    element costs one second and nothing else costs anything."""
    from torch.distributed.tensor import Replicate

    from costmodel.presets import load_cluster
    from costmodel.strategy_cost import IntraOpCost
    from ir.graph import OP
    from ir.strategy import Strategy

    graph = chain_graph(rows, width, dtype)
    base = load_cluster("local-cpu:1")
    free = {k: 1e30 for k in base.device.peak_flops} | {dtype: 1e30}
    out = {}
    units = [("bytes", 1.0, 0.0, 0.0), ("kernels", 1e30, 1.0, 0.0)]
    for key, bandwidth, launch, rate in units + ([("elements", 1e30, 0.0, 1.0)] if compiled else []):
        device = replace(base.device, peak_flops=free, memory_bandwidth=bandwidth,
                         memory_efficiency=1.0, kernel_overhead=launch, half_saturation_flops=0.0,
                         dispatch_overhead=0.0, host_overhead=0.0, attention_efficiency=0.0,
                         fused_element_rate=rate)
        cluster = replace(base, device=device)
        if compiled:
            cluster = cluster.running_compiled()
        cost = IntraOpCost(graph, cluster, (1,), dtype)
        total = 0.0
        for node in graph.nodes:
            if node.kind != OP:
                continue
            s = Strategy(tuple((Replicate(),) for _ in node.inputs),
                         tuple((Replicate(),) for _ in node.outputs))
            total += cost.forward_time(node, s) + sum(cost.backward_times(node, s))
        out[key] = total
    return out


def chain_step(torch: Any, device: Any, rows: int, width: int, dtype: str,
               compiled: bool = False) -> Callable[[], None]:
    """One forward and backward of the chain on ``device``, eager or its
    module through ``torch.compile`` (gradients dropped after each, so no
    accumulation runs)."""
    dt = getattr(torch, dtype)
    model = _chain_module(torch, width).to(device=device, dtype=dt)
    if compiled:
        model = torch.compile(model, dynamic=False)
    x = torch.randn(rows, width, device=device, dtype=dt)
    residual = torch.randn(rows, width, device=device, dtype=dt)

    def step() -> None:
        model(x, residual).backward()
        for p in model.parameters():
            p.grad = None
    return step


def chain_efficiency(record: Mapping[str, Any], bandwidth: float, overhead: float) -> float | None:
    """The share of ``bandwidth`` (bytes/s, the copy's) the chain's kernels
    reached: its priced bytes' time over the measured ``seconds`` less its
    priced launches at ``overhead`` seconds each, at most 1; None where it
    was not timed."""
    if "seconds" not in record or not record.get("bytes"):
        return None
    busy = record["seconds"] - record["kernels"] * overhead
    if busy <= 0:
        return None
    return min(1.0, record["bytes"] / bandwidth / busy)


def fused_element_rate(record: Mapping[str, Any], overhead: float) -> float | None:
    """Elements per second the compiled chain's kernels made: its priced
    elements over the measured ``seconds`` less its priced launches at
    ``overhead`` seconds each; None where it was not timed."""
    if "seconds" not in record or not record.get("elements"):
        return None
    busy = record["seconds"] - record["kernels"] * overhead
    return record["elements"] / busy if busy > 0 else None


def chain_measurements(r: Any, spec: Mapping[str, Any], out: dict[str, Any],
                       report: Callable[[str], None]
                       ) -> list[tuple[str, Callable[[], None], dict[str, Any]]]:
    """``planner profile``'s timings of the chain on rank ``r``'s device:
    ``(label, step, record)`` for ``spec["memory_chain"]`` (eager) and
    ``spec["fused_chain"]`` (compiled), each ``[rows, width, dtype]``; a
    record holds the priced bytes, launches (and elements), the timing adds
    its ``seconds``; also ``out[key]``. A chain that cannot compile here
    (no C++ compiler) is recorded in ``out["unsupported"]`` instead
    (:func:`costmodel.profiling.compiled_call.compiles`)."""
    from costmodel.profiling.compiled_call import compiles

    found = []
    for key in ("memory_chain", "fused_chain"):
        if not spec.get(key):
            continue
        rows, width, dtype = int(spec[key][0]), int(spec[key][1]), str(spec[key][2])
        compiled = key == "fused_chain"
        step = chain_step(r.torch, r.device, rows, width, dtype, compiled)
        if compiled and not compiles(step, out, key, int(spec["reps"]) + 1, report):
            continue
        out[key] = {"rows": rows, "width": width, "dtype": dtype,
                    **priced_chain(rows, width, dtype, compiled)}
        found.append(("fused memory-bound chain" if compiled else "memory-bound chain", step,
                      out[key]))
    return found
