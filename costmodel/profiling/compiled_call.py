"""The host's cost of calling a compiled region, as ``planner profile`` measures it.

A plan run with ``--compile`` calls one compiled region per stage and
micro-batch. Beyond its kernels, each call costs the host dynamo's guards,
AOTAutograd's wrappers, DTensor's unwrapping and wrapping of the region's
inputs and outputs, and, per parameter, its guard and the eager accumulation of
its gradient (outside the graph). :func:`region_call_fn` builds such a region
of ``k`` replicated DTensor parameters over a few elements each, so that its
call is nearly all host work; timed at two or more ``k`` (the gradients
accumulating, as in every micro-batch after the first), :func:`fit_call_overheads`
gives the seconds per call and per parameter (``DeviceSpec.compiled_call_overhead``
and ``compiled_param_overhead``).

Units: seconds.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

__all__ = ["compiles", "fit_call_overheads", "region_call_fn"]

#: elements of each parameter of the measured region: its kernels are host-bound
_ELEMENTS = 8


def compiles(fn: Callable[[], Any], out: dict[str, Any], key: str, steps: int,
             report: Callable[[str], None]) -> bool:
    """Call ``fn``, whose first call compiles; False where that fails here (no
    C++ compiler, no Triton): the failure's first line is recorded as
    ``out["unsupported"][key]`` and the ``steps`` progress steps its timing
    would have taken reported as done."""
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - any compile failure leaves the figure unmeasured
        out.setdefault("unsupported", {})[key] = \
            f"{type(err).__name__}: {(str(err).splitlines() or [''])[0][:200]}"
        for _ in range(steps):
            report(f"{key.replace('_', ' ')} unsupported")
        return False
    return True


def region_call_fn(torch: Any, mesh: Any, params: int) -> Callable[[], None]:
    """One forward and backward call of a compiled region that multiplies a
    replicated activation by each of ``params`` replicated DTensor parameters
    on ``mesh``; its first call compiles it (inductor)."""
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

    device = mesh.device_type
    weights = [distribute_tensor(torch.ones(_ELEMENTS, device=device), mesh, [Replicate()])
               .requires_grad_() for _ in range(params)]
    x = torch.ones(_ELEMENTS, device=device)

    def program(x: Any, *ws: Any) -> Any:
        y = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
        for w in ws:
            y = y * w
        return y.to_local().sum()

    region = torch.compile(program)

    def call() -> None:
        region(x, *weights).backward()
    return call


def fit_call_overheads(records: Sequence[Mapping[str, Any]]) -> tuple[float, float] | None:
    """``(seconds per call, seconds per parameter)``: the least-squares line
    through the records' ``seconds`` against their ``params``, each part at
    least 0; None when fewer than two parameter counts were timed."""
    points = [(float(r["params"]), float(r["seconds"])) for r in records if "seconds" in r]
    if len({k for k, _ in points}) < 2:
        return None
    n = len(points)
    mean_k = sum(k for k, _ in points) / n
    mean_s = sum(s for _, s in points) / n
    slope = (sum((k - mean_k) * (s - mean_s) for k, s in points)
             / sum((k - mean_k) ** 2 for k, _ in points))
    slope = max(0.0, slope)
    return max(0.0, mean_s - slope * mean_k), slope
