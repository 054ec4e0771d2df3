"""The distributed runtime's host costs, as ``planner profile`` measures them.

Two pairs of steps, each timed plain and distributed on every rank at once
(the worker's timing, :class:`costmodel.profiling.worker.ItemRunner`):

* ``dispatch``: the forward and backward of a chain of :data:`DISPATCH_CHAIN`
  tiny multiplications and a sum, on a plain tensor and on a replicated
  DTensor; the difference per op and pass is DTensor's dispatch cost (the
  fallback of ``DeviceSpec.dispatch_overhead`` where the planner's own runtime
  was not timed: :mod:`codegen.runtime_probe`);
* ``fsdp_unit``: the forward and backward of :data:`FSDP_UNITS` tiny linear
  layers, plain and with each layer an FSDP2 unit (``fully_shard`` over all
  ranks, resharded after its forward): each unit's step makes three
  collective calls (its forward's all-gather, its backward's all-gather and
  reduce-scatter) of a few hundred bytes, so the difference is what such a
  call costs beyond the bytes it moves: FSDP2's hooks, the set-up of its
  copies and the collective's latency (``DeviceSpec.fsdp_call_overhead``).

Each function returns ``(label, step, record)`` triples for the worker to
time; ``record`` is the dict (inside ``out``) the timing goes into.
Units: seconds.
"""

from __future__ import annotations

from typing import Any, Callable

__all__ = ["DISPATCH_CHAIN", "FSDP_CALLS_PER_UNIT", "FSDP_UNITS", "dispatch_steps", "fsdp_unit_steps"]

#: Elementwise ops in the dispatch chain (plus the final sum).
DISPATCH_CHAIN = 16

#: FSDP2 units in the measured model.
FSDP_UNITS = 8

#: Collective calls of one resharded FSDP2 unit in a step: the forward's
#: all-gather, the backward's all-gather and reduce-scatter.
FSDP_CALLS_PER_UNIT = 3

#: Features of each measured FSDP2 unit's linear layer (its parameters: a few KiB).
_FSDP_FEATURES = 16

Steps = list[tuple[str, Callable[[], Any], dict[str, Any]]]


def _chain(x: Any) -> None:
    """Forward and backward of ``DISPATCH_CHAIN`` multiplications and a sum."""
    y = x
    for _ in range(DISPATCH_CHAIN):
        y = y * 1.0001
    y.sum().backward()


def dispatch_steps(torch: Any, device: Any, world: int, out: dict[str, Any]) -> Steps:
    """The same chain of tiny ops on a plain tensor and on a replicated
    DTensor over ``world`` ranks; records into ``out["dispatch"]``."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    mesh = DeviceMesh(device.type, list(range(world)))
    plain = torch.ones(64, device=device, requires_grad=True)
    dtensor = distribute_tensor(torch.ones(64, device=device), mesh, [Replicate()])
    dtensor.requires_grad_()
    out["dispatch"] = {"ops": DISPATCH_CHAIN + 1, "plain": {}, "dtensor": {}}
    return [(f"dispatch {kind}", (lambda x: lambda: _chain(x))(x), out["dispatch"][kind])
            for kind, x in (("plain", plain), ("dtensor", dtensor))]


def _training_step(torch: Any, model: Any, x: Any) -> Callable[[], None]:
    """Forward and backward of ``model`` on ``x``, its gradients dropped after."""
    def step() -> None:
        model(x).sum().backward()
        for p in model.parameters():
            p.grad = None
    return step


def fsdp_unit_steps(torch: Any, device: Any, world: int, out: dict[str, Any]) -> Steps:
    """:data:`FSDP_UNITS` tiny linear layers, plain and as FSDP2 units over
    ``world`` ranks; records into ``out["fsdp_unit"]``."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    mesh = DeviceMesh(device.type, list(range(world)))

    def layers() -> Any:
        torch.manual_seed(0)
        return torch.nn.Sequential(*[torch.nn.Linear(_FSDP_FEATURES, _FSDP_FEATURES)
                                     for _ in range(FSDP_UNITS)]).to(device)

    plain, sharded = layers(), layers()
    for layer in sharded:
        fully_shard(layer, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    x = torch.ones(8, _FSDP_FEATURES, device=device)
    out["fsdp_unit"] = {"units": FSDP_UNITS, "calls_per_unit": FSDP_CALLS_PER_UNIT,
                        "plain": {}, "sharded": {}}
    return [(f"fsdp2 units {kind}", _training_step(torch, model, x), out["fsdp_unit"][kind])
            for kind, model in (("plain", plain), ("sharded", sharded))]
