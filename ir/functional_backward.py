"""Functional writes in a captured program: ``aten.copy``'s DTensor sharding,
and the backward of the ops autograd or DTensor cannot differentiate as
they stand.

The capture is functional: a write into part of a tensor becomes
``aten.copy`` (the values written, in the destination's shape and dtype) and a
view-scatter op (``slice_scatter``, ``select_scatter``, ``diagonal_scatter``).
Hugging Face DeepSeek-V3's attention writes the two parts of each key into
one new tensor so: ``empty``, then ``copy`` and ``slice_scatter`` for each
part. Run for training:

* ``aten.copy`` has no derivative in torch (``derivative for aten::copy is
  not implemented``); :func:`register_functional_backward` gives it one: the
  gradient goes to the values written (cast to their dtype, summed over
  what was broadcast), none to the destination, whose values are overwritten.
  DTensor has no strategy for it either (the planner ran it replicated): it
  is placed as its destination, sharded on any dim the values written share
  (or broadcast), or replicated.
* autograd's backward of a view-scatter op makes the zeros of ``src``'s
  saved size as a plain tensor, which DTensor refuses beside the DTensor
  gradient (``got mixed torch.Tensor and DTensor``); those zeros have the
  global size and are the same on every rank, so DTensor is made to take
  plain tensor arguments of these ops as replicated.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import torch

from ir.torch_compat import (register_dtensor_handler, register_sharding_rule, tree_leaves,
                             tree_map, without_dtensor_handler)

__all__ = ["COPY", "VIEW_SCATTERS", "register_functional_backward"]

#: The captured node target of the functional copy.
COPY = "aten.copy.default"
#: The captured node targets of the view-scatter ops.
VIEW_SCATTERS = ("aten.slice_scatter.default", "aten.select_scatter.default",
                 "aten.diagonal_scatter.default")


def register_functional_backward(targets: set[str]) -> None:
    """Make the ops among ``targets`` (captured node targets) trainable as
    the module docstring says, once per process each."""
    if COPY in targets:
        _register_copy_derivative()
        _register_copy_sharding()
    if targets.intersection(VIEW_SCATTERS):
        _register_view_scatters()


@functools.lru_cache(maxsize=1)
def _register_copy_derivative() -> None:
    library = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():
        # torch warns that the kernel replaces the one that raises "not implemented"
        warnings.simplefilter("ignore")
        library.impl("copy", _copy, "Autograd")
    _LIBRARIES.append(library)


#: the registrations made, held for the life of the process
_LIBRARIES: list[Any] = []


@functools.lru_cache(maxsize=1)
def _register_copy_sharding() -> None:
    register_sharding_rule(torch.ops.aten.copy.default, _copy_rule)


def _copy_rule(self: Any, src: Any, *args: Any, **kwargs: Any) -> list[tuple[list, list]]:  # noqa: ARG001
    """``([out], [self, src])`` placements on one mesh axis: replicated, or
    sharded on a dim of ``self``, ``src`` on the same dim where it has it
    whole (aligned from the right) and replicated where it broadcasts."""
    from torch.distributed.tensor import Replicate, Shard

    rows = [([Replicate()], [Replicate(), Replicate()])]
    offset = self.ndim - src.ndim
    for d in range(self.ndim):
        k = d - offset
        if k >= 0 and src.shape[k] == self.shape[d]:
            rows.append(([Shard(d)], [Shard(d), Shard(k)]))
        elif k < 0 or src.shape[k] == 1:
            rows.append(([Shard(d)], [Shard(d), Replicate()]))
    return rows


def _copy(self: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    return _Copy.apply(self, src, non_blocking)


class _Copy(torch.autograd.Function):
    """``aten.copy(self, src)``: ``src``'s values in a tensor like ``self``."""

    @staticmethod
    def forward(ctx: Any, self: torch.Tensor, src: torch.Tensor,
                non_blocking: bool) -> torch.Tensor:
        ctx.src_shape, ctx.src_dtype = tuple(src.shape), src.dtype
        out = torch.empty_like(self)
        out.copy_(src, non_blocking=non_blocking)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        grad_src = grad.to(ctx.src_dtype)
        if tuple(grad_src.shape) != ctx.src_shape:
            grad_src = grad_src.sum_to_size(ctx.src_shape)
        return None, grad_src, None


@functools.lru_cache(maxsize=1)
def _register_view_scatters() -> None:
    aten = torch.ops.aten
    for op in (aten.slice_scatter.default, aten.select_scatter.default,
               aten.diagonal_scatter.default):
        register_dtensor_handler(op, _plain_tensors_replicated)


def _plain_tensors_replicated(op: Any, args: tuple, kwargs: dict) -> Any:
    """``op`` on ``args``, each plain tensor among them a replicated DTensor,
    run by DTensor's own sharding propagation."""
    from torch.distributed.tensor import DTensor, Replicate

    mesh = next(a.device_mesh for a in tree_leaves((args, kwargs)) if isinstance(a, DTensor))

    def replicated(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
            return DTensor.from_local(value, mesh, [Replicate()] * mesh.ndim, run_check=False)
        return value

    args, kwargs = tree_map(replicated, (args, kwargs))
    with without_dtensor_handler(op):
        return op(*args, **kwargs)
