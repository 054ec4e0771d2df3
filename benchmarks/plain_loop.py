"""A plain eager training step: the one definition the benchmarks measure plans against.

What a user would write without the planner, for one device: the model with real
weights, ``torch.optim.AdamW(foreach=True)``, and per step forward, backward,
``optimizer.step()`` and ``optimizer.zero_grad(set_to_none=True)``, in one of the
training precisions of :mod:`ir.precision`:

* ``fp32``: the model as built (fp32), nothing cast.
* ``bf16``: the model cast to bf16 once; parameters, gradients and AdamW states bf16.
* ``bf16-mixed``: fp32 master parameters (AdamW updates them; fp32 gradients and
  states). Each forward runs the model through :func:`torch.func.functional_call`
  with every floating parameter and buffer cast to bf16 (the working copy; autograd
  keeps the copy a matmul reads until that matmul's backward, and accumulates the
  gradient into the fp32 parameter through the cast), and the inputs cast with
  :func:`ir.precision.cast_floats`. The casts are made once, before the forward,
  for the whole model: a checkpointed layer receives its (already cast) working
  copies as inputs, so checkpointing drops that layer's activations but not its
  working copies.

Checkpointing: every module whose path (``transformer.h.3``, as in a plan's
``checkpoint`` list) is given runs under ``torch.utils.checkpoint.checkpoint(...,
use_reentrant=False)``. The wrapper is set as the module instance's ``forward``, so
parameter names do not change.

    loop = PlainLoop.from_zoo("gpt-tiny", precision="bf16-mixed",
                              checkpoint=["transformer.h.0"], device="cpu")
    times = time_steps(loop, warmup=3, steps=5)      # seconds
    peak = peak_memory(loop)                          # bytes

Units: seconds for times, bytes for memory.

Peak memory is the *steady-state* step's: :func:`peak_memory` first runs
``warmup`` (>= 1) whole steps, so the AdamW states exist (the first
``optimizer.step()`` allocates them) and gradients were freed by ``zero_grad``,
then measures one more step (forward + backward + optimizer step + zero_grad)
from the memory held before it: parameters, buffers, optimizer states and inputs
count in; so does the planner's prediction (parameters, gradients, optimizer
states and activations of one step).

On CUDA it reads ``torch.cuda.max_memory_allocated`` (the caching allocator's
allocated bytes, block-rounded; the memory held by the CUDA context and the cache
is not counted). On CPU, and under ``FakeTensorMode``, it uses torch's own
tensor-storage count, ``torch.distributed._tools.mem_tracker.MemTracker``, which
sums the bytes of live storages (``numel * itemsize``, no allocator rounding).
"""

from __future__ import annotations

import statistics
import time
import warnings
from typing import Any, Callable, Sequence

import torch
import torch.utils.checkpoint
from torch import nn

__all__ = ["PlainLoop", "time_steps", "peak_memory", "tracked_peak_memory",
           "cuda_peak_memory", "measure", "plan_one_device", "predicted_of"]


def _lookup(module: nn.Module, name: str) -> torch.Tensor:
    """The tensor at dotted ``name`` below ``module`` as the module sees it now
    (inside :func:`torch.func.functional_call`, the swapped-in tensor)."""
    owner, _, leaf = name.rpartition(".")
    return getattr(module.get_submodule(owner) if owner else module, leaf)


def _cast_module_(model: nn.Module, dtype: torch.dtype) -> None:
    """Cast ``model``'s floating parameters and buffers to ``dtype`` in place (what
    ``model.to(dtype)`` does; that one fails on fake tensors, which torch swaps)."""
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None and param.is_floating_point() and param.dtype != dtype:
                module._parameters[name] = nn.Parameter(param.detach().to(dtype),
                                                        requires_grad=param.requires_grad)
        for name, buf in module._buffers.items():
            if buf is not None and buf.is_floating_point() and buf.dtype != dtype:
                module._buffers[name] = buf.to(dtype)


