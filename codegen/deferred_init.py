"""Deferred initialisation: build a model on ``meta``, then materialise any of
its tensors, one at a time, bit for bit as building it on a real device gives.

A distributed rank must allocate only its own shards of each parameter, yet a
run is checked against one process that built the whole model directly (the
same factory, seed and device). :func:`record_build` runs the factory on the
meta device (no memory) under a dispatch mode that records every ATen op on
meta tensors, in order, with a snapshot of the device's random generator
before each random op; it advances the real generator as the real op would by
running that op on the device once (its result dropped at once), so code that
reseeds or reads the generator in the middle of the factory behaves as on the
device. :meth:`codegen.deferred_init_record.InitRecord.materialize` then
replays only the ops a tensor's final value depends on (its storage's creator
and writers, and, recursively, theirs), on the device, with the generator set
to each random op's snapshot:

    >>> (model, inputs), record = record_build(
    ...     lambda: build_model("gpt-tiny", device="meta", seed=0), device="cpu")
    >>> w = record.materialize(model.lm_head.weight)   # == the cpu build's, exactly
    >>> shard = w[: w.shape[0] // 2].clone(); del w     # keep this rank's rows

What is held: the record keeps the meta tensors (shapes, no data), references
to the real constant tensors the factory fed in, and one generator state per
random op (5056 bytes on CPU, 16 on CUDA). A materialisation holds at most the
tensor asked for and the values it is computed from, dropping each as soon as
no later replayed op reads it (``InitRecord.last_peak_bytes`` says how much).

What the dispatch mode cannot see is hooked at the Python level while
recording (:data:`_HOOKS`, swapped process-wide and restored after): the
``torch.nn.init`` functions that do nothing on meta tensors (``trunc_normal_``,
``orthogonal_``, ``sparse_``, ``dirac_``) are recorded as one call each and
replayed by calling them; transformers' check that skips initialising a model
built on meta sees the record's device; and tensors made from Python data on
meta (``torch.tensor([...])``) are made on the CPU and copied.

Limits: other code that branches on ``tensor.device.type == "meta"`` builds
another model than on the device, silently; values read on meta (``.item()``,
``torch.equal``) cannot be recorded (:class:`DeferredInitError`); a constant
tensor changed in place after the build used it is refused at replay; tensors
that share a storage come back as separate tensors, one per call.
"""

from __future__ import annotations

import functools
import sys
from typing import Any, Callable, TypeVar

import torch
from torch.overrides import TorchFunctionMode

from codegen.deferred_init_log import (
    TARGET_DEVICE, ConstArg, DeferredInitError, LayoutArg, MetaRef, RecordedOp, op_name,
    version_of,
)
from codegen.deferred_init_record import InitRecord
from ir.torch_compat import (
    dispatch_mode_type, op_overload_name, takes_generator, tree_flatten, tree_unflatten,
    written_arguments,
)

__all__ = ["record_build"]

T = TypeVar("T")

#: Random ops whose tensor argument ``self`` they only write, in place: how
#: many random numbers they draw depends on its shape and strides, never its
#: values, so advancing the generator while recording runs them on an
#: uninitialised tensor of that layout.
_WRITE_ONLY_RANDOM = frozenset({
    "aten::normal_", "aten::uniform_", "aten::random_", "aten::exponential_",
    "aten::geometric_", "aten::log_normal_", "aten::cauchy_", "aten::bernoulli_",
})

#: Ops that read only the shape, strides and dtype of ``self``: it is recorded
#: as a :class:`LayoutArg`, so a replay does not make its value.
_LAYOUT_ONLY = frozenset({
    "aten::empty_like", "aten::zeros_like", "aten::ones_like", "aten::full_like",
    "aten::rand_like", "aten::randn_like", "aten::randint_like", "aten::new_empty",
    "aten::new_empty_strided", "aten::new_zeros", "aten::new_ones", "aten::new_full",
})

#: Python functions that make a tensor from Python data without dispatching an
#: ATen op that carries the data: on meta they are recorded as a constant made
#: on the CPU and copied to the device.
_LITERALS = (torch.tensor, torch.as_tensor, torch.asarray)


def _is_random(func: Any) -> bool:
    """Whether ``func`` draws from a random generator (torch's tag, or a
    ``generator`` argument)."""
    return torch.Tag.nondeterministic_seeded in getattr(func, "tags", ()) or (
        op_overload_name(func) is not None and takes_generator(func))


