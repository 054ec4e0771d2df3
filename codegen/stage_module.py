"""The ``nn.Module`` of one pipeline stage and its FSDP2 sharding.

:class:`StageModule` is the ``nn.Module`` a ``PipelineStage`` wraps: it owns
the stage's parameters under their model FQNs (so the schedule, FSDP2 and the
optimizer see them) and, for ``zero_stage`` 2 or 3, is sharded with FSDP2
``fully_shard`` over the stage-mesh axis ``zero_axis`` (:func:`fully_shard_stage`).
A ZeRO-1 stage keeps its parameters as placed (in the compute dtype under a
mixed precision) and holds their :class:`codegen.zero1.StateShards`
(``StageModule.zero1``: the master slices over ``zero_axis``, and the fp32
main gradients under a mixed precision); its optimizer
(:class:`codegen.zero1.ShardedStateOptimizer`, from
:meth:`codegen.pipeline.PipelineRuntime.make_optimizer`) steps those slices.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial
from torch.distributed.tensor.placement_types import Placement

from codegen.pipeline_validation import PipelinePlanError
from codegen.stage_executor import StageExecutor
from codegen.zero1 import StateShards
from codegen.zero3_units import UnitModule
from ir.placements import placement_str
from ir.torch_compat import from_local_with_grad_placements
from plan.format import Plan, StagePlan

__all__ = ["StageModule", "fully_shard_stage"]


def _mixed_precision_policy(plan: Plan) -> Any:
    """FSDP2's policy for the plan's precision: parameters all-gathered in the
    compute dtype, gradients reduce-scattered in the reduction dtype (the
    sharded master parameters stay in theirs)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    p = plan.precision
    if not p.mixed:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=p.compute_dtype, reduce_dtype=p.reduce_dtype)


def fully_shard_stage(module: nn.Module, st: StagePlan, plan: Plan, mesh: DeviceMesh) -> None:
    """Shard ``module`` (one stage) with ``fully_shard`` over ``mesh`` (its 1-D
    ``zero_axis``) for the stage's ZeRO stage: optimizer states, gradients
    and master parameters sharded at both 2 and 3. ZeRO-2 makes the stage one
    FSDP2 unit with ``reshard_after_forward=False``: its parameters are
    all-gathered once and kept until the last micro-batch's backward, which
    reduce-scatters the gradients once per step. ZeRO-3 first makes each of
    the stage's :attr:`StageModule.zero3_units` a unit of its own, resharded
    after its forward and after every micro-batch's backward
    (:meth:`codegen.pipeline._Stage.backward_maybe_with_nosync`); the stage's
    own unit keeps the rest. Same precision policy and gradient reduction for
    both."""
    from torch.distributed.fsdp import fully_shard

    policy = _mixed_precision_policy(plan)
    for unit in module.zero3_units:  # ZeRO-3: each unit gathered for its own ops alone
        fully_shard(unit, mesh=mesh, mp_policy=policy, reshard_after_forward=True)
    reshard = {"reshard_after_forward": False} if st.zero_stage == 2 else {}
    fully_shard(module, mesh=mesh, mp_policy=policy, **reshard)
    # The local gradients are partial sums: reduce-scatter their sum.
    for unit in [*module.zero3_units, module]:
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)


