"""The distributed runtime's host costs, as ``planner profile`` measures them.

Four pairs of steps, each timed plain and as the runtime runs it, on every
rank at once (the worker's timing, :class:`costmodel.profiling.worker.ItemRunner`):

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
  copies and the collective's latency (``DeviceSpec.fsdp_call_overhead``);
* ``pipeline``: a step of torch.distributed.pipelining's 1F1B schedule over
  one stage of a tiny linear layer a rank, :data:`PIPELINE_MICROBATCHES` micro-batches,
  and (plain) the same micro-batches' forwards and backwards of the rank's
  layer: the schedule's own work per action (its bookkeeping, posting and
  waiting for its sends and receives), fitted through the schedule's timing
  model (``DeviceSpec.pipeline_action_overhead``, :func:`pipeline_action_overhead`),
  the fallback where the planner's own pipeline was not timed
  (:mod:`codegen.pipeline_probe`, :func:`runtime_pipeline_action`);
* ``split_backward``: the forward and backward of :data:`SPLIT_GROUPS` tiny
  residual layers of one weight each, the backward whole and split as the
  zero-bubble schedules' ``I`` and ``W`` actions run it
  (:func:`ir.torch_compat.split_backward.split_backward`): each weight is a
  group of its own, so the difference per layer is what the split costs a
  parameter group (``DeviceSpec.split_backward_group_overhead``,
  :func:`split_backward_group_overhead`).

Each function takes the worker's :class:`costmodel.profiling.worker.Rank`
and returns ``(label, step, record)`` triples for it to time; ``record`` is
the dict (inside ``out``) the timing goes into.
Units: seconds.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from costmodel.cluster import Link
from costmodel.schedules.timing import simulate

__all__ = ["DISPATCH_CHAIN", "FSDP_CALLS_PER_UNIT", "FSDP_UNITS", "PIPELINE_MICROBATCHES",
           "dispatch_steps", "dropping_gradients", "fit_action_overhead", "fsdp_unit_steps",
           "pipeline_action_overhead", "pipeline_steps", "runtime_pipeline_action",
           "SPLIT_GROUPS", "split_backward_group_overhead", "split_backward_steps", "timed_pair"]

#: Elementwise ops in the dispatch chain (plus the final sum).
DISPATCH_CHAIN = 16

#: FSDP2 units in the measured model.
FSDP_UNITS = 8

#: Collective calls of one resharded FSDP2 unit in a step: the forward's
#: all-gather, the backward's all-gather and reduce-scatter.
FSDP_CALLS_PER_UNIT = 3

#: Features of each measured FSDP2 unit's and pipeline stage's linear layer
#: (its parameters: a few KiB).
_FEATURES = 16

#: Micro-batches of the measured pipeline step.
PIPELINE_MICROBATCHES = 8

#: Layers (each one weight, one parameter group) of the measured split backward.
SPLIT_GROUPS = 16

Steps = list[tuple[str, Callable[[], Any], dict[str, Any]]]


def _chain(x: Any) -> None:
    """Forward and backward of ``DISPATCH_CHAIN`` multiplications and a sum."""
    y = x
    for _ in range(DISPATCH_CHAIN):
        y = y * 1.0001
    y.sum().backward()


def dispatch_steps(r: Any, out: dict[str, Any]) -> Steps:
    """The same chain of tiny ops on a plain tensor and on a replicated
    DTensor over all ranks; records into ``out["dispatch"]``."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    torch, device = r.torch, r.device
    mesh = DeviceMesh(device.type, list(range(r.world)))
    plain = torch.ones(64, device=device, requires_grad=True)
    dtensor = distribute_tensor(torch.ones(64, device=device), mesh, [Replicate()])
    dtensor.requires_grad_()
    out["dispatch"] = {"ops": DISPATCH_CHAIN + 1, "plain": {}, "dtensor": {}}
    return [(f"dispatch {kind}", (lambda x: lambda: _chain(x))(x), out["dispatch"][kind])
            for kind, x in (("plain", plain), ("dtensor", dtensor))]