def _default_generator(device: torch.device) -> torch.Generator:
    """The default random generator of ``device`` (CPU: ``torch.default_generator``;
    CUDA and alike: that device's, the current one when ``device`` has no index)."""
    if device.type == "cpu":
        return torch.default_generator
    module = getattr(torch, device.type, None)
    if module is None or not hasattr(module, "default_generators"):
        raise DeferredInitError(f"deferred init has no random generator for {device.type}")
    module.init()
    index = device.index if device.index is not None else module.current_device()
    return module.default_generators[index]


# ---------------------------------------------------------------------- modes


def _is_meta(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.is_meta


def _names_meta(leaves: list) -> bool:
    """Whether an op's flattened arguments hold a meta tensor or the meta device."""
    return any(_is_meta(x) or (isinstance(x, torch.device) and x.type == "meta")
               for x in leaves)


def _written_tensors(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors ATen op ``func`` writes in place (its schema's ``Tensor(a!)``
    arguments)."""
    written = []
    for position, name, kwarg_only in written_arguments(func):
        value = kwargs.get(name) if kwarg_only or position >= len(args) else args[position]
        written += [x for x in tree_flatten(value)[0] if isinstance(x, torch.Tensor)]
    return written


def _run_on_meta(func: Any, args: tuple, kwargs: dict) -> Any:
    """``func`` run on its meta arguments; an op meta tensors cannot run (it
    reads values, or mixes devices) raises :class:`DeferredInitError`."""
    try:
        return func(*args, **kwargs)
    except (RuntimeError, NotImplementedError) as err:
        if "meta" not in str(err).lower():
            raise
        first = str(err).strip().splitlines()[0]
        raise DeferredInitError(f"{op_name(func)} cannot be recorded on the meta device "
                                f"(a deferred build has no tensor values): {first}") from err


class _Recorder(dispatch_mode_type()):
    """While entered, appends every ATen op that touches a meta tensor (or makes
    one) to ``record``; other ops run untouched. A random op also runs once on
    the record's device, so the real generator advances as the device build's."""

    def __init__(self, record: InitRecord) -> None:
        super().__init__()
        self.record = record

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        leaves, _ = tree_flatten((args, kwargs))
        if not _names_meta(leaves):
            return func(*args, **kwargs)
        random, name = _is_random(func), op_overload_name(func)[0]
        first_meta = bool(args) and _is_meta(args[0])
        return self.record_op(func, args, kwargs, lambda: _run_on_meta(func, args, kwargs),
                              lambda: _written_tensors(func, args, kwargs), random=random,
                              run=random, write_only=first_meta and name in _WRITE_ONLY_RANDOM,
                              layout_only=first_meta and name in _LAYOUT_ONLY)

    def record_op(self, func: Any, args: tuple, kwargs: dict, run_meta: Callable[[], Any],
                  written: Callable[[], list[torch.Tensor]], *, random: bool, run: bool,
                  write_only: bool = False, layout_only: bool = False) -> Any:
        """Append ``func(*args, **kwargs)`` to the record and return its meta
        result (``run_meta()``). ``written()``: the meta tensors it wrote.
        ``random``: snapshot the generator first; ``run``: run it once on the
        device (its first argument, which it only writes when ``write_only``,
        an uninitialised stand-in). ``layout_only``: it reads only the layout
        of its first argument."""
        record = self.record
        leaves, spec = tree_flatten((args, kwargs))
        encoded = tuple(LayoutArg(tuple(x.shape), tuple(x.stride()), x.dtype)
                        if layout_only and i == 0 else self._encode(x)
                        for i, x in enumerate(leaves))
        inputs = tuple(x.vid for x in encoded if isinstance(x, MetaRef))
        reads = frozenset(record._signatures[vid][0] for vid in inputs)
        rng = self._snapshot(leaves) if random else None
        out = run_meta()
        if run:
            self._advance(func, leaves, encoded, spec, write_only)
        out_leaves, _ = tree_flatten(out)
        outputs = tuple(record._output_value(x) if _is_meta(x) else None for x in out_leaves)
        wrote = [record._output_value(x) for x in written() if _is_meta(x)]
        touches = frozenset(record._signatures[vid][0] for vid in (*outputs, *wrote)
                            if vid is not None)
        if touches:
            record._append(RecordedOp(func, encoded, spec, outputs, inputs, reads, touches, rng),
                           touches)
        return out

    def _encode(self, leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor):
            if leaf.is_meta:
                return MetaRef(self.record._input_value(leaf))
            return ConstArg(leaf, version_of(leaf))
        if isinstance(leaf, torch.device) and leaf.type == "meta":
            return TARGET_DEVICE
        if isinstance(leaf, (torch.UntypedStorage, torch.TypedStorage)):
            raise DeferredInitError("an op taking a storage cannot be recorded on meta")
        return leaf

    def _snapshot(self, leaves: list) -> tuple[torch.Generator | None, torch.Tensor]:
        """The generator a random op draws from (its ``generator`` argument, None
        for the device's default) and that generator's state now."""
        gen = next((x for x in leaves if isinstance(x, torch.Generator)), None)
        return gen, (self.record.generator if gen is None else gen).get_state()

    def _advance(self, func: Any, leaves: list, encoded: tuple, spec: Any,
                 write_only: bool) -> None:
        """Run ``func`` once on the device, its result dropped, so the generator
        draws what the device build's op draws. Its tensor arguments are
        materialised; with ``write_only`` an uninitialised tensor of the same
        layout stands in for the first one."""
        record = self.record
        if write_only:
            first = leaves[0]
            encoded = (LayoutArg(tuple(first.shape), tuple(first.stride()), first.dtype),
                       *encoded[1:])
        vids = sorted({x.vid for x in encoded if isinstance(x, MetaRef)})
        env = dict(zip(vids, record._replay(vids, len(record._entries)))) if vids else {}
        real = [record._real_leaf(x, func, env) for x in encoded]
        args, kwargs = tree_unflatten(real, spec)
        with torch.no_grad():
            result = func(*args, **kwargs)
        del result


# --------------------------------------------------- Python-level hooks


def _opaque_init(original: Callable[..., Any], recorder: _Recorder,
                 random: bool) -> Callable[..., Any]:
    """``original(tensor, ...)``, an init function that does nothing on meta
    tensors, recorded as one op on a meta ``tensor``: replayed by calling
    ``original`` on the real tensor (it overwrites all of it)."""

    @functools.wraps(original)
    def init(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if not _is_meta(tensor):
            return original(tensor, *args, **kwargs)
        return recorder.record_op(original, (tensor, *args), kwargs, lambda: tensor,
                                  lambda: [tensor], random=random, run=True, write_only=True)

    return init


def _device_query(original: Callable[[], Any], device: torch.device) -> Any:
    """``original()``, with the meta device read as ``device`` (None where
    ``device`` is the default device, as the query answers on it)."""
    found = original()
    if found is None or torch.device(found).type != "meta":
        return found
    return None if device == torch.get_default_device() else device


#: ``(module, attribute, dict key or None, kind)``: Python functions that skip
#: their work on meta tensors, swapped while recording as soon as their module
#: is imported (and restored after). ``"random"``/``"fixed"``: init functions
#: (torch's own, and transformers' early-bound copies) recorded as one op
#: (:func:`_opaque_init`) that draws random numbers or not. ``"device"``: a
#: query of the device a model is built on, which transformers' ``init_weights``
#: reads to skip initialising on meta; it names the record's device instead.
_HOOKS: tuple[tuple[str, str, str | None, str], ...] = (
    ("torch.nn.init", "_no_grad_trunc_normal_", None, "random"),
    ("torch.nn.init", "orthogonal_", None, "random"),
    ("torch.nn.init", "sparse_", None, "random"),
    ("torch.nn.init", "dirac_", None, "fixed"),
    ("transformers.initialization", "TORCH_INIT_FUNCTIONS", "orthogonal_", "random"),
    ("transformers.initialization", "TORCH_INIT_FUNCTIONS", "sparse_", "random"),
    ("transformers.initialization", "TORCH_INIT_FUNCTIONS", "dirac_", "fixed"),
    ("transformers.modeling_utils", "get_torch_context_manager_or_global_device", None,
     "device"),
)


class _Hooks(TorchFunctionMode):
    """While entered: tensors made on meta from Python data (``torch.tensor``,
    ``as_tensor``, ``asarray``, ``Tensor.new_tensor``), whose values no ATen op
    carries, are made on the CPU and copied to meta, so the recorder keeps the
    CPU tensor as a constant; and the functions of :data:`_HOOKS` are swapped
    (checked at each torch call, for modules the build imports); on exit each
    gets back its original where it still holds the hook."""

    def __init__(self, recorder: _Recorder) -> None:
        super().__init__()
        self.recorder = recorder
        self._swapped: dict[int, tuple[Any, Any, Any]] = {}  # index: (holder, original, hook)

    def __enter__(self) -> _Hooks:
        self._swap()
        return super().__enter__()

    def __exit__(self, *exc: Any) -> Any:
        for index, (holder, original, hook) in self._swapped.items():
            _, attr, key, _ = _HOOKS[index]
            if key is None and getattr(holder, attr) is hook:
                setattr(holder, attr, original)
            elif key is not None and holder.get(key) is hook:
                holder[key] = original
        self._swapped.clear()
        return super().__exit__(*exc)

    def __torch_function__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if len(self._swapped) < len(_HOOKS):
            self._swap()
        if func in _LITERALS and not _holds_tensor(args) and _is_meta_device(
                kwargs.get("device")):
            return _literal(func, args, kwargs)
        if func is torch.Tensor.new_tensor and _is_meta(args[0]) and not _holds_tensor(
                args[1:]) and _is_meta_device(kwargs.get("device") or args[0].device):
            kwargs = {**kwargs, "dtype": kwargs.get("dtype") or args[0].dtype, "device": "meta"}
            return _literal(torch.tensor, args[1:], kwargs)
        return func(*args, **kwargs)

    def _swap(self) -> None:
        for index, (module_name, attr, key, kind) in enumerate(_HOOKS):
            module = sys.modules.get(module_name)
            if index in self._swapped or not hasattr(module, attr):
                continue
            holder = getattr(module, attr) if key is not None else module
            if key is not None and key not in holder:
                continue
            original = holder[key] if key is not None else getattr(holder, attr)
            if kind == "device":
                hook = functools.partial(_device_query, original, self.recorder.record.device)
            else:
                hook = _opaque_init(original, self.recorder, random=kind == "random")
            self._swapped[index] = (holder, original, hook)
            if key is None:
                setattr(holder, attr, hook)
            else:
                holder[key] = hook


def _holds_tensor(tree: Any) -> bool:
    return any(isinstance(x, torch.Tensor) for x in tree_flatten(tree)[0])


def _is_meta_device(device: Any) -> bool:
    return (torch.get_default_device() if device is None else torch.device(device)).type == "meta"


def _literal(func: Any, args: tuple, kwargs: dict) -> torch.Tensor:
    """``func(*args, **kwargs)`` (meta device) made on the CPU, then copied to meta."""
    kwargs = dict(kwargs, device="cpu")
    requires_grad = kwargs.pop("requires_grad", False)
    real = func(*args, **kwargs)
    out = real.to("meta")
    return out.requires_grad_() if requires_grad else out


def record_build(build: Callable[[], T], device: torch.device | str) -> tuple[T, InitRecord]:
    """Run ``build()`` (which makes its tensors on the meta device, e.g.
    ``lambda: build_model(spec, device="meta", seed=0)``) and record how to
    make each of them on ``device``: returns ``(what build returned, record)``.

    ``device``'s default generator (and any generator the build passes to a
    random op) advances as the build on ``device`` advances it; reseeding it
    during the build (``torch.manual_seed``) is followed. Held: meta tensors,
    real constants the build fed in, one generator state per random op. While
    it runs, the functions of :data:`_HOOKS` are swapped (process-wide: record
    one build at a time).

    Raises:
        DeferredInitError: ``device`` is meta or has no generator, or the build
            runs an op meta tensors cannot (``.item()``: the message names it).
    """
    dev = torch.device(device)
    if dev.type == "meta":
        raise DeferredInitError("record_build needs a real device to materialize on, not meta")
    generator = _default_generator(dev)
    if dev.type != "cpu" and dev.index is None:
        dev = torch.device(dev.type, generator.device.index)
    record = InitRecord(dev, generator)
    recorder = _Recorder(record)
    with _Hooks(recorder), recorder:
        result = build()
    record.last_replayed_ops = record.last_peak_bytes = 0
    return result, record