class StageModule(nn.Module):
    """The ``nn.Module`` of one stage: its parameters under their model FQNs, and a
    forward that runs the :class:`StageExecutor`.

    With ``zero_axis`` (ZeRO-2 or ZeRO-3), every parameter must be replicated on that
    stage-mesh axis; the module then holds it without that axis (a plain tensor
    on a 1-D stage mesh, else a DTensor on the other axes) for FSDP2 to shard,
    and each forward views FSDP's unsharded parameter as the planned DTensor on
    the stage mesh whose gradient stays a pending sum on ``zero_axis`` (FSDP's
    reduce-scatter, with divide factor 1, does that sum). Under ZeRO-3 each
    unit of :func:`ir.shard_units.shard_units` is a
    :class:`codegen.zero3_units.UnitModule` at its module path, owning its
    parameters (:attr:`zero3_units`), so that FSDP2 gathers them unit by unit.
    A model built on meta leaves them on meta until FSDP2 has sharded them
    (:meth:`StageExecutor.materialize_shards`).

    With ``zero1`` (a ZeRO-1 stage's :class:`codegen.zero1.StateShards`, made
    from the executor's parameters), the module holds and the executor reads
    the parameters the shards give forward (compute-dtype copies under a
    mixed precision; the fp32 ones are let go).
    """

    def __init__(self, executor: StageExecutor, *, zero_axis: int | None = None,
                 zero1: StateShards | None = None):
        super().__init__()
        self.executor = executor
        self.zero_axis = zero_axis
        #: a ZeRO-1 stage's master slices and main gradients (None otherwise)
        self.zero1 = zero1
        if zero1 is not None:
            executor.replace_parameters(zero1.replaced())
        self._placements: dict[str, tuple[Placement, ...]] = {}
        self._shapes: dict[str, tuple[torch.Size, tuple[int, ...]]] = {}
        units = []  # ZeRO-3: (unit, its module) of each unit FSDP2 shards on its own
        if zero_axis is not None and executor.stage.zero_stage == 3:
            units = [(u, self._add_module_at(u.name, UnitModule()))
                     for u in executor.zero3_units()]
        #: ZeRO-3: the modules FSDP2 shards one by one (codegen.zero3_units)
        self.zero3_units: list[UnitModule] = [module for _, module in units]
        for fqn, param in executor.named_parameters():
            self._placements[fqn] = tuple(param.placements)
            self._shapes[fqn] = (param.shape, param.stride())
            self._register(fqn, self._owned(fqn, param))
        executor.param_value = self._param_value
        if units:
            executor.run_by_unit(units)
        if zero_axis is not None:
            executor.drop_own_parameters()

    def _owner(self, path: Sequence[str]) -> nn.Module:
        """The submodule at ``path`` (module names), plain ``nn.Module`` s made
        where there are none yet."""
        owner: nn.Module = self
        for part in path:
            child = owner._modules.get(part)
            if child is None:
                child = nn.Module()
                owner.add_module(part, child)
            owner = child
        return owner

    def _add_module_at(self, path: str, module: nn.Module) -> nn.Module:
        *parent, leaf = path.split(".")
        self._owner(parent).add_module(leaf, module)
        return module

    def _register(self, fqn: str, param: nn.Parameter) -> None:
        *path, leaf = fqn.split(".")
        self._owner(path).register_parameter(leaf, param)

    def _other_axes_mesh(self) -> DeviceMesh | None:
        mesh = self.executor.mesh
        names = [n for i, n in enumerate(mesh.mesh_dim_names or ()) if i != self.zero_axis]
        if mesh.ndim == 1:
            return None
        if len(names) != mesh.ndim - 1:
            raise PipelinePlanError("FSDP2 ZeRO on a multi-axis stage mesh needs named mesh axes")
        return mesh[names[0]] if len(names) == 1 else mesh[tuple(names)]

    def _owned(self, fqn: str, param: nn.Parameter) -> nn.Parameter:
        if self.zero_axis is None:
            return param
        placements = self._placements[fqn]
        if not placements[self.zero_axis].is_replicate():
            raise PipelinePlanError(
                f"FSDP2 ZeRO over stage-mesh axis {self.zero_axis} needs parameter {fqn} "
                f"replicated on it, the plan places it {[placement_str(p) for p in placements]}")
        local = param.to_local().detach()  # FSDP2 copies out its shard; the executor lets go
        sub = self._other_axes_mesh()
        if sub is None:
            return nn.Parameter(local, requires_grad=param.requires_grad)
        rest = [p for i, p in enumerate(placements) if i != self.zero_axis]
        dt = DTensor.from_local(local, sub, rest, run_check=False, shape=param.shape,
                                stride=param.stride())
        return nn.Parameter(dt, requires_grad=param.requires_grad)

    def _param_value(self, fqn: str) -> Any:
        param = self.get_parameter(fqn)
        if self.zero_axis is None:
            return param
        local = param.to_local() if isinstance(param, DTensor) else param
        placements = self._placements[fqn]
        grads = list(placements)
        grads[self.zero_axis] = Partial()
        shape, stride = self._shapes[fqn]
        return from_local_with_grad_placements(local, self.executor.mesh, placements,
                                               shape=shape, stride=stride, grad_placements=grads)

    def forward(self, *args: torch.Tensor) -> Any:
        return self.executor.run_stage(*args)
