"""Peak CUDA memory of one training step: a plain eager loop and the plan's executor.

Used by ``benchmarks/memory_fidelity.py --device cuda``. Both sides train the same
model (seed 0) with AdamW (foreach), gradients set to None after each step, in this
one process on one GPU:

* plain: :class:`benchmarks.plain_loop.PlainLoop` with the plan's checkpointed layers;
* runtime: :func:`codegen.parallel_model.parallelize` of the plan, what
  ``planner run`` and ``planner train`` build on a rank, and the training job's step;
* executor: :class:`codegen.executor.PlanExecutor` of the plan on a one-device
  mesh, the model built here and handed to it.

Each peak is ``torch.cuda.max_memory_allocated`` of one step after the statistics
are reset: the first step (the optimizer's states are made in it) and a later,
steady-state one; beside it the allocator's reserved peak and the device memory
in use (``mem_get_info``: with the CUDA context and libraries' workspaces). With
``breakdown``, the steady step runs again under the allocator's history
(:func:`ir.torch_compat.cuda_memory_history`) and the allocations live at its peak
are listed by size, with the Python frames that made them, so that a gap between
the two sides can be put on tensors. Units: bytes.
"""

from __future__ import annotations

import collections
import gc
from typing import Any, Callable, Sequence

import torch

#: allocations listed per breakdown (the largest groups of equal size)
BREAKDOWN_GROUPS = 16
_HISTORY_ENTRIES = 400_000


def _frames(entry: dict[str, Any], keep: int = 3) -> list[str]:
    """The innermost ``keep`` Python frames of an allocation outside torch's own
    files, as ``file:line:function``."""
    out = []
    for f in entry.get("frames", []):
        name = f.get("filename", "")
        if not name.endswith(".py") or "/torch/" in name:
            continue
        out.append(f"{name.rsplit('/', 2)[-1]}:{f.get('line')}:{f.get('name')}")
        if len(out) == keep:
            break
    return out


def peak_breakdown(step: Callable[[], Any], device: torch.device) -> dict[str, Any]:
    """Run ``step`` under the allocator's history and return what was live at its
    peak: ``{"before_bytes", "peak_bytes", "in_step_at_peak_bytes", "groups": [{"size",
    "count", "bytes", "frames"}]}`` (bytes; groups of equal-size allocations made in
    the step and live at the peak, largest first)."""
    from ir.torch_compat import cuda_memory_history

    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    with cuda_memory_history(_HISTORY_ENTRIES) as history:
        step()
        torch.cuda.synchronize(device)
    trace = history["snapshot"]["device_traces"][device.index or 0]
    live: dict[int, dict[str, Any]] = {}
    current = peak = 0
    at_peak: list[dict[str, Any]] = []
    for entry in trace:
        action = entry.get("action")
        if action == "alloc":
            live[entry["addr"]] = entry
            current += entry["size"]
            if current > peak:
                peak = current
                at_peak = list(live.values())
        elif action == "free_completed" and entry["addr"] in live:
            current -= live.pop(entry["addr"])["size"]
    groups: dict[tuple[int, tuple[str, ...]], list[int]] = collections.defaultdict(list)
    for entry in at_peak:
        groups[entry["size"], tuple(_frames(entry))].append(entry["size"])
    listed = sorted(({"size": size, "count": len(v), "bytes": sum(v), "frames": list(frames)}
                     for (size, frames), v in groups.items()), key=lambda g: -g["bytes"])
    return {"before_bytes": int(before), "peak_bytes": int(before + peak),
            "in_step_at_peak_bytes": int(peak), "groups": listed[:BREAKDOWN_GROUPS]}