def dropping_gradients(step: Callable[[], Any], params: Callable[[], Any]) -> Callable[[], None]:
    """``step`` (a forward and backward), then every gradient of ``params()``
    set to None, as a training step's optimizer leaves them."""
    def run() -> None:
        step()
        for p in params():
            p.grad = None
    return run


def timed_pair(raw: Mapping[str, Any], key: str, plain: str, timed: str
               ) -> tuple[Mapping[str, Any], float, float] | None:
    """The record ``raw[key]`` of one of these pairs of steps, with the
    seconds of its ``plain`` and its ``timed`` step; None where the record or
    either step's time is missing (not measured)."""
    rec = raw.get(key)
    if not rec or "seconds" not in rec.get(plain, {}) or "seconds" not in rec.get(timed, {}):
        return None
    return rec, rec[plain]["seconds"], rec[timed]["seconds"]


def fsdp_unit_steps(r: Any, out: dict[str, Any]) -> Steps:
    """:data:`FSDP_UNITS` tiny linear layers, plain and as FSDP2 units over
    all ranks; records into ``out["fsdp_unit"]``."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    torch, device = r.torch, r.device
    mesh = DeviceMesh(device.type, list(range(r.world)))

    def layers() -> Any:
        torch.manual_seed(0)
        return torch.nn.Sequential(*[torch.nn.Linear(_FEATURES, _FEATURES)
                                     for _ in range(FSDP_UNITS)]).to(device)

    plain, sharded = layers(), layers()
    for layer in sharded:
        fully_shard(layer, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    x = torch.ones(8, _FEATURES, device=device)
    out["fsdp_unit"] = {"units": FSDP_UNITS, "calls_per_unit": FSDP_CALLS_PER_UNIT,
                        "plain": {}, "sharded": {}}
    def step(model: Any) -> Callable[[], None]:
        return dropping_gradients(lambda: model(x).sum().backward(), model.parameters)

    record = out["fsdp_unit"]
    return [("fsdp2 units plain", step(plain), record["plain"]),
            ("fsdp2 units sharded", step(sharded), record["sharded"])]


def pipeline_steps(r: Any, out: dict[str, Any]) -> Steps:
    """A 1F1B step over one stage of a tiny linear layer a rank, and the same
    micro-batches through the rank's layer plainly; records into
    ``out["pipeline"]``."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    torch, device, world, rank = r.torch, r.device, r.world, r.rank
    torch.manual_seed(0)
    layer = torch.nn.Linear(_FEATURES, _FEATURES).to(device)
    m, rows = PIPELINE_MICROBATCHES, 2
    batch = torch.ones(m * rows, _FEATURES, device=device)
    stage = PipelineStage(layer, rank, world, device)
    schedule = Schedule1F1B(stage, m, loss_fn=lambda y, _target: y.sum())

    def pipelined() -> None:
        if rank == 0:
            schedule.step(batch)
        elif rank == world - 1:
            schedule.step(target=batch)
        else:
            schedule.step()

    def plain() -> None:
        for x in batch.chunk(m):
            layer(x.requires_grad_()).sum().backward()

    out["pipeline"] = {"schedule": "1f1b", "stages": world, "microbatches": m,
                       "activation_bytes": rows * _FEATURES * batch.element_size(),
                       "plain": {}, "pipelined": {}}
    record = out["pipeline"]
    return [("pipeline plain", dropping_gradients(plain, layer.parameters), record["plain"]),
            ("pipeline 1f1b", dropping_gradients(pipelined, layer.parameters), record["pipelined"])]


def fit_action_overhead(schedule: str, stages: int, m: int, forward_s: float, backward_s: float,
                        p2p_s: float, measured_s: float) -> float:
    """The ``c`` for which the schedule's timing model
    (:func:`costmodel.schedules.timing.simulate`), each forward ``forward_s +
    c``, each backward ``backward_s + c`` and each send ``p2p_s``, gives the
    ``measured_s`` step; 0 where the model without it is already as slow."""
    def step(c: float) -> float:
        return simulate(schedule, stages, m, forward_s + c, backward_s + c, 0.0, p2p_s,
                        timeline=False).step_time

    low, high = 0.0, measured_s
    if step(low) >= measured_s:
        return 0.0
    for _ in range(60):  # step() grows with c: bisect
        mid = (low + high) / 2
        low, high = (mid, high) if step(mid) < measured_s else (low, mid)
    return (low + high) / 2


