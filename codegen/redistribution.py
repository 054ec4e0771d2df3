"""Placements as the runtime reads and moves them.

* :func:`redistribute` moves a DTensor to other placements, ``Partial`` included,
  and :func:`keep_layout` keeps the source's local memory layout across it;
* :func:`on_mesh` / :func:`plan_on_mesh` read a plan's placements on a mesh
  whose axes of one device make every placement a replica;
* :func:`same_placements` says whether observed placements satisfy the plan's,
  :func:`reachable_target` what a redistribution can actually ask for, and
  :func:`unmask` turns DTensor's masked partial into an ordinary pending sum.

Placement strings are the plan's (:mod:`ir.placements`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.distributed.tensor.placement_types import Placement

from ir.placements import MASKED_PARTIAL, parse_placement, placement_str
from ir.torch_compat import autograd_redistribute, is_mask_partial, local_tensor, zero_masked_rows
from plan.format import Plan

__all__ = ["contiguous_strides", "keep_layout", "laid_out", "on_mesh", "permuted_strides",
           "placements_of", "plan_on_mesh", "reachable_target", "redistribute", "relaid",
           "same_placements", "unmask"]


def placements_of(value: Any) -> list[str]:
    """Placement strings of a DTensor; [] for anything else."""
    if isinstance(value, DTensor):
        return [placement_str(p) for p in value.placements]
    return []


def redistribute(value: DTensor, mesh: DeviceMesh, placements: Sequence[Placement]) -> DTensor:
    """``value.redistribute(mesh, placements)``, also to ``Partial``.

    The public API refuses Replicate -> Partial, which DTensor itself does inside
    ops (a replicated bias added to a row-parallel matmul's partial sum); a plan
    that spells that reshard out goes through the same autograd function
    (:func:`ir.torch_compat.autograd_redistribute`).
    """
    placements = tuple(placements)
    out = _redistribute(value, mesh, placements)
    # DTensor's backward of a redistribution out of a non-sum partial (P(avg) -> R)
    # asks to turn a P(sum) gradient into P(avg), which it cannot do; reducing such a
    # gradient on those mesh dims first gives the gradient DTensor expects.
    dims = [i for i, (p, q) in enumerate(zip(value.placements, placements))
            if p.is_partial() and getattr(p, "reduce_op", "sum") != "sum" and p != q]
    if dims and out.requires_grad:
        def _reduce_partial_grad(grad: Any) -> Any:
            if isinstance(grad, DTensor) and any(grad.placements[i].is_partial() for i in dims):
                fixed = [Replicate() if i in dims and p.is_partial() else p
                         for i, p in enumerate(grad.placements)]
                return grad.redistribute(grad.device_mesh, fixed)
            return grad
        out.register_hook(_reduce_partial_grad)
    return out


def _redistribute(value: DTensor, mesh: DeviceMesh, placements: tuple[Placement, ...]) -> DTensor:
    if not any(p.is_partial() and p != q for p, q in zip(placements, value.placements)):
        return value.redistribute(mesh, placements)
    return autograd_redistribute(value, mesh, placements)


def keep_layout(src: DTensor, out: DTensor) -> DTensor:
    """``out``, a resharding of ``src``, with ``src``'s local memory layout.

    Collectives return contiguous shards, but the program was captured with
    the producer's layout and may rely on it: the fused attention writes
    [batch, seq, heads, dim] memory under a [batch, heads, seq, dim] shape, so
    the capture has no copy between its transpose back and the ``view`` that
    merges the heads, which fails on a contiguous all-gathered output. A
    dense permuted layout is restored (one local copy); anything else, and
    partial sums, are left as they are."""
    a, b = local_tensor(src), local_tensor(out)
    if a.ndim < 2 or a.ndim != b.ndim or a.is_contiguous() or any(
            p.is_partial() for p in out.placements):
        return out
    order = sorted(range(a.ndim), key=lambda d: -a.stride(d))
    if not a.permute(order).is_contiguous() or b.permute(order).is_contiguous():
        return out
    return laid_out(out.to_local(), out.device_mesh, out.placements, out.shape, order)


def laid_out(local: torch.Tensor, mesh: DeviceMesh, placements: Sequence[Placement],
             shape: Sequence[int], order: Sequence[int]) -> DTensor:
    """A DTensor of global ``shape`` from this rank's block ``local``, laid out
    densely in memory with its dims in ``order`` (outermost first; one local
    copy where ``local`` is not), its global strides saying so: DTensor
    decides by them whether a later ``view`` runs on the shards."""
    return DTensor.from_local(relaid(local, order), mesh, placements, run_check=False,
                              shape=torch.Size(shape), stride=permuted_strides(shape, order))


def relaid(local: torch.Tensor, order: Sequence[int]) -> torch.Tensor:
    """``local`` laid out densely in memory with its dims in ``order``
    (outermost first): itself where it already is, else one copy (through
    autograd)."""
    if local.permute(*order).is_contiguous():
        return local
    inverse = sorted(range(len(order)), key=lambda d: order[d])
    return local.permute(*order).contiguous().permute(*inverse)


def on_mesh(placements: Sequence[str], mesh_shape: Sequence[int]) -> list[str]:
    """``placements`` as they act on a mesh of ``mesh_shape``: on an axis of one
    device a shard or a partial sum is the whole tensor, as a replica is, so
    they are read as ``R`` (no redistribution is ever needed between them)."""
    return [("R" if int(size) == 1 else p) for p, size in zip(placements, mesh_shape)]


def plan_on_mesh(plan: Plan, mesh_shape: Sequence[int]) -> Plan:
    """``plan`` with every placement read by :func:`on_mesh` for a (stage) mesh of
    ``mesh_shape``; ``plan`` itself when no axis has one device."""
    shape = tuple(int(d) for d in mesh_shape)
    if all(d > 1 for d in shape):
        return plan

    def each(lists: Sequence[Sequence[str]]) -> list[list[str]]:
        return [on_mesh(p, shape) if p else list(p) for p in lists]

    nodes = {k: dataclasses.replace(op, inputs=each(op.inputs), outputs=each(op.outputs))
             for k, op in plan.nodes.items()}
    pipeline = plan.pipeline
    if pipeline is not None:
        pipeline = dataclasses.replace(pipeline, stages=[dataclasses.replace(
            st, inputs={k: on_mesh(v, shape) for k, v in st.inputs.items()},
            outputs={k: on_mesh(v, shape) for k, v in st.outputs.items()})
            for st in pipeline.stages])
    placed = {k: on_mesh(v, shape) for k, v in plan.parameters.items()}
    inputs = {k: on_mesh(v, shape) for k, v in plan.inputs.items()}
    return dataclasses.replace(plan, parameters=placed, inputs=inputs, nodes=nodes,
                               pipeline=pipeline)


def same_placements(have: Sequence[str], want: Sequence[str]) -> bool:
    """Whether placements ``have`` satisfy the plan's ``want`` (``P(mask)`` satisfies ``P``)."""
    if len(have) != len(want):
        return False
    return all(h == w or (h == MASKED_PARTIAL and w == "P") for h, w in zip(have, want))


def reachable_target(value: DTensor, want: Sequence[str]) -> tuple[Placement, ...]:
    """The placements to redistribute ``value`` to for the plan's ``want``.

    A partial on an index tensor (``P(mask)``, or ``P`` on integers) is DTensor's
    masked lookup, which it makes itself inside the op without communication: that
    mesh dim is left as it is.
    """
    integer = not (value.dtype.is_floating_point or value.dtype.is_complex)
    target = []
    for have, w in zip(value.placements, want):
        if w == MASKED_PARTIAL or (integer and w.startswith("P")):
            target.append(have)
        else:
            target.append(parse_placement(w))
    return tuple(target)


def unmask(value: DTensor) -> DTensor:
    """Turn DTensor's masked partial (an ``embedding``/``gather`` output) into ``Partial("sum")``.

    The masked partial holds garbage rows for lookups another rank owns until its
    one reduction zeroes them, and its mask can be used only once: a value read by
    two ops cannot stay masked. Zeroing the rows here (locally, no communication)
    gives an ordinary pending sum. The gradient passes straight through, exactly as
    through DTensor's own reduction of the masked partial.
    """
    placements = list(value.placements)
    local = value.to_local()
    with torch.no_grad():
        masked = local.clone()
        for i, p in enumerate(placements):
            if is_mask_partial(p):
                zero_masked_rows(p, masked)
                placements[i] = Partial(p.reduce_op)
    local = local + (masked - local).detach()
    return DTensor.from_local(local, value.device_mesh, placements, run_check=False,
                              shape=value.shape, stride=value.stride())


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Strides of a contiguous tensor of ``shape``, in elements."""
    return permuted_strides(shape, range(len(shape)))


def permuted_strides(shape: Sequence[int], order: Sequence[int]) -> tuple[int, ...]:
    """Strides, in elements, of a dense tensor of ``shape`` whose dims lie in
    memory in ``order``, outermost first (contiguous: ``0 .. n - 1``)."""
    strides, step = [0] * len(shape), 1
    for d in reversed(list(order)):
        strides[d] = step
        step *= max(int(shape[d]), 1)
    return tuple(strides)
