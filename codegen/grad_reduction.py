"""Gradients brought to their parameters' placements in few collectives.

After backward a data-parallel gradient is a pending sum over the mesh axis
its parameter is replicated on (DTensor ``Partial``). DTensor's
``redistribute`` reduces one tensor per call: one all-reduce per parameter,
each paying the collective's latency (a millisecond on gloo) and DTensor's
per-call work on the host. :func:`redistribute_grads` sums those gradients
together instead, as DDP buckets its gradients: per (mesh, axis, dtype), in
buckets of at most :data:`BUCKET_BYTES`, one all-reduce of the bucket's
tensors concatenated (:func:`all_reduce_flat`) each. Every other move goes
through DTensor's ``redistribute``.

ZeRO-1 (:mod:`codegen.zero1`) uses :func:`sum_slices` where the backend has
no reduce-scatter of its own (gloo makes each reduce-scatter an all-reduce of
the whole tensor) and :func:`gather_slices` to all-gather its updated
slices in one flat call. :func:`prefer_foreach` has torch's optimizer
update all its tensors with one multi-tensor (``foreach``) op per step of
its arithmetic, which on the CPU it does not choose by itself: on DTensors
that is one DTensor dispatch per op instead of one per op and tensor.

The sums are the backend's all-reduce of the same values: on two ranks bit
for bit DTensor's; on more, gloo's ring may add an element's terms in
another order when it sits elsewhere in the flat buffer (a rounding
apart: 2.4e-7 at most on three ranks, fp32 values of order 1). The
gathers copy values only, and are exact.
"""

from __future__ import annotations

from typing import Any, Callable, Hashable, Iterable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial
from torch.distributed.tensor.placement_types import Placement

from codegen.redistribution import redistribute
from costmodel.cluster import backend_reduce_scatters_by_all_reduce

__all__ = ["BUCKET_BYTES", "all_gather_flat", "all_reduce_flat", "gather_slices",
           "grads_to_placements", "is_pending_sum", "prefer_foreach", "redistribute_grads",
           "reduce_scatter_is_all_reduce", "sum_slices", "summed_axis"]

#: The most bytes one coalesced collective moves (DDP's default bucket, 25 MiB).
BUCKET_BYTES = 25 * 2**20


def is_pending_sum(placement: Placement) -> bool:
    """Whether ``placement`` is a plain pending sum (not an average, not
    DTensor's masked partial of an embedding lookup)."""
    return type(placement) is Partial and placement.reduce_op == "sum"


def summed_axis(have: Sequence[Placement], want: Sequence[Placement]) -> int | None:
    """The mesh axis on which ``have`` is a pending sum that ``want``
    replicates, where it is the only axis that differs; else None."""
    differ = [i for i, (h, w) in enumerate(zip(have, want)) if h != w]
    if len(differ) != 1:
        return None
    axis = differ[0]
    return axis if is_pending_sum(have[axis]) and want[axis].is_replicate() else None


def _buckets(items: Sequence[tuple[Any, torch.Tensor]]) -> Iterator[list[tuple[Any, torch.Tensor]]]:
    """``items`` ((key, tensor) pairs) in runs of at most :data:`BUCKET_BYTES`
    (a tensor larger than that is a run of its own)."""
    run: list[tuple[Any, torch.Tensor]] = []
    size = 0
    for item in items:
        nbytes = item[1].numel() * item[1].element_size()
        if run and size + nbytes > BUCKET_BYTES:
            yield run
            run, size = [], 0
        run.append(item)
        size += nbytes
    if run:
        yield run


def _bucket_runs(items: Iterable[tuple[Hashable, Any, torch.Tensor]]
                 ) -> Iterator[tuple[Hashable, list[tuple[Any, torch.Tensor]]]]:
    """``items`` ((group, key, tensor) triples) grouped by ``group`` (in the
    order groups first appear; a coalesced collective takes one dtype on one
    process group), each group in runs of :func:`_buckets`: (group, run of
    (key, tensor) pairs)."""
    groups: dict[Hashable, list[tuple[Any, torch.Tensor]]] = {}
    for group, key, tensor in items:
        groups.setdefault(group, []).append((key, tensor))
    for group, same in groups.items():
        for run in _buckets(same):
            yield group, run


