"""ZeRO-1 for a pipeline stage: optimizer states sharded over one stage-mesh axis.

What Megatron-LM's distributed optimizer does, with DTensor collectives.

Without a mixed precision (fp32, bf16: the parameters are in the dtype the
optimizer updates):

* the stage's parameters stay whole (as the plan places them) for forward and
  backward; their gradient sums over the ZeRO axis stay pending (DTensor
  ``Partial``) through all micro-batches;
* at the step, each parameter replicated on the ZeRO axis has its gradient
  reduce-scattered over that axis (``Partial -> Shard(d)``), the optimizer
  updates this rank's slice of the parameter in place (plain tensors that
  alias slices of the parameters' local tensors, so no copy exists; its
  states exist for that slice only), and the updated slices are all-gathered
  back into the whole parameter (``Shard(d) -> Replicate``); the stage's
  slices move together, in a few coalesced collectives
  (:mod:`codegen.grad_reduction`; on gloo, which reduce-scatters by
  all-reducing each tensor whole, one coalesced all-reduce of which each
  rank keeps its slice);
* a parameter the plan already shards on the ZeRO axis (an expert weight
  under expert parallelism) has states for its own shard only; its gradient
  is brought to its placements and it is updated as it is.

Under a mixed precision (bf16-mixed), Megatron's layout:

* the parameters forward reads are in the compute dtype (bf16), whole as
  placed; the master copy in the master dtype (fp32) exists only as this
  rank's slice (or, for a parameter sharded on the ZeRO axis, as its shard),
  and the optimizer steps it;
* each micro-batch's compute-dtype gradient is added into a main gradient in
  the reduction dtype (fp32 by default) as soon as autograd accumulates it
  (a post-accumulate-grad hook, Megatron's ``main_grad``; the split weight
  backward of the zero-bubble schedules sets ``grad`` without the hook and
  :meth:`StateShards.collect_grads` moves it after each backward chunk), so
  micro-batches accumulate in fp32 and the bf16 gradient lives one parameter
  at a time;
* at the step the main gradient is reduce-scattered in the reduction dtype
  into the master slice's ``grad``, the optimizer updates the master slices,
  and each updated slice is cast to bf16 and all-gathered into the bf16
  parameter.

The optimizer itself is torch's (any element-wise one: SGD, AdamW). Bytes per
parameter with Adam on an axis of n ranks: 4 + 4 + 8/n (fp32), 2 + 2 + 4/n
(bf16), 2 (bf16 parameter) + 4 (fp32 main gradient) + (4 + 8)/n (fp32 master
slice and moments) = 6 + 12/n under bf16-mixed: what
:func:`costmodel.memory.training_state_bytes` prices at ``zero_stage`` 1.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from codegen.grad_reduction import (gather_slices, redistribute_grads,
                                    reduce_scatter_is_all_reduce, sum_slices, summed_axis)
from codegen.redistribution import redistribute

__all__ = ["OptimizerGroup", "ShardedStateOptimizer", "StateShards", "slice_bounds"]

#: Builds torch's optimizer over a list of tensors (``torch.optim.AdamW`` and the like).
MakeOptimizer = Callable[[list[torch.Tensor]], torch.optim.Optimizer]


def slice_bounds(size: int, parts: int, index: int) -> tuple[int, int]:
    """(offset, length) of part ``index`` of ``size`` elements split in ``parts``
    as DTensor's ``Shard`` splits a dimension (``torch.chunk``: parts of
    ``ceil(size / parts)``, the last ones shorter or empty)."""
    step = -(-size // parts)
    start = min(index * step, size)
    return start, min(size, start + step) - start


def _shard_dim(shape: Sequence[int], parts: int, taken: set[int]) -> int | None:
    """The dimension a parameter's slices are cut along: the first at least
    ``parts`` long (every rank gets some) that no other mesh axis shards
    (``taken``), so that the slice is a plain DTensor shard of the parameter;
    else the first such dimension of any length; None where every dimension
    is taken (the parameter's states then stay whole)."""
    free = [d for d in range(len(shape)) if d not in taken]
    return next((d for d in free if shape[d] >= parts), free[0] if free else None)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor (not an autograd view), or the tensor itself."""
    with torch.no_grad():
        return t.to_local() if isinstance(t, DTensor) else t


@dataclass(eq=False)
class _Entry:
    """One parameter of a ZeRO-1 stage and what the optimizer steps for it."""

    param: nn.Parameter  # what forward reads, as the plan places it (compute dtype if mixed)
    master: torch.Tensor  # what the optimizer steps: this rank's slice, or a whole tensor
    dim: int | None  # the dimension the slices are cut along; None: stepped whole
    #: the master's placements as a shard of the parameter on the stage mesh
    #: (None where the master is placed as the parameter is)
    placements: tuple[Placement, ...] | None
    #: mixed precision: the micro-batches' gradient sum (local tensor, reduction
    #: dtype) and its DTensor placements; None until the first gradient
    main_grad: torch.Tensor | None = None
    grad_placements: tuple[Placement, ...] | None = None
    hooks: list[Any] = field(default_factory=list)


class StateShards:
    """ZeRO-1's slices of one stage's parameters over stage-mesh axis
    ``zero_axis`` (see the module docstring).

    Args:
        params: the stage's parameters as the plan places them (DTensors on
            ``mesh``), in the master dtype.
        mesh: the stage mesh.
        zero_axis: the axis the optimizer states are sharded over.
        compute_dtype: the dtype forward reads the parameters in; where it
            differs from theirs (a mixed precision) the parameters are replaced
            by compute-dtype ones (:meth:`parameters`, :meth:`replaced`) and the
            master values are kept only as this rank's slices.
        grad_dtype: the dtype micro-batch gradients are accumulated and
            reduced in under a mixed precision (the plan's ``reduce_dtype``).
    """

    def __init__(self, params: Iterable[nn.Parameter], mesh: DeviceMesh, zero_axis: int, *,
                 compute_dtype: torch.dtype | None = None,
                 grad_dtype: torch.dtype | None = None):
        names = mesh.mesh_dim_names
        if mesh.ndim > 1 and not names:
            raise ValueError("ZeRO-1 on a multi-axis stage mesh needs named mesh axes")
        self.mesh = mesh
        self.axis_mesh = mesh[names[zero_axis]] if mesh.ndim > 1 else mesh
        self.zero_axis = zero_axis
        self.parts = self.axis_mesh.size()
        #: the backend reduce-scatters by all-reducing (gloo): sum the slices together
        self._all_reduces = reduce_scatter_is_all_reduce(self.axis_mesh)
        self._coordinate = self.axis_mesh.get_local_rank()
        params = list(params)
        self.mixed = compute_dtype is not None and any(
            p.is_floating_point() and p.dtype != compute_dtype for p in params)
        self.compute_dtype = compute_dtype
        self.grad_dtype = grad_dtype or compute_dtype
        self.entries: list[_Entry] = []
        #: id(the parameter given) -> the parameter forward reads instead (mixed precision)
        self._replaced: dict[int, nn.Parameter] = {}
        for p in params:
            entry = self._entry(p)
            self.entries.append(entry)
            if entry.param is not p:
                self._replaced[id(p)] = entry.param
        if self.mixed:
            for entry in self.entries:
                entry.hooks.append(entry.param.register_post_accumulate_grad_hook(
                    lambda _p, e=entry: self._accumulate(e)))
        self._by_param = {id(e.param): e for e in self.entries}

    def _entry(self, p: nn.Parameter) -> _Entry:
        dim = None
        if isinstance(p, DTensor) and p.placements[self.zero_axis].is_replicate() and p.dim() > 0:
            taken = {q.dim for i, q in enumerate(p.placements)
                     if i != self.zero_axis and isinstance(q, Shard)}
            dim = _shard_dim(_local(p).shape, self.parts, taken)
        local = _local(p)
        placements = None
        if dim is None:
            master = p.detach() if self.mixed else p
        else:
            start, length = slice_bounds(local.shape[dim], self.parts, self._coordinate)
            master = local.narrow(dim, start, length)  # aliases the parameter's slice
            if self.mixed:
                master = master.clone()  # the fp32 parameter itself is let go
            full = list(p.placements)
            full[self.zero_axis] = Shard(dim)
            placements = tuple(full)
        if self.mixed:
            master = nn.Parameter(master, requires_grad=False)
            param = nn.Parameter(self._compute_copy(p), requires_grad=p.requires_grad)
        else:
            param = p
            if dim is not None:
                master = nn.Parameter(master, requires_grad=False)
        return _Entry(param, master, dim, placements)

    def _compute_copy(self, p: nn.Parameter) -> torch.Tensor:
        """``p``'s values in the compute dtype, placed as ``p``."""
        with torch.no_grad():
            local = _local(p).to(self.compute_dtype)
            if not isinstance(p, DTensor):
                return local
            return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False,
                                      shape=p.shape, stride=p.stride())

    # ------------------------------------------------------------ what is held
    def parameters(self) -> list[nn.Parameter]:
        """The parameters forward reads, in the order given."""
        return [e.param for e in self.entries]

    def replaced(self) -> dict[int, nn.Parameter]:
        """``id(parameter given)`` -> the compute-dtype parameter that forward
        reads instead (empty without a mixed precision)."""
        return dict(self._replaced)

    def tensors(self) -> list[torch.Tensor]:
        """What an optimizer steps: the master slices, then the masters kept whole."""
        return ([e.master for e in self.entries if e.dim is not None]
                + [e.master for e in self.entries if e.dim is None])

    def stepped(self) -> dict[int, tuple[torch.Tensor, tuple[Placement, ...] | None]]:
        """``id(parameter forward reads)`` -> (the tensor the optimizer steps for
        it, that tensor's placements as a shard of the parameter on the stage
        mesh; None where it is placed as the parameter)."""
        return {id(e.param): (e.master, e.placements) for e in self.entries}

    def master_of(self, param: nn.Parameter) -> torch.Tensor:
        """The master values of ``param`` (one forward reads): a DTensor of its
        global shape in the master dtype (fp32 under bf16-mixed), this rank
        holding its slice; ``param`` itself without a mixed precision. Written
        in place (a checkpoint load), they reach the parameter at the next
        :meth:`gather_params`."""
        entry = self._by_param[id(param)]
        if not self.mixed or entry.placements is None:
            return entry.master if self.mixed else param
        return DTensor.from_local(entry.master, param.device_mesh, entry.placements,
                                  run_check=False, shape=param.shape, stride=param.stride())

    # ------------------------------------------------------------- gradients
    def _accumulate(self, entry: _Entry) -> None:
        """Move the parameter's compute-dtype gradient into its main gradient
        (reduction dtype), keeping its pending placements."""
        grad = entry.param.grad
        if grad is None:
            return
        entry.param.grad = None
        if isinstance(grad, DTensor):
            if entry.grad_placements is None:
                entry.grad_placements = tuple(grad.placements)
            elif tuple(grad.placements) != entry.grad_placements:
                grad = redistribute(grad, grad.device_mesh, entry.grad_placements)
            grad = grad.to_local()
        if entry.main_grad is None:
            entry.main_grad = grad.to(self.grad_dtype)
        else:
            entry.main_grad.add_(grad)

    @torch.no_grad()
    def collect_grads(self) -> None:
        """Move gradients set without autograd's accumulation (the zero-bubble
        schedules' weight backward) into the main gradients (mixed precision;
        nothing otherwise)."""
        if self.mixed:
            for entry in self.entries:
                self._accumulate(entry)

    @torch.no_grad()
    def scale_grads(self, factor: float) -> None:
        """Divide the main gradients by ``factor`` (the schedule's division of
        the micro-batches' sum, which it applies to ``param.grad``)."""
        self.collect_grads()
        for entry in self.entries:
            if entry.main_grad is not None:
                entry.main_grad.div_(factor)

    def pending_grad(self, param: nn.Parameter) -> torch.Tensor | None:
        """``param``'s gradient summed over this step's micro-batches, before
        the step's reduction (a DTensor of pending sums, in the reduction dtype
        under a mixed precision); None if it has none."""
        entry = self._by_param[id(param)]
        if not self.mixed:
            return param.grad
        if entry.main_grad is None:
            return None
        if entry.grad_placements is None:
            return entry.main_grad
        return DTensor.from_local(entry.main_grad, param.device_mesh, entry.grad_placements,
                                  run_check=False, shape=param.shape, stride=param.stride())

    def _reduce_scatter(self, entry: _Entry, grad: DTensor) -> torch.Tensor:
        """This rank's slice of ``grad`` (the parameter's), summed over the ZeRO axis."""
        pending = grad.placements[self.zero_axis]
        want = list(entry.param.placements)
        want[self.zero_axis] = pending if pending.is_partial() else Replicate()
        if tuple(grad.placements) != tuple(want):  # other axes as the parameter has them
            grad = redistribute(grad, grad.device_mesh, want)
        on_axis = DTensor.from_local(grad.to_local(), self.axis_mesh, [want[self.zero_axis]],
                                     run_check=False)
        piece = on_axis.redistribute(self.axis_mesh, [Shard(entry.dim)]).to_local()
        if piece.shape != entry.master.shape:
            raise RuntimeError(f"ZeRO-1: DTensor split a gradient of {tuple(grad.shape)} "
                               f"into {tuple(piece.shape)} on this rank, the parameter slice is "
                               f"{tuple(entry.master.shape)}")
        return piece.to(entry.master.dtype)

    @torch.no_grad()
    def reduce_grads(self) -> int:
        """Reduce-scatter each sliced parameter's gradient into its master
        slice's ``grad`` and bring the gradients of the parameters stepped whole
        to their placements (into the master's ``grad`` under a mixed
        precision); the parameters' own gradients are dropped. Returns how many
        moved. Where the backend reduce-scatters by all-reducing (gloo), the
        pending sums are all-reduced together and each rank keeps its slice;
        the whole ones move together (:mod:`codegen.grad_reduction`)."""
        self.collect_grads()
        summed: list[tuple[_Entry, DTensor]] = []  # sliced, summed together
        whole: list[tuple[_Entry, torch.Tensor]] = []
        reduced = 0
        for entry in self.entries:
            grad = self.pending_grad(entry.param)
            if grad is None:
                continue
            entry.param.grad, entry.main_grad, entry.grad_placements = None, None, None
            if entry.dim is None:
                whole.append((entry, grad))
            elif self._sums_together(entry, grad):
                summed.append((entry, grad))
            else:
                entry.master.grad = self._reduce_scatter(entry, grad)
            reduced += entry.dim is not None
        self._sum_slices(summed)
        moving = [(e, g) for e, g in whole if isinstance(g, DTensor)
                  and tuple(g.placements) != tuple(e.param.placements)]
        moved = dict(zip((id(e) for e, _ in moving),
                         redistribute_grads([g for _, g in moving],
                                            [e.param.placements for e, _ in moving])))
        for entry, grad in whole:
            entry.master.grad = moved.get(id(entry), grad).to(entry.master.dtype)
        return reduced + len(moving)

    def _sums_together(self, entry: _Entry, grad: torch.Tensor) -> bool:
        """Whether ``grad`` (a sliced parameter's) is a pending sum over the
        ZeRO axis only, on a backend that reduce-scatters by all-reducing."""
        return (self._all_reduces and isinstance(grad, DTensor) and summed_axis(
            tuple(grad.placements), tuple(entry.param.placements)) == self.zero_axis)

    def _sum_slices(self, summed: list[tuple[_Entry, DTensor]]) -> None:
        """Each entry's master ``grad``: its slice of ``grad`` summed over the
        ZeRO axis, all in few coalesced all-reduces."""
        pieces = []
        for entry, grad in summed:
            local = grad.to_local()
            start, length = slice_bounds(local.shape[entry.dim], self.parts, self._coordinate)
            pieces.append((local, entry.dim, start, length))
        for (entry, _), piece in zip(summed, sum_slices(pieces, self.axis_mesh)):
            entry.master.grad = piece.to(entry.master.dtype)

    @torch.no_grad()
    def gather_params(self) -> None:
        """Write every rank's updated master slice into the parameters forward
        reads (cast to the compute dtype first under a mixed precision, so the
        all-gather moves bf16), all slices in few coalesced all-gathers."""
        sliced = []
        for entry in self.entries:
            local = _local(entry.param)
            if entry.dim is None:
                if self.mixed:
                    local.copy_(_local(entry.master))
                continue
            sliced.append((local, (entry.master.detach().to(local.dtype), entry.dim,
                                   local.shape[entry.dim])))
        whole = gather_slices([piece for _, piece in sliced], self.axis_mesh)
        for (local, _), values in zip(sliced, whole):
            local.copy_(values)

    def zero_grad(self) -> None:
        for entry in self.entries:
            entry.master.grad = None
            entry.param.grad = None
            entry.main_grad, entry.grad_placements = None, None


class ShardedStateOptimizer:
    """ZeRO-1 over one stage's :class:`StateShards`: see the module docstring.
    ``make`` builds torch's optimizer over :meth:`StateShards.tensors`."""

    def __init__(self, shards: StateShards, make: MakeOptimizer):
        self.shards = shards
        tensors = self.shards.tensors()
        self.optimizers = [make(tensors)] if tensors else []

    @torch.no_grad()
    def step(self) -> int:
        """Reduce-scatter, update, all-gather; returns how many gradients were reduced."""
        reduced = self.shards.reduce_grads()
        for opt in self.optimizers:
            opt.step()
        self.shards.gather_params()
        return reduced

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)
        self.shards.zero_grad()


class OptimizerGroup:
    """Several optimizers stepped as one (a rank's stages, each with its own)."""

    def __init__(self, optimizers: Sequence[object]):
        self.optimizers = list(optimizers)

    def step(self) -> int:
        """Step every optimizer; returns how many gradients the ZeRO-1 ones
        reduced in their step (torch's own optimizers report none)."""
        reduced = 0
        for opt in self.optimizers:
            count = opt.step()
            if isinstance(opt, ShardedStateOptimizer):
                reduced += count
        return reduced

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)