def pipeline_action_overhead(raw: Mapping[str, Any], link: Link) -> float | None:
    """Seconds the pipeline schedule adds to each action, from the
    ``pipeline`` measurement: :func:`fit_action_overhead` with each forward
    and backward its plain share of the measured layer's time and each send
    ``link``'s latency and bytes; None when it was not measured."""
    pair = timed_pair(raw, "pipeline", "plain", "pipelined")
    if pair is None:
        return None
    pipe, plain_s, pipelined_s = pair
    m = pipe["microbatches"]
    action = plain_s / (2 * m)
    return fit_action_overhead(pipe["schedule"], pipe["stages"], m, action, action,
                               link.latency + pipe["activation_bytes"] / link.bandwidth,
                               pipelined_s)


def runtime_pipeline_action(raw: Mapping[str, Any], link: Link, runtime: str) -> float | None:
    """Seconds the planner's own pipeline adds to each action when its stages
    run ``runtime`` (``eager`` or ``compiled``), from the ``runtime_pipeline``
    measurement (:mod:`codegen.pipeline_probe`): :func:`fit_action_overhead`
    with each forward and backward what the rank's stage took alone per
    micro-batch (the slower rank's) and each send ``link``'s latency and
    bytes; None when it was not measured, or when a region of the compiled
    runtime ran eager (``eager_regions``)."""
    pipe = raw.get("runtime_pipeline")
    timed = (pipe or {}).get(runtime) or {}
    if any("seconds" not in timed.get(k, {}) for k in ("forward", "stage", "pipelined")) \
            or timed.get("eager_regions"):
        return None
    m = pipe["microbatches"]
    forward = timed["forward"]["seconds"] / m
    backward = max(0.0, timed["stage"]["seconds"] / m - forward)
    return fit_action_overhead(pipe["schedule"], pipe["stages"], m, forward, backward,
                               link.latency + pipe["activation_bytes"] / link.bandwidth,
                               timed["pipelined"]["seconds"])


def split_backward_steps(r: Any, out: dict[str, Any]) -> Steps:
    """:data:`SPLIT_GROUPS` tiny residual layers, each a matmul by its own
    weight and three elementwise ops (about as many ops a parameter group as
    a transformer block has), their backward whole and split (input
    gradients, then each weight's); records into ``out["split_backward"]``."""
    from ir.torch_compat.split_backward import split_backward

    torch, device = r.torch, r.device
    torch.manual_seed(0)
    weights = [torch.nn.Parameter(torch.randn(_FEATURES, _FEATURES, device=device) / _FEATURES)
               for _ in range(SPLIT_GROUPS)]
    x = torch.ones(8, _FEATURES, device=device, requires_grad=True)
    out["split_backward"] = {"groups": SPLIT_GROUPS, "whole": {}, "split": {}}
    record = out["split_backward"]

    def loss() -> Any:
        h = x
        for w in weights:
            h = torch.tanh(h @ w) * 0.5 + h
        return h.sum()

    return [("backward whole", dropping_gradients(lambda: loss().backward(), lambda: weights),
             record["whole"]),
            ("backward split", dropping_gradients(lambda: split_backward(loss(), [x], weights),
                                                  lambda: weights), record["split"])]


def split_backward_group_overhead(raw: Mapping[str, Any]) -> float | None:
    """Seconds a split backward adds per parameter group, from the
    ``split_backward`` measurement: the split step's extra seconds over the
    whole one, per layer; None when it was not measured."""
    pair = timed_pair(raw, "split_backward", "whole", "split")
    if pair is None:
        return None
    rec, whole_s, split_s = pair
    return max(0.0, (split_s - whole_s) / rec["groups"])
