"""The log of a deferred build (:mod:`codegen.deferred_init`): its entries and
how they name tensors.

A recorded build is a list of :data:`LogEntry`: a :class:`RecordedOp` (one
ATen op, or one Python init function, with its flattened arguments) or an
:class:`AliasEntry` (a meta tensor that shares a recorded storage but was made
without an op the recorder sees). An op's arguments name meta tensors by value
id (:class:`MetaRef`), real tensors as they are (:class:`ConstArg`), a tensor
of which only the layout is read by its layout (:class:`LayoutArg`) and the
meta device as :data:`TARGET_DEVICE`. A tensor's :data:`Signature` is its
storage and layout, in elements. :class:`DeferredInitError` is what recording
or replaying refuses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

import torch

from ir.torch_compat import op_overload_name, storage_key

__all__ = ["TARGET_DEVICE", "AliasEntry", "ConstArg", "DeferredInitError", "LayoutArg", "LogEntry",
           "MetaRef", "RecordedOp", "Signature", "TargetDevice", "op_name", "signature_of",
           "version_of"]

#: ``(storage key, dtype, shape, strides, storage offset)`` of a tensor, in elements.
Signature = tuple[int, torch.dtype, tuple[int, ...], tuple[int, ...], int]


class DeferredInitError(ValueError):
    """A build that cannot be recorded or replayed on a real device (it reads a
    meta tensor's values, a constant it used changed after, ...); one line
    naming the op."""


# ------------------------------------------------------------------ log records


class TargetDevice:
    """Stands for ``torch.device("meta")`` in a recorded op: replayed as the
    record's device."""

    def __repr__(self) -> str:
        return "<device>"


TARGET_DEVICE = TargetDevice()


@dataclass(frozen=True)
class MetaRef:
    """A meta tensor argument, by value id (its index in the record's tensors)."""

    vid: int


@dataclass(frozen=True)
class LayoutArg:
    """A meta tensor argument of which the op reads only the layout
    (:data:`codegen.deferred_init._LAYOUT_ONLY`): replayed as an uninitialised
    tensor of that layout."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True, eq=False)
class ConstArg:
    """A real tensor argument (made outside the record, or a literal), used as
    is; ``version`` is its ``version_of`` when recorded (None where it has none)."""

    tensor: torch.Tensor
    version: int | None


@dataclass(frozen=True, eq=False)
class RecordedOp:
    """One recorded ATen op (or Python init function,
    :func:`codegen.deferred_init._opaque_init`).

    ``leaves``/``spec``: its flattened ``(args, kwargs)``, meta tensors as
    :class:`MetaRef`, real ones as :class:`ConstArg`, the meta device as
    ``TARGET_DEVICE``.
    ``outputs``: the value id of each flattened output leaf (None for a leaf
    that is no meta tensor). ``rng``: ``(generator or None for the device's
    default, its state before the op)`` for a random op.
    """

    func: Any
    leaves: tuple
    spec: Any
    outputs: tuple[int | None, ...]
    inputs: tuple[int, ...]
    reads: frozenset[int]
    touches: frozenset[int]
    rng: tuple[torch.Generator | None, torch.Tensor] | None


@dataclass(frozen=True)
class AliasEntry:
    """A meta tensor that shares a recorded storage but was made without an op
    the mode sees (``nn.Parameter(t)``, ``.data``, ``p.data = t``): ``source``
    (a value id of that storage, None when the storage was never recorded)
    viewed with this tensor's layout; ``exact`` when the source has that same
    layout (then the replayed source is aliased as is)."""

    vid: int
    source: int | None
    exact: bool
    storage: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int

    @property
    def inputs(self) -> tuple[int, ...]:
        return () if self.source is None else (self.source,)


LogEntry = Union[RecordedOp, AliasEntry]


def signature_of(t: torch.Tensor) -> Signature:
    return storage_key(t), t.dtype, tuple(t.shape), tuple(t.stride()), t.storage_offset()


def version_of(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:  # inference-mode tensors have no version counter
        return None


def op_name(func: Any) -> str:
    name = op_overload_name(func)
    if name is not None:
        return f"{name[0]}.{name[1]}"
    return f"{getattr(func, '__module__', '')}.{getattr(func, '__qualname__', func)}"