def _flat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``tensors`` (one dtype) concatenated into one new 1-D tensor."""
    return torch.cat([t.reshape(-1) for t in tensors])


def all_reduce_flat(tensors: Sequence[torch.Tensor], group: Any) -> list[torch.Tensor]:
    """The sums of ``tensors`` (one dtype) over process ``group``, new
    tensors of their shapes and strides: one all-reduce of them concatenated,
    as DDP reduces a bucket. (torch's coalesced all-reduce waits for and
    copies each tensor apart: on gloo 2-3x the time of one all-reduce of the
    same bytes for 160 tensors.)"""
    if not tensors:
        return []
    flat = _flat(tensors)
    dist.all_reduce(flat, group=group)
    out = []
    for piece, t in zip(flat.split([t.numel() for t in tensors]), tensors):
        summed = piece.view(t.shape)
        out.append(summed if t.is_contiguous() else torch.empty_like(t).copy_(summed))
    return out


def all_gather_flat(tensors: Sequence[torch.Tensor], group: Any) -> list[torch.Tensor]:
    """Every rank's ``tensors`` (one dtype, at least one dimension; the same
    shapes on every rank) of process ``group`` concatenated along dim 0, rank
    order (each of ``group size x`` its rows), new tensors: one all-gather of
    them concatenated (torch's coalesced one waits for each tensor apart: on
    gloo 1.5-3x slower for 160 tensors)."""
    if not tensors:
        return []
    flat = _flat(tensors)
    ranks = dist.get_world_size(group)
    gathered = flat.new_empty(ranks * flat.numel())
    dist.all_gather_into_tensor(gathered, flat, group=group)
    by_rank = gathered.view(ranks, flat.numel())
    out, start = [], 0
    for t in tensors:
        rows = by_rank[:, start:start + t.numel()]
        out.append(rows.reshape((ranks * t.shape[0], *t.shape[1:])))
        start += t.numel()
    return out


def _sum_runs(runs: Iterable[tuple[Any, list[tuple[Any, torch.Tensor]]]],
              process_group: Callable[[Any], Any]) -> Iterator[tuple[Any, torch.Tensor]]:
    """(key, the tensor summed) for every (key, tensor) of ``runs``
    (:func:`_bucket_runs`), one flat all-reduce per run over
    ``process_group(group)``."""
    for group, run in runs:
        summed = all_reduce_flat([t for _, t in run], process_group(group))
        yield from zip((key for key, _ in run), summed)


def redistribute_grads(grads: Sequence[DTensor], targets: Sequence[Sequence[Placement]]
                       ) -> list[DTensor]:
    """Each of ``grads`` redistributed to its ``targets`` placements (on its
    own mesh): the pending sums over one mesh axis summed together (see the
    module docstring), the rest by :func:`codegen.redistribution.redistribute`."""
    out: list[DTensor | None] = [None] * len(grads)
    pending: list[tuple[Hashable, int, torch.Tensor]] = []
    meshes: dict[int, DeviceMesh] = {}
    for i, (grad, want) in enumerate(zip(grads, targets)):
        axis = summed_axis(tuple(grad.placements), tuple(want))
        if axis is None:
            out[i] = redistribute(grad, grad.device_mesh, want)
            continue
        meshes[id(grad.device_mesh)] = grad.device_mesh
        pending.append(((id(grad.device_mesh), axis, grad.dtype), i, grad.to_local()))
    for i, summed in _sum_runs(_bucket_runs(pending),
                               lambda group: meshes[group[0]].get_group(group[1])):
        grad = grads[i]
        out[i] = DTensor.from_local(summed, grad.device_mesh, tuple(targets[i]), run_check=False,
                                    shape=grad.shape, stride=grad.stride())
    return out  # type: ignore[return-value]


def grads_to_placements(params: Iterable[torch.nn.Parameter]) -> int:
    """Bring each of ``params``' DTensor gradients that is not yet on its
    parameter's placements there (:func:`redistribute_grads`), in place of
    ``grad``; returns how many moved."""
    pending = [p for p in params if isinstance(p.grad, DTensor)
               and tuple(p.grad.placements) != tuple(p.placements)]
    for p, grad in zip(pending, redistribute_grads([p.grad for p in pending],
                                                   [p.placements for p in pending])):
        p.grad = grad
    return len(pending)


def reduce_scatter_is_all_reduce(mesh: DeviceMesh) -> bool:
    """Whether the backend of 1-D ``mesh`` reduce-scatters by all-reducing
    each tensor whole (gloo): one coalesced all-reduce then costs no more
    bytes, and one call instead of one per tensor."""
    return backend_reduce_scatters_by_all_reduce(dist.get_backend(mesh.get_group()))


def sum_slices(pieces: Sequence[tuple[torch.Tensor, int, int, int]], mesh: DeviceMesh
               ) -> list[torch.Tensor]:
    """For each (local pending sum, dim, start, length) of ``pieces``: rows
    ``start:start+length`` along ``dim`` of its sum over 1-D ``mesh`` (what
    a reduce-scatter gives this rank), new contiguous tensors."""
    out: list[torch.Tensor | None] = [None] * len(pieces)
    items = ((t.dtype, k, t) for k, (t, _, _, _) in enumerate(pieces))
    for k, summed in _sum_runs(_bucket_runs(items), lambda _: mesh.get_group()):
        _, dim, start, length = pieces[k]
        # a copy: a view would keep the whole sum alive
        out[k] = summed.narrow(dim, start, length).clone(memory_format=torch.contiguous_format)
    return out  # type: ignore[return-value]


def gather_slices(pieces: Sequence[tuple[torch.Tensor, int, int]], mesh: DeviceMesh
                  ) -> list[torch.Tensor]:
    """For each (this rank's slice, dim, whole size along dim) of ``pieces``,
    cut as DTensor's ``Shard(dim)`` cuts (``torch.chunk``: the last slices
    shorter or empty): the whole tensor, every rank's slices concatenated
    along ``dim``, as DTensor's ``Shard -> Replicate`` gives it. Slices are
    padded to one length, as DTensor pads them, and all-gathered in one
    flat call per dtype and bucket (:func:`all_gather_flat`)."""
    parts = mesh.size()
    padded: list[tuple[Hashable, int, torch.Tensor]] = []
    for k, (piece, dim, size) in enumerate(pieces):
        rows = piece.movedim(dim, 0)
        step = -(-size // parts)
        if rows.shape[0] < step:
            rows = torch.cat([rows, rows.new_zeros((step - rows.shape[0],) + rows.shape[1:])])
        padded.append((piece.dtype, k, rows.contiguous()))
    out: list[torch.Tensor | None] = [None] * len(pieces)
    for _, run in _bucket_runs(padded):
        gathered = all_gather_flat([t for _, t in run], mesh.get_group())
        for (k, _), whole in zip(run, gathered):
            _, dim, size = pieces[k]
            out[k] = whole[:size].movedim(0, dim)
    return out  # type: ignore[return-value]


def prefer_foreach(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """``opt`` set to update each parameter group with torch's multi-tensor
    (``foreach``) implementation where the group leaves the choice to torch
    (``foreach=None``, not fused) and its tensors are all DTensors of one
    mesh or all plain tensors (a multi-tensor op takes one kind). torch picks
    it by itself on GPUs only; on the CPU its multi-tensor ops run the same
    per-tensor kernels, so the values are the same, bit for bit."""
    for group in opt.param_groups:
        if "foreach" not in group or group["foreach"] is not None or group.get("fused"):
            continue
        kinds = {id(p.device_mesh) if isinstance(p, DTensor) else None for p in group["params"]}
        if len(kinds) == 1:
            group["foreach"] = True
    return opt