def _checkpoint_module(module: nn.Module, mixed: bool) -> None:
    """Run ``module``'s forward under non-reentrant ``torch.utils.checkpoint``.

    Under a mixed precision the module's parameters and buffers at call time are
    the bf16 working copies that :func:`torch.func.functional_call` swapped in for
    the forward; the recomputation in backward runs after that call has restored
    the fp32 parameters, so the copies are handed to the checkpointed function
    explicitly and swapped in again while it (re)runs.
    """
    original = module.forward  # the bound method of the class
    if not mixed:
        def checkpointed(*args: Any, **kwargs: Any) -> Any:
            return torch.utils.checkpoint.checkpoint(original, *args, use_reentrant=False,
                                                     **kwargs)
        module.forward = checkpointed  # type: ignore[method-assign]
        return

    names = [n for n, _ in module.named_parameters()] + [n for n, _ in module.named_buffers()]
    inside = [False]  # a call of forward from within the checkpointed function

    def run(tensors: Sequence[torch.Tensor], args: tuple, kwargs: dict) -> Any:
        inside[0] = True
        try:
            return torch.func.functional_call(module, dict(zip(names, tensors)), args, kwargs)
        finally:
            inside[0] = False

    def checkpointed_mixed(*args: Any, **kwargs: Any) -> Any:
        if inside[0]:
            return original(*args, **kwargs)
        tensors = [_lookup(module, n) for n in names]
        return torch.utils.checkpoint.checkpoint(run, tensors, args, kwargs,
                                                 use_reentrant=False)

    module.forward = checkpointed_mixed  # type: ignore[method-assign]


class PlainLoop:
    """One device's plain eager training step of ``model`` (see the module docstring).

    Args:
        model: the model, fp32 (for ``bf16`` it is cast to bf16 here, in place).
            ``model(*inputs)`` must return the scalar loss.
        inputs: the step's example inputs (same device as the model).
        precision: ``fp32``, ``bf16`` or ``bf16-mixed`` (or an
            :class:`ir.precision.Precision`).
        checkpoint: module paths to run under activation checkpointing (a plan's
            ``checkpoint``). An unknown path raises ``ValueError``.
        lr: AdamW learning rate.
        compile: run the forward (the bf16 working copies' casts and the model)
            through ``torch.compile``, as a user compiling their own loop would;
            the backward runs the graph AOTAutograd made of it.

    Attributes:
        model, optimizer, inputs, precision, checkpoint.
    """

    def __init__(self, model: nn.Module, inputs: Sequence[Any], *, precision: Any = "fp32",
                 checkpoint: Sequence[str] = (), lr: float = 1e-4, compile: bool = False) -> None:
        from ir.precision import cast_floats, get_precision

        self.precision = get_precision(precision)
        p = self.precision
        if not p.mixed and p.master_dtype != torch.float32:
            _cast_module_(model, p.master_dtype)  # bf16: cast once
        self.model = model
        self.inputs = tuple(inputs)
        self._compute_inputs = cast_floats(self.inputs, p.compute_dtype)
        self.checkpoint = list(checkpoint)
        modules = dict(model.named_modules())
        for path in self.checkpoint:
            if path not in modules:
                raise ValueError(f"checkpoint: {type(model).__name__} has no module {path!r}")
            _checkpoint_module(modules[path], p.mixed)
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr, foreach=True)
        self._forward = torch.compile(self._eager_forward) if compile else self._eager_forward

    @classmethod
    def from_zoo(cls, name: str, *, precision: Any = "fp32", checkpoint: Sequence[str] = (),
                 device: torch.device | str = "cpu", batch_size: int | None = None,
                 seq_len: int | None = None, compile: bool = False) -> "PlainLoop":
        """A zoo model (:func:`models.zoo.build`, seed 0, fp32) and its example inputs on
        ``device``. Under ``FakeTensorMode`` nothing is allocated."""
        from models import zoo
        model, inputs = zoo.build(name, device=device, batch_size=batch_size, seq_len=seq_len)
        return cls(model, inputs, precision=precision, checkpoint=checkpoint, compile=compile)

    def forward(self) -> torch.Tensor:
        """The step's loss (a scalar in the compute dtype, with its autograd graph)."""
        return self._forward()

    def _eager_forward(self) -> torch.Tensor:
        p = self.precision
        if not p.mixed:
            return self.model(*self._compute_inputs)
        dtype = p.compute_dtype
        copies = {n: (t.to(dtype) if t.is_floating_point() else t)
                  for n, t in self.model.named_parameters()}
        copies.update({n: (t.to(dtype) if t.is_floating_point() else t)
                       for n, t in self.model.named_buffers()})
        return torch.func.functional_call(self.model, copies, self._compute_inputs)

    def step(self) -> torch.Tensor:
        """One training step: forward, backward, AdamW step, gradients set to None.
        Returns the loss, detached (not synchronised: call ``.item()`` to wait)."""
        loss = self.forward()
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()


