"""Memory-bound kernels as ``planner profile`` times them: the share of the copy's bandwidth they reach.

The cost model prices a memory-bound kernel at its bytes over the device's
``memory_bandwidth`` times ``memory_efficiency``. The profile's bandwidth is a
plain copy's. A layer's memory-bound kernels move their bytes more slowly: a
norm reduces each row and re-reads it in the backward, an activation's
backward reads two tensors, a residual add three. :class:`MemoryBoundChain`
is such a chain (a scale, a layer norm, GELU and a residual add over
``[rows, width]``, summed): ``planner profile`` times its forward and
backward on the device, eager and compiled, and the cost model prices the
same chain's kernels on one device (:func:`priced_chain`: their bytes and
launches as :class:`costmodel.strategy_cost.IntraOpCost` counts them, fused
where compiled). :func:`chain_efficiency` is the bytes' time at the copy's
bandwidth over the measured time less the launches.

Units: seconds, bytes.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Mapping

__all__ = ["chain_efficiency", "chain_items", "chain_step", "priced_chain"]


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


def priced_chain(rows: int, width: int, dtype: str, compiled: bool) -> dict[str, float]:
    """``{"bytes", "kernels"}`` the cost model charges one forward and backward
    of the chain over ``[rows, width]`` in ``dtype`` on one device (run
    compiled: its fused chains), found by pricing it on devices where a
    byte, or a launch, costs one second and nothing else costs anything."""
    import torch
    from torch.distributed.tensor import Replicate

    from costmodel.presets import load_cluster
    from costmodel.strategy_cost import IntraOpCost
    from ir.graph import OP
    from ir.strategy import Strategy
    from ir.trace import trace

    with torch.device("meta"):
        model = _chain_module(torch, width).to(getattr(torch, dtype))
        inputs = tuple(torch.empty(rows, width, dtype=getattr(torch, dtype)) for _ in range(2))
    graph = trace(model, inputs)
    base = load_cluster("local-cpu:1")
    free = {k: 1e30 for k in base.device.peak_flops} | {dtype: 1e30}
    out = {}
    for key, bandwidth, launch in (("bytes", 1.0, 0.0), ("kernels", 1e30, 1.0)):
        device = replace(base.device, peak_flops=free, memory_bandwidth=bandwidth,
                         memory_efficiency=1.0, kernel_overhead=launch, half_saturation_flops=0.0,
                         dispatch_overhead=0.0, host_overhead=0.0, attention_efficiency=0.0)
        cluster = replace(base, device=device).running_compiled(compiled)
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
               compiled: bool) -> Callable[[], None]:
    """One forward and backward of the chain on ``device`` (gradients dropped
    after each, so no accumulation runs); ``compiled``: through
    ``torch.compile``, its first call compiling."""
    dt = getattr(torch, dtype)
    model = _chain_module(torch, width).to(device=device, dtype=dt)
    x = torch.randn(rows, width, device=device, dtype=dt)
    residual = torch.randn(rows, width, device=device, dtype=dt)
    run = torch.compile(model) if compiled else model

    def step() -> None:
        run(x, residual).backward()
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


def chain_items(r: Any, shape: tuple[int, int, str], reps: int, min_rep_s: float,
                out: dict[str, Any], report: Callable[[str], None]) -> list[Any]:
    """``planner profile``'s timed items of the chain over ``shape`` (rows,
    width, dtype), eager and compiled; each records its priced bytes and
    launches beside its ``seconds`` into ``out["memory_chain"]``. A chain
    that cannot compile here is recorded in ``out["unsupported"]``, and its
    progress steps reported as done."""
    from costmodel.profiling.worker import TimedItem

    rows, width, dtype = int(shape[0]), int(shape[1]), str(shape[2])
    records: dict[str, Any] = {"rows": rows, "width": width, "dtype": dtype}
    items = []
    for kind, compiled in (("eager", False), ("compiled", True)):
        step = chain_step(r.torch, r.device, rows, width, dtype, compiled)
        try:
            step()  # compiles, allocates
        except Exception as err:  # noqa: BLE001 - the figure stays unmeasured, with the reason
            out.setdefault("unsupported", {})[f"memory_chain {kind}"] = \
                f"{type(err).__name__}: {(str(err).splitlines() or [''])[0][:200]}"
            for _ in range(reps + 1):
                report(f"memory-bound chain ({kind}) unsupported")
            continue
        rec = records[kind] = priced_chain(rows, width, dtype, compiled)
        items.append(TimedItem(f"memory-bound chain, {kind}", step, min_rep_s, False, rec))
    out["memory_chain"] = records
    return items
