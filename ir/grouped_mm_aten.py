"""torch's own grouped matmul, ``aten._grouped_mm``, sharded as
:mod:`ir.grouped_mm` shards transformers' fallback: expert parallel with its
all-to-all, by rows, by columns, by the contraction.

transformers 5 (``integrations/moe.py``, ``_can_use_grouped_mm``) calls
``torch.nn.functional.grouped_mm`` instead of its fallback wherever torch's
kernel runs (GPUs from sm80, CPU from torch 2.9) except while compiling in
another dtype than bf16, which a capture by torch.export counts as: a bf16
capture, on CPU as on GPU, holds ``aten._grouped_mm.default(x [S, K],
w [E, K, N], offs [E])`` (``w`` a transposed view of the experts'
``[E, N, K]``) where an fp32 one holds the fallback. DTensor's own
strategies for it keep the experts whole, and its rows too (``offs`` counts
global rows). Autograd's backward of it (the planner's ranks run the
captured forward on DTensors and autograd runs its backward) is two calls of
the same op (torch 2.13's formula): ``dx = dy [S, N]`` by ``w^T [E, N, K]``
with offs, the forward form again, and ``dw^T = dy^T [N, S]`` by
``x [S, K]`` with offs, ``[E, N, K]``: a 2-D by 2-D form whose groups are
slices of the contraction. A handler runs both forms on DTensors
(:func:`ir.torch_compat.register_dtensor_handler`):

* the forward form (``x`` 2-D by ``w`` 3-D): :func:`ir.grouped_mm.grouped_forward`,
  the fallback's kinds and all-to-all; the planner reads these strategies;
* the weight-gradient form (``a`` 2-D by ``b`` 2-D): the kinds of the forward
  call that took ``b`` as its x, placements those of the fallback's
  ``dy``, ``x`` and ``dw`` transposed (``a = dy^T``, the result ``dw^T``).
  The call has no weight, so those kinds are recorded when the forward runs,
  under the very tensor autograd saves and passes back as ``b``; with no
  record (a direct call) the weight counts as replicated. ``EP``'s all-to-all
  brings each rank's rows of ``dy`` and ``x`` to the ranks holding their
  experts, and ``dw`` comes out sharded by experts;
* other forms (3-D batches, 3-D by 2-D), a bias, no ``offs``: DTensor's own
  strategies and run (whose shape check, torch's meta function, takes bf16
  only).

The planner prices an ``EP`` node's all-to-alls as the fallback's, with dy
moved twice in the backward (its two calls each move it):
:data:`ir.grouped_mm.BACKWARD_EXCHANGES`.

The local calls get operands whose strides are multiples of 16 bytes, as
torch's kernel requires (a shard of a narrow tensor is copied into a padded
one). Rows of y past ``offs[-1]`` come out zero (torch's kernel leaves them
unwritten).
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import torch
from torch.distributed.tensor.placement_types import Shard

from ir.grouped_mm import (_KINDS, _R, _as_dtensor, _kinds, _one_expert_axis, _placed,
                           _placements, _rows, _wrap, gradient_placements, grouped_forward)
from ir.torch_compat import register_dtensor_handler, without_dtensor_handler
from ir.torch_compat.op_forms import register_sharding_rule_where

__all__ = ["register_aten_grouped_mm_sharding"]

#: aten._grouped_mm's arguments, in its schema's order, with their defaults.
_ARGUMENTS = (("self", None), ("mat2", None), ("offs", None), ("bias", None), ("out_dtype", None))

#: The attribute of a forward-form call's x that holds its weight's
#: placements (the kinds its weight-gradient call runs under): it lives and
#: goes with the tensor autograd saves and passes back.
_WEIGHT_PLACEMENTS = "_grouped_mm_weight_placements"

#: kernel stride alignment, bytes
_ALIGN = 16


@functools.lru_cache(maxsize=1)
def register_aten_grouped_mm_sharding() -> None:
    """Give DTensor ``aten._grouped_mm``'s forward-form strategies (each kind
    of :mod:`ir.grouped_mm` on one mesh axis, experts sharded on one axis at
    most) and run the forward and weight-gradient forms on DTensors by them,
    once per process."""
    op = torch.ops.aten._grouped_mm.default
    register_sharding_rule_where(op, _rule, _forward_form, keep=_one_expert_axis)
    register_dtensor_handler(op, _run)


def _forward_form(x: Any, w: Any, offs: Any = None, bias: Any = None,
                  out_dtype: Any = None) -> bool:
    """Whether a call (tensors as their number of dims) is the forward form."""
    del out_dtype
    return x == 2 and w == 3 and offs is not None and bias is None


def _rule(x: Any, w: Any, offs: Any = None, bias: Any = None,
          out_dtype: Any = None) -> list[tuple[list, list]]:
    """The single-axis strategies of the forward form: ``([y], [x, w, offs,
    bias])`` of each kind."""
    del x, w, offs, bias, out_dtype
    return [([y], [px, pw, _R, None]) for px, pw, y, *_ in _KINDS.values()]


def _bound(args: tuple, kwargs: dict) -> list[Any]:
    bound = dict(_ARGUMENTS)
    bound.update(zip(bound, args))
    bound.update(kwargs)
    return [bound[name] for name, _ in _ARGUMENTS]


def _run(op: Any, args: tuple, kwargs: dict) -> Any:
    """``aten._grouped_mm`` on DTensors: the forward and weight-gradient forms
    by :mod:`ir.grouped_mm`'s kinds, the others by DTensor itself."""
    from torch.distributed.tensor import DTensor

    x, w, offs, bias, out_dtype = _bound(args, kwargs)
    form = (x.ndim, w.ndim)
    if offs is None or bias is not None or form not in ((2, 3), (2, 2)):
        with without_dtensor_handler(op):
            return op(*args, **kwargs)
    mesh = next(t.device_mesh for t in (x, w, offs) if isinstance(t, DTensor))
    x, w = _as_dtensor(x, mesh), _as_dtensor(w, mesh)

    def call(a: torch.Tensor, b: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        return op(_aligned(a), _aligned(b), ends, out_dtype=out_dtype)

    if form == (2, 3):
        setattr(x, _WEIGHT_PLACEMENTS, tuple(w.placements))
        return grouped_forward(call, x, w, offs)
    return _weight_gradient(call, x, w, offs)


def _weight_gradient(call: Any, a: Any, b: Any, offs: Any) -> Any:
    """``call(a [M, S], b [S, N], offs) -> [E, M, N]`` on DTensors, ``a`` the
    gradient of y transposed and ``b`` x, under the kinds of the forward call
    that took ``b`` (the module docstring)."""
    mesh = b.device_mesh
    experts = getattr(b, _WEIGHT_PLACEMENTS, (_R,) * mesh.ndim)
    with torch.no_grad():
        kinds = _kinds(b.placements, experts)
        dy, _, dw = gradient_placements(kinds, _swapped(a.placements, 0, 1), b.placements)
        a = _placed(a, _swapped(dy, 0, 1))
        b = _placed(b, _placements(kinds, 0, b.placements))
        out = _swapped(dw, 1, 2)
        rows = _rows(kinds, b, out, offs)
        al, bl = a.to_local(), b.to_local()
        local = call(rows.to_experts(al.t()).t(), rows.to_experts(bl), rows.offsets(bl.device))
        return _wrap(local, mesh, out, (len(rows.ends), a.shape[0], b.shape[1]))


def _swapped(placements: Sequence[Any], d1: int, d2: int) -> tuple:
    """``placements`` of a tensor with its dims ``d1`` and ``d2`` swapped."""
    swap = {d1: d2, d2: d1}
    return tuple(Shard(swap[p.dim]) if isinstance(p, Shard) and p.dim in swap else p
                 for p in placements)


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` (2-D or 3-D) with its non-unit stride of the last two dims a
    multiple of 16 bytes, as torch's kernel requires: ``t`` itself where it
    is, else a copy whose rows (or columns) are padded."""
    if t.stride(-1) == 1 and t.stride(-2) >= max(1, t.shape[-1]):
        last, stride = -1, t.stride(-2)
    elif t.stride(-2) == 1 and t.stride(-1) >= max(1, t.shape[-2]):
        last, stride = -2, t.stride(-1)
    else:
        t, last = t.contiguous(), -1
        stride = t.stride(-2)
    if stride * t.element_size() % _ALIGN == 0:
        return t
    step = _ALIGN // t.element_size()
    if last == -2:
        return _aligned(t.transpose(-2, -1)).transpose(-2, -1)
    width = -(-t.shape[-1] // step) * step
    out = t.new_empty(tuple(t.shape[:-1]) + (width,))[..., :t.shape[-1]]
    out.copy_(t)
    return out