def _device_of(loop: PlainLoop) -> torch.device:
    return next(loop.model.parameters()).device


def time_steps(loop: PlainLoop, *, warmup: int = 3, steps: int = 5) -> dict[str, Any]:
    """Seconds per training step: ``warmup`` untimed steps, then ``steps`` timed ones.

    CUDA: each step between two CUDA events (``elapsed_time``), synchronised after
    the last. CPU: ``time.perf_counter`` around each step.

    Returns:
        ``{"median_s", "min_s", "times_s", "warmup", "steps", "timer"}``, seconds.
    """
    device = _device_of(loop)
    for _ in range(warmup):
        loop.step()
    times: list[float] = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(steps)]
        for start, end in events:
            start.record()
            loop.step()
            end.record()
        torch.cuda.synchronize(device)
        times = [start.elapsed_time(end) / 1e3 for start, end in events]  # ms -> s
        timer = "cuda_event"
    else:
        for _ in range(steps):
            t0 = time.perf_counter()
            loop.step().item()
            times.append(time.perf_counter() - t0)
        timer = "perf_counter"
    return {"median_s": statistics.median(times), "min_s": min(times), "times_s": times,
            "warmup": warmup, "steps": steps, "timer": timer}


def cuda_peak_memory(loop: PlainLoop, *, warmup: int = 1, steps: int = 1) -> dict[str, Any]:
    """Bytes: ``torch.cuda.max_memory_allocated`` over ``steps`` steps after ``warmup``
    (>= 1) steps, the peak statistics reset between (the steady state: AdamW states
    allocated, no gradients held between steps).

    Returns:
        ``{"peak_bytes", "before_step_bytes", "kind": "cuda_max_allocated"}``.
    """
    device = _device_of(loop)
    for _ in range(max(1, warmup)):
        loop.step()
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    for _ in range(steps):
        loop.step()
    torch.cuda.synchronize(device)
    return {"peak_bytes": int(torch.cuda.max_memory_allocated(device)),
            "before_step_bytes": int(before), "kind": "cuda_max_allocated"}


def _tracker_class() -> type:
    """``MemTracker``, made to accept a module whose parameters are, while it runs,
    the bf16 working copies that ``functional_call`` swapped in (not leaves: torch's
    tracker would try to hook their gradient accumulation and fail). Their bytes are
    counted as any other tensor's; only the gradient hooks are left off them."""
    from torch.distributed._tools.mem_tracker import MemTracker

    class _Tracker(MemTracker):
        def _track_module_params_and_buffers(self, module: nn.Module,
                                             install_grad_hooks: bool = True) -> tuple[int, int]:
            leaves = all(p.is_leaf for p in module.parameters())
            return super()._track_module_params_and_buffers(
                module, install_grad_hooks=install_grad_hooks and leaves)

    return _Tracker


def tracked_peak_memory(loop: PlainLoop, *, warmup: int = 1) -> dict[str, Any]:
    """Bytes: the peak of one training step counted by torch's
    ``MemTracker`` (live tensor storages), after ``warmup`` (>= 1) untracked steps.

    Works on real CPU (or CUDA) tensors and under ``FakeTensorMode`` (where the
    steps allocate nothing). Parameters, buffers, inputs and the optimizer's
    states are registered with ``track_external``, so the count starts from
    what the step holds before it begins.

    Returns:
        ``{"peak_bytes", "before_step_bytes", "breakdown": {category: bytes at the
        peak}, "kind": "mem_tracker"}``; categories as MemTracker names them
        (Parameter, Buffer, Gradient, Activation, Temp, Optstate, Other).
    """
    for _ in range(max(1, warmup)):
        loop.step()
    tracker = _tracker_class()()
    tracker.track_external(loop.model, loop.optimizer,
                           *[t for t in loop.inputs if isinstance(t, torch.Tensor)])
    # gradient hooks on the (leaf) parameters, so that their gradients count as such
    tracker._track_module_params_and_buffers(loop.model, install_grad_hooks=True)
    before = sum(s.get("Total", 0) for s in tracker.get_tracker_snapshot("current").values())
    with tracker, warnings.catch_warnings():
        # torch's tracker reads .grad of the non-leaf working copies and warns about
        # the module hierarchy while a checkpointed layer recomputes: no effect on the count
        warnings.filterwarnings("ignore", message=".*grad attribute of a Tensor that is not a leaf.*")
        warnings.filterwarnings("ignore", message=".*module hierarchy tracking maybe be messed up.*")
        loop.step()
    peak = tracker.get_tracker_snapshot("peak")
    breakdown: dict[str, int] = {}
    for snap in peak.values():
        for k, v in snap.items():
            if k != "Total":
                key = getattr(k, "value", str(k))
                breakdown[key] = breakdown.get(key, 0) + int(v)
    return {"peak_bytes": int(sum(s.get("Total", 0) for s in peak.values())),
            "before_step_bytes": int(before), "breakdown": breakdown, "kind": "mem_tracker"}


