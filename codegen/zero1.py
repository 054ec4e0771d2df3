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
of the master parameters is kept. Memory, priced by
:class:`costmodel.strategy_cost.IntraOpCost` at ``zero_stage`` 1: whole
parameters and gradients, optimizer states ``1/n`` of the axis.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from codegen.redistribution import redistribute

__all__ = ["OptimizerGroup", "ShardedStateOptimizer", "slice_bounds"]

#: Builds torch's optimizer over a list of tensors (``codegen.reference.make_optimizer``).
MakeOptimizer = Callable[[list[torch.Tensor]], torch.optim.Optimizer]


def slice_bounds(size: int, parts: int, index: int) -> tuple[int, int]:
    """(offset, length) of part ``index`` of ``size`` elements split in ``parts``
    as DTensor's ``Shard`` splits a dimension (``torch.chunk``: parts of
    ``ceil(size / parts)``, the last ones shorter or empty)."""
    step = -(-size // parts)
    start = min(index * step, size)
    return start, min(size, start + step) - start


def _shard_dim(shape: Sequence[int], parts: int) -> int:
    """The dimension a parameter's slices are cut along: the first at least
    ``parts`` long (every rank gets some), else 0."""
    return next((d for d, n in enumerate(shape) if n >= parts), 0)


@dataclass
class _ShardedParam:
    """A parameter replicated on the ZeRO axis, and this rank's slice of it."""

    param: DTensor
    local: torch.Tensor  # the parameter's local tensor (whole on the ZeRO axis)
    dim: int  # the dimension the slices are cut along
    slice: nn.Parameter  # aliases this rank's slice of ``local``; what the optimizer steps


class ShardedStateOptimizer:
    """ZeRO-1 over stage-mesh axis ``zero_axis`` of the parameters ``params``
    (DTensors on ``mesh``): see the module docstring. ``make`` builds torch's
    optimizer (called at most twice: for the slices, and for the parameters
    the plan shards on the ZeRO axis itself)."""

    def __init__(self, params: Iterable[nn.Parameter], mesh: DeviceMesh, zero_axis: int,
                 make: MakeOptimizer):
        names = mesh.mesh_dim_names
        if mesh.ndim > 1 and not names:
            raise ValueError("ZeRO-1 on a multi-axis stage mesh needs named mesh axes")
        self.axis_mesh = mesh[names[zero_axis]] if mesh.ndim > 1 else mesh
        self.zero_axis = zero_axis
        self.parts = self.axis_mesh.size()
        coordinate = self.axis_mesh.get_local_rank()
        self.params = list(params)
        self.sharded: list[_ShardedParam] = []
        self.whole: list[nn.Parameter] = []
        for p in self.params:
            if not (isinstance(p, DTensor) and p.placements[zero_axis].is_replicate()
                    and p.dim() > 0):
                self.whole.append(p)
                continue
            with torch.no_grad():
                local = p.to_local()  # the local tensor itself, not an autograd view
            dim = _shard_dim(local.shape, self.parts)
            start, length = slice_bounds(local.shape[dim], self.parts, coordinate)
            piece = nn.Parameter(local.narrow(dim, start, length), requires_grad=False)
            self.sharded.append(_ShardedParam(p, local, dim, piece))
        self.optimizers = [make(group) for group in ([s.slice for s in self.sharded], self.whole)
                           if group]

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

    def _all_gather(self, entry: _ShardedParam) -> None:
        """Write every rank's updated slice back into the whole local parameter."""
        local = entry.local
        sliced = DTensor.from_local(entry.slice.detach(), self.axis_mesh, [Shard(entry.dim)],
                                    run_check=False, shape=local.shape, stride=local.stride())
        local.copy_(sliced.redistribute(self.axis_mesh, [Replicate()]).to_local())

    @torch.no_grad()
    def step(self) -> int:
        """Reduce-scatter, update, all-gather; returns how many gradients were reduced."""
        reduced = 0
        for entry in self.sharded:
            entry.slice.grad = None if entry.param.grad is None else self._reduce_scatter(entry)
            reduced += entry.slice.grad is not None
        for p in self.whole:
            if isinstance(p.grad, DTensor) and tuple(p.grad.placements) != tuple(p.placements):
                p.grad = redistribute(p.grad, p.device_mesh, p.placements)
                reduced += 1
        for opt in self.optimizers:
            opt.step()
        for entry in self.sharded:
            if entry.slice.grad is not None:
                self._all_gather(entry)
        return reduced

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)
        for p in self.params:
            p.grad = None


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
