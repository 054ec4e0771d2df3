"""ZeRO-1 for a pipeline stage: optimizer states sharded over one stage-mesh axis.

What Megatron-LM's distributed optimizer does, with DTensor collectives:

* the stage's parameters stay whole (as the plan places them) for forward and
  backward; their gradient sums over the ZeRO axis stay pending (DTensor
  ``Partial``) through all micro-batches;
* at the step, each parameter replicated on the ZeRO axis has its gradient
  reduce-scattered over that axis (``Partial -> Shard(d)``), the optimizer
  updates this rank's slice of the parameter in place (its states exist for
  that slice only), and the updated slices are all-gathered back into the
  whole parameter (``Shard(d) -> Replicate``);
* a parameter the plan already shards on the ZeRO axis (an expert weight
  under expert parallelism) has states for its own shard only; its gradient
  is brought to its placements and it is updated as it is.

The optimizer itself is torch's (any element-wise one: SGD, AdamW); it steps
plain tensors that alias slices of the parameters' local tensors, so no copy
of the master parameters is kept. Memory: whole parameters and gradients in
the master dtype, optimizer states ``1/n`` of the axis: what
:class:`costmodel.strategy_cost.IntraOpCost` prices at ``zero_stage`` 1 in
fp32 and bf16. Under a mixed precision the cost model prices Megatron's
layout (:func:`costmodel.memory.training_state_bytes`: bf16 parameters
whole, the fp32 master copy only as each rank's slice, 6 + 12/n bytes per
parameter with Adam), and this runtime does not hold it yet: it keeps the
fp32 parameters whole and reads a bf16 copy of each per forward (10 + 8/n
bytes, 4 - 4/n more than priced).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from codegen.redistribution import redistribute

__all__ = ["OptimizerGroup", "ShardedStateOptimizer", "StateShards", "slice_bounds"]

#: Builds torch's optimizer over a list of tensors (``codegen.reference.make_optimizer``).
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


@dataclass
class _ShardedParam:
    """A parameter replicated on the ZeRO axis, and this rank's slice of it."""

    param: DTensor
    local: torch.Tensor  # the parameter's local tensor (whole on the ZeRO axis)
    dim: int  # the dimension the slices are cut along
    slice: nn.Parameter  # aliases this rank's slice of ``local``; what the optimizer steps
    placements: tuple[Placement, ...]  # the slice's as a shard of the whole parameter


class StateShards:
    """ZeRO-1's slices of one stage's parameters over stage-mesh axis
    ``zero_axis`` (see the module docstring): what an optimizer steps instead
    of the parameters (:meth:`tensors`), the gradient reduce-scatter into the
    slices (:meth:`reduce_grads`) and the all-gather of the updated slices
    (:meth:`gather_params`)."""

    def __init__(self, params: Iterable[nn.Parameter], mesh: DeviceMesh, zero_axis: int):
        names = mesh.mesh_dim_names
        if mesh.ndim > 1 and not names:
            raise ValueError("ZeRO-1 on a multi-axis stage mesh needs named mesh axes")
        self.mesh = mesh
        self.axis_mesh = mesh[names[zero_axis]] if mesh.ndim > 1 else mesh
        self.zero_axis = zero_axis
        self.parts = self.axis_mesh.size()
        coordinate = self.axis_mesh.get_local_rank()
        self.params = list(params)
        self.sharded: list[_ShardedParam] = []
        self.whole: list[nn.Parameter] = []
        for p in self.params:
            dim = None
            if isinstance(p, DTensor) and p.placements[zero_axis].is_replicate() and p.dim() > 0:
                taken = {q.dim for i, q in enumerate(p.placements)
                         if i != zero_axis and isinstance(q, Shard)}
                dim = _shard_dim(p.to_local().shape, self.parts, taken)
            if dim is None:
                self.whole.append(p)
                continue
            with torch.no_grad():
                local = p.to_local()  # the local tensor itself, not an autograd view
            start, length = slice_bounds(local.shape[dim], self.parts, coordinate)
            piece = nn.Parameter(local.narrow(dim, start, length), requires_grad=False)
            placements = list(p.placements)
            placements[zero_axis] = Shard(dim)
            self.sharded.append(_ShardedParam(p, local, dim, piece, tuple(placements)))

    def tensors(self) -> list[torch.Tensor]:
        """What an optimizer steps: every slice, then the parameters kept whole."""
        return [s.slice for s in self.sharded] + self.whole

    def stepped(self) -> dict[int, tuple[torch.Tensor, tuple[Placement, ...] | None]]:
        """``id(parameter)`` -> (the tensor the optimizer steps for it, that
        tensor's placements as a shard of the parameter on the stage mesh; None
        for a parameter stepped whole)."""
        out = {id(s.param): (s.slice, s.placements) for s in self.sharded}
        out.update({id(p): (p, None) for p in self.whole})
        return out

    def _reduce_scatter(self, entry: _ShardedParam) -> torch.Tensor:
        """This rank's slice of the parameter's gradient, summed over the ZeRO axis."""
        grad = entry.param.grad
        pending = grad.placements[self.zero_axis]
        want = list(entry.param.placements)
        want[self.zero_axis] = pending if pending.is_partial() else Replicate()
        if tuple(grad.placements) != tuple(want):  # other axes as the parameter has them
            grad = redistribute(grad, grad.device_mesh, want)
        on_axis = DTensor.from_local(grad.to_local(), self.axis_mesh, [want[self.zero_axis]],
                                     run_check=False)
        piece = on_axis.redistribute(self.axis_mesh, [Shard(entry.dim)]).to_local()
        if piece.shape != entry.slice.shape:
            raise RuntimeError(f"ZeRO-1: DTensor split a gradient of {tuple(entry.local.shape)} "
                               f"into {tuple(piece.shape)} on this rank, the parameter slice is "
                               f"{tuple(entry.slice.shape)}")
        return piece.to(entry.slice.dtype)

    @torch.no_grad()
    def reduce_grads(self) -> int:
        """Reduce-scatter each sliced parameter's gradient into its slice's
        ``grad`` (the parameter's own is dropped) and bring the gradients of the
        parameters kept whole to their placements; returns how many moved."""
        reduced = 0
        for entry in self.sharded:
            if entry.param.grad is not None:
                entry.slice.grad = self._reduce_scatter(entry)
                entry.param.grad = None
                reduced += 1
        for p in self.whole:
            if isinstance(p.grad, DTensor) and tuple(p.grad.placements) != tuple(p.placements):
                p.grad = redistribute(p.grad, p.device_mesh, p.placements)
                reduced += 1
        return reduced

    @torch.no_grad()
    def gather_params(self) -> None:
        """Write every rank's updated slice back into the whole local parameters."""
        for entry in self.sharded:
            local = entry.local
            sliced = DTensor.from_local(entry.slice.detach(), self.axis_mesh, [Shard(entry.dim)],
                                        run_check=False, shape=local.shape, stride=local.stride())
            local.copy_(sliced.redistribute(self.axis_mesh, [Replicate()]).to_local())

    def zero_grad(self) -> None:
        for entry in self.sharded:
            entry.slice.grad = None
        for p in self.params:
            p.grad = None


class ShardedStateOptimizer:
    """ZeRO-1 over stage-mesh axis ``zero_axis`` of the parameters ``params``
    (DTensors on ``mesh``): see the module docstring. ``make`` builds torch's
    optimizer over :meth:`StateShards.tensors`."""

    def __init__(self, params: Iterable[nn.Parameter], mesh: DeviceMesh, zero_axis: int,
                 make: MakeOptimizer):
        self.shards = StateShards(params, mesh, zero_axis)
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