def step_peaks(step: Callable[[], Any], device: torch.device, *, steady_after: int = 1,
               breakdown: bool = False) -> dict[str, Any]:
    """``max_memory_allocated`` of the first step and of a steady one (after
    ``steady_after`` more steps), each from a reset; bytes."""
    out: dict[str, Any] = {"kind": "cuda_max_allocated"}
    for key, steps in (("first", 1), ("steady", steady_after + 1)):
        for _ in range(steps - 1):
            step()
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        out[f"{key}_before_bytes"] = int(torch.cuda.memory_allocated(device))
        step()
        torch.cuda.synchronize(device)
        out[f"{key}_peak_bytes"] = int(torch.cuda.max_memory_allocated(device))
    out["peak_bytes"] = out["steady_peak_bytes"]
    # beyond the tensors: the caching allocator's segments (rounding and
    # fragmentation) and everything else on the device (the CUDA context, library
    # workspaces, NCCL), as the driver counts it
    out["reserved_peak_bytes"] = int(torch.cuda.max_memory_reserved(device))
    free, total = torch.cuda.mem_get_info(device)
    out["device_used_bytes"] = int(total - free)
    out["reserved_bytes"] = int(torch.cuda.memory_reserved(device))
    if breakdown:
        out["breakdown"] = peak_breakdown(step, device)
    return out


def _release(device: torch.device) -> None:
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()


def plain_peaks(build: Callable[[], tuple[torch.nn.Module, tuple]], precision: str,
                checkpoint: Sequence[str], device: torch.device, *,
                breakdown: bool = False) -> dict[str, Any]:
    """:func:`step_peaks` of a plain loop of ``build()``'s model (on ``device``)."""
    from benchmarks.plain_loop import PlainLoop

    _release(device)
    torch.manual_seed(0)
    model, inputs = build()
    loop = PlainLoop(model, inputs, precision=precision, checkpoint=checkpoint)
    del model
    try:
        return step_peaks(loop.step, device, breakdown=breakdown)
    finally:
        del loop
        _release(device)


def _training_step_peaks(forward_backward: Callable[[], Any], opt: Any, device: torch.device,
                         breakdown: bool) -> dict[str, Any]:
    """:func:`step_peaks` of a training step: ``forward_backward()``, then
    ``opt``'s step and its gradients set to None."""
    def step() -> None:
        forward_backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step_peaks(step, device, breakdown=breakdown)


def runtime_peaks(build: Callable[[], tuple[torch.nn.Module, tuple]], plan: Any,
                  device: torch.device, *, from_source: bool, breakdown: bool = False
                  ) -> dict[str, Any]:
    """:func:`step_peaks` of the planner's own runtime: :func:`codegen.parallel_model.parallelize`
    of the plan, what ``planner run`` and ``planner train`` build on a rank (with
    ``from_source`` the plan's model source built on meta by the runtime, each
    tensor materialised alone; else ``build()``'s model handed over), its
    ``optimizer(AdamW, foreach=True)`` and the training job's step (``step``,
    ``opt.step()``, ``zero_grad(set_to_none=True)``). The default process group
    (one rank) must exist."""
    from codegen.parallel_model import parallelize

    _release(device)
    torch.manual_seed(0)
    model, inputs = build()
    if from_source:
        del model
        runtime = parallelize(plan)
    else:
        runtime = parallelize(plan, model, inputs)
        del model
    _release(device)
    opt = runtime.optimizer(torch.optim.AdamW, lr=1e-4, foreach=True)
    try:
        return _training_step_peaks(lambda: runtime.step(*inputs), opt, device, breakdown)
    finally:
        del runtime, opt, inputs
        _release(device)


def executor_peaks(build: Callable[[], tuple[torch.nn.Module, tuple]], plan: Any,
                   mesh: Any, device: torch.device, *, breakdown: bool = False
                   ) -> dict[str, Any]:
    """:func:`step_peaks` of the plan's executor (``mesh``: a one-device CUDA mesh)
    training ``build()``'s model."""
    from codegen.executor import PlanExecutor
    from codegen.plan_model import loss_of

    _release(device)
    torch.manual_seed(0)
    model, inputs = build()
    executor = PlanExecutor(plan, model, inputs, mesh)
    del model
    opt = torch.optim.AdamW(list(executor.parameters()), lr=1e-4, foreach=True)
    try:
        return _training_step_peaks(lambda: loss_of(executor(*inputs)).backward(), opt, device,
                                    breakdown)
    finally:
        del executor, opt, inputs
        _release(device)