def peak_memory(loop: PlainLoop, *, warmup: int = 1) -> dict[str, Any]:
    """Bytes of the steady-state step's peak: :func:`cuda_peak_memory` on CUDA,
    :func:`tracked_peak_memory` elsewhere (CPU, FakeTensorMode)."""
    from torch._subclasses.fake_tensor import FakeTensor

    param = next(loop.model.parameters())
    if param.device.type == "cuda" and not isinstance(param, FakeTensor):
        return cuda_peak_memory(loop, warmup=warmup)
    return tracked_peak_memory(loop, warmup=warmup)


def measure(loop_factory: Callable[[], PlainLoop], *, warmup: int = 3,
            steps: int = 5) -> dict[str, Any]:
    """Step time and peak memory of a fresh loop: ``{"time": time_steps(...),
    "memory": peak_memory(...)}`` (peak measured on the same loop after the timed
    steps; seconds and bytes)."""
    loop = loop_factory()
    timing = time_steps(loop, warmup=warmup, steps=steps)
    memory = peak_memory(loop, warmup=1)
    return {"time": timing, "memory": memory}


# --- the plan a loop is compared against ------------------------------------------

def plan_one_device(model: nn.Module, inputs: Sequence[Any], cluster: Any, *, precision: str,
                    recompute: bool | None = None, model_source: str | None = None,
                    zoo_kwargs: dict[str, Any] | None = None,
                    memory_budget: float | None = None,
                    time_limit_s: float = 30.0, compile: bool = False) -> Any:
    """``planner.plan`` of ``model`` on one device (mesh ``(1,)``) in ``precision``
    with ``recompute`` (True: every layer checkpointed, False: none, None: the
    solver's choice): the call both benchmarks make, so that they price the same step.
    ``compile``: priced (and recorded) as a program run through ``torch.compile``.

    ``model`` is the fp32 model (the meta device is enough). Where the planner has
    no ``precision`` / ``recompute`` arguments yet (before training precisions), a
    ``fp32`` or ``bf16`` plan with ``recompute=None`` is still made, of the model in
    that dtype; other combinations raise that ``TypeError``.
    """
    import planner

    kwargs: dict[str, Any] = dict(example_inputs=tuple(inputs), mesh_shape=(1,),
                                  model_source=model_source, zoo_kwargs=zoo_kwargs,
                                  memory_budget=memory_budget, time_limit_s=time_limit_s)
    if compile:
        kwargs["compile"] = True
    try:
        return planner.plan(model, cluster, precision=precision, recompute=recompute, **kwargs)
    except TypeError as err:
        if "unexpected keyword argument" not in str(err) or recompute is not None \
                or precision not in ("fp32", "bf16"):
            raise
    if precision == "bf16":
        model = model.to(dtype=torch.bfloat16)
    return planner.plan(model, cluster, **kwargs)


def predicted_of(plan: Any) -> dict[str, Any]:
    """What a plan predicts for its step, one device: ``{"step_time_s", "peak_bytes",
    "memory": {part: bytes}, "checkpoint": [module paths], "precision"}``."""
    memory = dict(plan.predicted.get("memory_bytes_per_device", {}))
    training = plan.training or {}
    precision = training.get("precision", training.get("dtype"))
    if isinstance(precision, dict):
        precision = precision.get("name")
    return {"step_time_s": plan.predicted.get("step_time_s"),
            "peak_bytes": memory.get("peak", memory.get("total")), "memory": memory,
            "checkpoint": list(plan.checkpoint), "precision": precision}
