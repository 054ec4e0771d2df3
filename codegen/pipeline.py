"""Run a pipeline Plan: a DTensor stage runtime per stage under torch's pipeline schedule.

A pipeline plan (``plan.pipeline``) cuts the program captured at *micro-batch*
shapes into stages. Every rank of the world mesh ``[pp] + stage_mesh`` runs the
stages whose ``pp_rank`` is its row of the ``pp`` axis:

* :class:`StageExecutor` is :class:`codegen.executor.PlanExecutor` restricted to
  the stage's ``nodes``: it receives the stage's boundary values as *local*
  tensors (the local shards of the planned placements; the first stage receives
  the user inputs whole and slices them), wraps them with
  ``DTensor.from_local``, runs its nodes on DTensors over the stage's sub-mesh
  exactly as the single-stage executor does (planned reshards, observed
  placements, checkpointed layers) and returns its outputs redistributed to the
  placements ``stage.outputs`` names, as local tensors. The sender reshards; the
  ranks of consecutive stages correspond by position, so local shards line up.
* :class:`StageModule` is the ``nn.Module`` a ``PipelineStage`` wraps: it owns
  the stage's parameters under their model FQNs (so the schedule, FSDP2 and the
  optimizer see them) and, for ``zero_stage`` 2 or 3, is sharded with FSDP2
  ``fully_shard`` over the stage-mesh axis ``zero_axis`` (:func:`_fully_shard_stage`).
  A ZeRO-1 stage keeps its parameters as placed (in the compute dtype under a
  mixed precision) and holds their :class:`codegen.zero1.StateShards`
  (``StageModule.zero1``: the master slices over ``zero_axis``, and the fp32
  main gradients under a mixed precision); its optimizer
  (:class:`codegen.zero1.ShardedStateOptimizer`, from
  :meth:`PipelineRuntime.make_optimizer`) steps those slices.
* :class:`PipelineRuntime` builds the stages (``torch.distributed.pipelining.
  PipelineStage``, static shapes) and the plan's schedule class
  (``costmodel.schedules.specs.SCHEDULE_SPECS``), and runs one step on the
  global batch: torch splits it into ``num_microbatches`` micro-batches along
  dim 0, the last stage's output is the micro-batch loss, and the schedule
  averages gradients over micro-batches (``scale_grads``), which gives the
  full-batch mean loss's gradients when the model's loss is a per-micro-batch
  mean.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import Placement

from codegen.capture import CapturedProgram, PlanMismatchError, capture_program
from codegen.context_parallel import cut_sequences, layout_of
from codegen.executor import PlanExecutor
from codegen.program_inputs import Materialize
from codegen.pipeline_validation import PipelinePlanError, validate_pipeline_plan
from codegen.redistribution import contiguous_strides, redistribute
from codegen.zero1 import MakeOptimizer, OptimizerGroup, ShardedStateOptimizer, StateShards
from codegen.zero3_units import UnitModule, UnitRun
from costmodel.schedules.specs import schedule_spec
from costmodel.strategy_cost import FSDP_STAGES
from ir.placements import parse_placements, placement_str
from ir.precision import cast_float
from ir.repeated_blocks import ShardUnit, find_layers, shard_units
from ir.torch_compat import from_local_with_grad_placements, is_strided_shard
from plan.format import Plan, StagePlan

__all__ = ["PipelineRuntime", "StageExecutor", "StageModule", "local_shape", "split_microbatch",
           "split_microbatches"]


def split_microbatches(inputs: Sequence[Any], num_microbatches: int) -> list[tuple[Any, ...]]:
    """The micro-batches of the global ``inputs``: dim 0 of every tensor split as
    the schedule splits it (``tensor_split``), other values repeated."""
    parts = []
    for t in inputs:
        if isinstance(t, torch.Tensor):
            if t.ndim == 0 or t.shape[0] % num_microbatches:
                raise PipelinePlanError(
                    f"an input of shape {list(t.shape)} cannot be split into {num_microbatches} "
                    f"equal micro-batches along dim 0; choose a batch divisible by it")
            parts.append(torch.tensor_split(t, num_microbatches, dim=0))
        else:
            parts.append([t] * num_microbatches)
    return [tuple(p[i] for p in parts) for i in range(num_microbatches)]


def split_microbatch(inputs: Sequence[Any], num_microbatches: int) -> tuple[Any, ...]:
    """The first micro-batch of the global ``inputs`` (:func:`split_microbatches`)."""
    return split_microbatches(inputs, num_microbatches)[0]


# ------------------------------------------------------------------ local shapes
def local_shape(global_shape: Sequence[int], mesh: DeviceMesh,
                placements: Sequence[Placement]) -> tuple[int, ...]:
    """Shape of this rank's shard of a ``global_shape`` tensor placed as ``placements``.

    Follows DTensor's even-first chunking (``torch.chunk``); shards of the same
    dim on several mesh axes are taken in mesh-axis order.
    """
    shape = list(global_shape)
    coord = mesh.get_coordinate()
    if coord is None:
        raise PipelinePlanError("this rank is not in the stage mesh")
    for axis, p in enumerate(placements):
        if is_strided_shard(p):
            raise PipelinePlanError(f"boundary placement {placement_str(p)} (strided shard) is "
                                    f"not supported between stages; send it as S(d) or R")
        if isinstance(p, Shard):
            dim = p.dim % len(shape)
            k = mesh.size(axis)
            chunk = -(-shape[dim] // k)
            shape[dim] = max(0, min(chunk, shape[dim] - coord[axis] * chunk))
    return tuple(shape)


# ------------------------------------------------------------------ stage runtime
class StageExecutor(PlanExecutor):
    """:class:`PlanExecutor` for one pipeline stage: its nodes, its boundary values.

    Args:
        plan: the pipeline Plan.
        stage: the stage to run (``plan.pipeline.stages[i]``).
        model, example_inputs: the model and the *micro-batch* user inputs the
            plan was made for (only used to capture when ``program`` is None).
        mesh: the stage's sub-mesh (shape ``plan.pipeline.stage_mesh``).
        program: the shared capture (:func:`codegen.capture.capture_program`).
        materialize: the whole value of a state tensor held on meta
            (:class:`codegen.program_inputs.InputPlacer`).

    Attributes:
        param_value: called with a parameter FQN at every forward to get the
            tensor the stage computes with (set by :class:`StageModule`, which
            owns the parameters); None uses the executor's own DTensor parameters.
    """

    def __init__(self, plan: Plan, stage: StagePlan, model: nn.Module, example_inputs: Any,
                 mesh: DeviceMesh, *, program: CapturedProgram | None = None,
                 record_every_step: bool = False, materialize: Materialize | None = None):
        self.stage = stage
        self.param_value: Callable[[str], Any] | None = None
        super().__init__(plan, model, example_inputs, mesh, program=program,
                         record_every_step=record_every_step, materialize=materialize)
        self.stage = self.plan.pipeline.stages[stage.index]  # as the stage mesh reads it
        sig = self.ep.graph_signature
        self._param_fqn = {n: f for n, f in sig.inputs_to_parameters.items() if n in self._placeholders}
        self._vals = {n.name: n.meta.get("val") for n in self.ep.graph.nodes}
        self.is_first = stage.index == 0
        self.is_last = stage.index == len(plan.pipeline.stages) - 1
        # A later stage reads the user inputs it needs (the targets of the loss)
        # from its own copy of the micro-batch, not from the stage before: values
        # that get no gradient are not sent (torch 2.11's stages mark every
        # received buffer as requiring one, which integers cannot).
        users = set(self.user_input_names)
        self.received = [n for n in self.stage.inputs if self.is_first or n not in users]
        self.sent = [n for n in self.stage.outputs if self.is_last or n not in users]
        if not self.is_first:
            for n in self.received:
                val = self._vals.get(n)
                if isinstance(val, torch.Tensor) and not val.is_floating_point():
                    raise PipelinePlanError(
                        f"stage {stage.index} would receive {n} ({val.dtype}) from the stage "
                        f"before; only floating values, which carry a gradient, cross stages")
        # set by the runtime for each step and micro-batch (:class:`_Stage`)
        self.microbatches: list[tuple[Any, ...]] = []
        self.microbatch_index = 0
        self._check_boundary()
        if any(s.kind.name == "BUFFER_MUTATION" for s in sig.output_specs):
            raise PipelinePlanError("the model updates buffers in forward (e.g. BatchNorm "
                                    "statistics); pipeline stages do not support that yet")

    def drop_own_parameters(self) -> None:
        """Let go of this executor's parameter DTensors: their owner (an FSDP2
        :class:`StageModule`) gives every forward its values through
        :attr:`param_value`, and holds only their shards between steps. The
        program's state dict lets go of them too."""
        for fqn in self._params:
            self._hold_in_state(fqn, None)
        for name in self._param_fqn:
            self._placeholders[name] = None
        self._params.clear()

    def replace_parameters(self, replaced: dict[int, nn.Parameter]) -> None:
        """Compute with other parameters: ``replaced`` maps ``id(parameter)``
        of this executor's to the one to read instead (a ZeRO-1 stage's
        compute-dtype parameters under a mixed precision). The program's state
        dict lets go of the old ones too, so nothing holds them."""
        for name, value in self._placeholders.items():
            if id(value) in replaced:
                self._placeholders[name] = replaced[id(value)]
        for fqn, param in list(self._params.items()):
            new = replaced.get(id(param))
            if new is not None:
                self._params[fqn] = new
                self._hold_in_state(fqn, new)

    def zero3_units(self) -> list[ShardUnit]:
        """The units of this stage that ZeRO-3 gathers one at a time
        (:func:`ir.repeated_blocks.shard_units`), in program order."""
        return shard_units(self.graph, within=self.stage.nodes)

    def run_by_unit(self, units: Sequence[tuple[ShardUnit, UnitModule]]) -> None:
        """Run the ops of each unit through its :class:`UnitModule` (which owns
        the unit's parameters), reading the unit's parameters inside it
        (:func:`codegen.zero3_units.run_unit`)."""
        placeholder = {f: n for n, f in self._param_fqn.items()}
        checkpointed = set(self._checkpoint_layers())
        position = {n.name: i for i, n in enumerate(self._calls)}
        for unit, module in units:
            idx = sorted(position[o] for o in unit.ops)
            if idx[-1] - idx[0] + 1 != len(idx):
                raise PlanMismatchError(f"ZeRO-3 unit '{unit.name}' of stage {self.stage.index} "
                                        f"is not contiguous in the program; re-plan this model")
            segment = self._calls[idx[0]: idx[-1] + 1]
            params = frozenset(placeholder[self.graph[p].fqn] for p in unit.params)
            self._units[segment[0].name] = UnitRun(module, segment, params,
                                                   unit.name in checkpointed)
            self._unit_params |= params

    def materialize_shards(self, module: nn.Module) -> None:
        """Give ``module``'s parameters that are still on meta (the FSDP2-sharded
        ones of a model built on meta: :meth:`_parameters_on_meta`) this rank's
        values, one parameter at a time: its whole value from the build, of
        which the rank keeps its shard. A rank so never holds more than its
        shards and one whole parameter."""
        originals = self._inputs.meta_originals
        meta = [(fqn, p) for fqn, p in module.named_parameters() if p.is_meta]
        if not meta:
            return
        if self._inputs.materialize is None:
            raise PlanMismatchError(f"{meta[0][0]} is on the meta device and has no values; "
                                    f"build the model on a real device, or parallelize it "
                                    f"with an initializer")
        module.to_empty(device=torch.device(self.mesh.device_type))
        with torch.no_grad():
            for fqn, param in module.named_parameters():
                if fqn not in originals:
                    continue
                whole = cast_float(self._inputs.materialize(fqn, originals.pop(fqn)),
                                   self.precision.master_dtype)
                shard = distribute_tensor(whole, param.device_mesh, param.placements,
                                          src_data_rank=None)
                param.to_local().copy_(shard.to_local())
                del whole, shard

    # ---- which part of the program
    def _parameters_on_meta(self) -> bool:
        """FSDP2 stages shard their parameters on meta (:meth:`materialize_shards`)."""
        return self.stage.zero_stage in FSDP_STAGES

    def _runs_locally(self) -> bool:
        """Never: a stage's parameters are DTensors on its sub-mesh even when it
        has one device (:class:`StageModule` reads their placements, FSDP2
        shards them, the boundary values arrive as DTensors)."""
        return False

    def _check_mesh(self, mesh: DeviceMesh) -> None:
        want = [int(d) for d in self.plan.pipeline.stage_mesh["shape"]]
        if list(mesh.shape) != want:
            raise PlanMismatchError(f"stage {self.stage.index} is planned on a mesh of shape "
                                    f"{want} but its sub-mesh has shape {list(mesh.shape)}")

    def _program_calls(self) -> list[torch.fx.Node]:
        calls = [n for n in self.ep.graph.nodes if n.op == "call_function"]
        names = {n.name for n in calls}
        unknown = [n for n in self.stage.nodes if n not in names]
        if unknown:
            raise PlanMismatchError(f"stage {self.stage.index} runs node {unknown[0]} that the "
                                    f"captured program does not have; re-plan this model")
        wanted = set(self.stage.nodes)
        return [n for n in calls if n.name in wanted]

    def _kept_values(self) -> set[str]:
        return set(self.stage.outputs)

    def _wants_placeholder(self, name: str) -> bool:
        if not hasattr(self, "_reads"):
            self._reads = {a.name for n in self._calls for a in n.all_input_nodes}
        return name in self._reads

    def _checkpoint_layers(self) -> list[str]:
        if not self.stage.checkpoint:
            return []
        ops = {n.name for n in self.ep.graph.nodes if n.op == "call_function"}
        layers = {layer.name: set(layer.nodes) & ops for layer in find_layers(self.graph)}
        mine = set(self.stage.nodes)
        for name in self.stage.checkpoint:
            if name in layers and not layers[name] <= mine:
                raise PlanMismatchError(f"stage {self.stage.index} checkpoints layer '{name}' "
                                        f"but not all of its ops are in the stage; re-plan")
        return list(self.stage.checkpoint)

    def _planned_node_names(self) -> list[str]:
        return list(self.stage.nodes)

    def _check_boundary(self) -> None:
        """Every value the stage reads is its input, its own, or a parameter/buffer/constant."""
        have = set(self.stage.inputs) | set(self._placeholders)
        if self.is_first:
            have |= set(self.user_input_names)
            extra = [n for n in self.stage.inputs if n not in self.user_input_names]
            if extra:
                raise PipelinePlanError(f"the first stage's input {extra[0]} is not a user input "
                                        f"({', '.join(self.user_input_names)})")
        for node in self._calls:
            for arg in node.all_input_nodes:
                if arg.name not in have:
                    raise PipelinePlanError(
                        f"stage {self.stage.index} node {node.name} reads {arg.name}, which is "
                        f"neither a stage input nor computed earlier in the stage")
            have.add(node.name)
        missing = [n for n in self.stage.outputs if n not in have]
        if missing:
            raise PipelinePlanError(f"stage {self.stage.index} outputs {missing[0]}, which it "
                                    f"neither receives nor computes")

    # ---- boundary shapes (PipelineStage's static metadata)
    def _global_shape(self, name: str) -> tuple[int, ...]:
        val = self._vals.get(name)
        if not isinstance(val, torch.Tensor):
            raise PipelinePlanError(f"stage boundary value {name} is not a tensor")
        return tuple(int(d) for d in val.shape)

    def _example(self, name: str, placements: Sequence[Placement]) -> torch.Tensor:
        """An empty local shard of boundary value ``name`` (floats require grad)."""
        shape = local_shape(self._global_shape(name), self.mesh, placements)
        t = torch.empty(shape, dtype=self._vals[name].dtype, device=self.mesh.device_type)
        return t.requires_grad_(t.is_floating_point())

    def example_inputs(self, microbatch: Sequence[Any]) -> tuple[torch.Tensor, ...]:
        """What the stage receives for one micro-batch: the user inputs (first stage),
        else empty local shards of its boundary inputs."""
        if self.is_first:
            return tuple(microbatch)
        return tuple(self._example(n, parse_placements(self.stage.inputs[n]))
                     for n in self.received)

    def example_outputs(self) -> tuple[torch.Tensor, ...]:
        """Empty local shards of what the stage sends (the loss, for the last stage)."""
        return tuple(self._example(n, self._send_placements(n)) for n in self.sent)

    # ---- running
    def _placeholder_value(self, name: str) -> Any:
        fqn = self._param_fqn.get(name)
        if fqn is not None and self.param_value is not None:
            # FSDP2's mixed-precision policy gathers it in the compute dtype already
            return cast_float(self.param_value(fqn), self.precision.compute_dtype)
        return super()._placeholder_value(name)

    def _receive(self, name: str, local: torch.Tensor) -> DTensor:
        """A received local shard as the DTensor of the planned placement."""
        placements = parse_placements(self.stage.inputs[name])
        shape = self._global_shape(name)
        if tuple(local.shape) != local_shape(shape, self.mesh, placements):
            raise PipelinePlanError(f"stage {self.stage.index} received {name} with local shape "
                                    f"{list(local.shape)}; placements {self.stage.inputs[name]} of "
                                    f"{list(shape)} give {list(local_shape(shape, self.mesh, placements))}")
        return DTensor.from_local(local, self.mesh, placements, run_check=False, shape=shape,
                                  stride=contiguous_strides(shape))

    def _send_placements(self, name: str) -> list[Placement]:
        """Where output ``name`` goes: its planned placements; the loss (the last
        stage's output) replicated, since every rank of the stage backpropagates it."""
        if self.is_last:
            return [Replicate()] * self.mesh.ndim
        return parse_placements(self.stage.outputs[name])

    def _send(self, name: str, value: Any) -> torch.Tensor:
        """A stage output, redistributed to its send placement, as the local shard."""
        placements = self._send_placements(name)
        if not isinstance(value, DTensor):
            value = self._wrap_replicated(value)
        if tuple(value.placements) != tuple(placements):
            value = redistribute(value, self.mesh, placements)
        return _NotAView.apply(value.to_local())

    def _input_placements(self, name: str) -> list[str]:
        """Placements of a user input in the first stage: the stage's, else the plan's."""
        if name in self.stage.inputs:
            return list(self.stage.inputs[name])
        return list(self.plan.inputs.get(name) or ["R"] * self.mesh.ndim)

    def run_stage(self, *args: torch.Tensor) -> Any:
        """Run the stage on one micro-batch; returns the local outputs (one tensor or a tuple)."""
        self._begin_forward()
        if self.is_first:
            if len(args) != len(self.user_input_names):
                raise ValueError(f"the first stage takes the {len(self.user_input_names)} user "
                                 f"inputs ({', '.join(self.user_input_names)}), got {len(args)}")
            env = {n: distribute_tensor(v, self.mesh, parse_placements(self._input_placements(n)),
                                        src_data_rank=None)
                   for n, v in zip(self.user_input_names, args)}
        else:
            if len(args) != len(self.received):
                raise ValueError(f"stage {self.stage.index} receives {len(self.received)} "
                                 f"values, got {len(args)}")
            env = {n: self._receive(n, v) for n, v in zip(self.received, args)}
            env.update(self._local_user_inputs())
        self._execute(env)
        outs = tuple(self._send(n, env[n]) for n in self.sent)
        return outs[0] if len(outs) == 1 else outs

    def _local_user_inputs(self) -> dict[str, DTensor]:
        """The user inputs a later stage reads, from this rank's copy of the
        current micro-batch, at the stage's planned placements."""
        wanted = [n for n in self.stage.inputs if n not in self.received]
        if not wanted:
            return {}
        if not 0 <= self.microbatch_index < len(self.microbatches):
            raise PipelinePlanError(f"stage {self.stage.index} runs micro-batch "
                                    f"{self.microbatch_index} of {len(self.microbatches)}")
        values = dict(zip(self.user_input_names, self.microbatches[self.microbatch_index]))
        return {n: distribute_tensor(values[n], self.mesh,
                                     parse_placements(self._input_placements(n)),
                                     src_data_rank=None)
                for n in wanted}


def _mixed_precision_policy(plan: Plan) -> Any:
    """FSDP2's policy for the plan's precision: parameters all-gathered in the
    compute dtype, gradients reduce-scattered in the reduction dtype (the
    sharded master parameters stay in theirs)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    p = plan.precision
    if not p.mixed:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=p.compute_dtype, reduce_dtype=p.reduce_dtype)


def _fully_shard_stage(module: nn.Module, st: StagePlan, plan: Plan, mesh: DeviceMesh) -> None:
    """Shard ``module`` (one stage) with ``fully_shard`` over ``mesh`` (its 1-D
    ``zero_axis``) for the stage's ZeRO stage: optimizer states, gradients
    and master parameters sharded at both 2 and 3. ZeRO-2 makes the stage one
    FSDP2 unit with ``reshard_after_forward=False``: its parameters are
    all-gathered once and kept until the last micro-batch's backward, which
    reduce-scatters the gradients once per step. ZeRO-3 first makes each of
    the stage's :attr:`StageModule.zero3_units` a unit of its own, resharded
    after its forward and after every micro-batch's backward
    (:meth:`_Stage.backward_maybe_with_nosync`); the stage's own unit keeps
    the rest. Same precision policy and gradient reduction for both."""
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
    unit of :func:`ir.repeated_blocks.shard_units` is a
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


class _NotAView(torch.autograd.Function):
    """Identity whose output is not an autograd view of its input (no copy).

    ``DTensor.to_local()`` returns a view; the zero-bubble schedules
    ``detach_()`` stage outputs after the input-gradient pass, which autograd
    refuses for views.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


#: the FSDP2 settings torch's stage turns off for a backward that is not the last
_NO_SYNC_SETTERS = ("set_is_last_backward", "set_reshard_after_backward",
                    "set_requires_gradient_sync")


def _ignore(*args: Any, **kwargs: Any) -> None:
    """A setting left as it is."""


class _Stage(PipelineStage):
    """torch's stage, telling the stage's executor which micro-batch each forward
    runs (it reads the user inputs of that micro-batch locally)."""

    def __init__(self, module: "StageModule", *args: Any, **kwargs: Any) -> None:
        super().__init__(module, *args, **kwargs)
        self._executor = module.executor

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        self._executor.microbatch_index = int(fwd_chunk_id)
        return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

    # torch's stage keeps an FSDP2 stage's parameters gathered and its gradients
    # unreduced from one micro-batch's backward to the next, until the last one.
    # A ZeRO-3 stage sharded unit by unit does what FSDP2 does outside a
    # pipeline instead: every backward reshards each unit and reduce-scatters
    # its gradients (accumulated in the shards), so that no rank ever holds the
    # whole stage gathered.
    def backward_maybe_with_nosync(self, *args: Any, **kwargs: Any) -> Any:
        module = self.submod
        if not module.zero3_units:
            return super().backward_maybe_with_nosync(*args, **kwargs)
        module.set_is_last_backward(True)
        module.set_reshard_after_backward(True)
        module.set_requires_gradient_sync(True)
        for name in _NO_SYNC_SETTERS:  # the instance's own no-ops for this backward
            setattr(module, name, _ignore)
        try:
            return super().backward_maybe_with_nosync(*args, **kwargs)
        finally:
            for name in _NO_SYNC_SETTERS:
                delattr(module, name)

    # A ZeRO-1 stage under a mixed precision accumulates its micro-batches'
    # gradients in fp32 main gradients: the split weight backward sets the
    # bf16 ``grad`` without autograd's accumulation hook, so it is moved after
    # each backward chunk, and the schedule's division by the micro-batch
    # count applies to the main gradients too.
    def backward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        out = super().backward_one_chunk(*args, **kwargs)
        if self.submod.zero1 is not None:
            self.submod.zero1.collect_grads()
        return out

    def backward_weight_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        out = super().backward_weight_one_chunk(*args, **kwargs)
        if self.submod.zero1 is not None:
            self.submod.zero1.collect_grads()
        return out

    def scale_grads(self, grad_scale_factor: int) -> None:
        zero1 = self.submod.zero1
        if zero1 is not None and zero1.mixed:
            zero1.scale_grads(grad_scale_factor)
        super().scale_grads(grad_scale_factor)


def _stage_loss(output: torch.Tensor, target: Any) -> torch.Tensor:
    """The pipeline's loss function: the last stage already outputs the micro-batch loss."""
    return output


# ------------------------------------------------------------------ the runtime
@dataclass
class PipelineRuntime:
    """This rank's stages of a pipeline plan and the schedule that runs them.

    Build with :meth:`build`; :meth:`step` runs one training step's forward and
    backward over the global batch; :meth:`sync_grads` then brings every
    gradient to its parameter's placement (the data-parallel reduction of
    stages not under FSDP2).
    """

    plan: Plan
    world_mesh: DeviceMesh
    stage_mesh: DeviceMesh
    pp_rank: int
    stage_plans: list[StagePlan]
    modules: list[StageModule]
    stages: list[Any]
    schedule: Any
    num_microbatches: int

    @classmethod
    def build(cls, plan: Plan, model: nn.Module, global_inputs: Sequence[Any],
              device: torch.device, *, materialize: Materialize | None = None
              ) -> "PipelineRuntime":
        """Make this rank's stages from ``model`` (the global-batch build) and its inputs.

        Needs an initialised default process group of ``plan.world_size`` ranks.
        ``model`` may be on meta with ``materialize`` giving its tensors' values
        (:class:`codegen.program_inputs.InputPlacer`): each rank then holds only
        its stages' parameters, and of those its shards.
        """
        from torch.distributed.device_mesh import init_device_mesh

        validate_pipeline_plan(plan)
        pipe = plan.pipeline
        spec = schedule_spec(pipe.schedule)
        names = tuple(pipe.stage_mesh["axis_names"])
        world = init_device_mesh(device.type, plan.mesh_shape, mesh_dim_names=("pp",) + names)
        stage_mesh = world[names[0]] if len(names) == 1 else world[names]
        pp_rank = int(world.get_coordinate()[0])
        m = pipe.num_microbatches
        microbatch = split_microbatch(global_inputs, m)
        layout = layout_of(plan)
        if layout is not None:  # each stage runs one cp rank's program
            microbatch = cut_sequences(microbatch, layout)
        mb_size = plan.training.get("microbatch_size")
        if mb_size is not None and microbatch and int(microbatch[0].shape[0]) != int(mb_size):
            raise PipelinePlanError(f"the plan's micro-batch is {mb_size} but the model's batch "
                                    f"{int(global_inputs[0].shape[0])} / {m} micro-batches gives "
                                    f"{int(microbatch[0].shape[0])}")
        program = capture_program(model, microbatch, plan.precision, device)
        mine = [st for st in pipe.stages if st.pp_rank == pp_rank]
        modules, stages = [], []
        for st in mine:
            executor = StageExecutor(plan, st, model, microbatch, stage_mesh, program=program,
                                     materialize=materialize)
            fsdp = st.zero_stage in FSDP_STAGES
            zero1 = None
            if st.zero_stage == 1:
                zero1 = StateShards(executor.parameters(), stage_mesh, st.zero_axis,
                                    compute_dtype=plan.precision.compute_dtype,
                                    grad_dtype=plan.precision.reduce_dtype)
            module = StageModule(executor, zero_axis=st.zero_axis if fsdp else None,
                                 zero1=zero1)
            if fsdp:
                _fully_shard_stage(module, st, plan, stage_mesh[names[st.zero_axis]]
                                   if len(names) > 1 else stage_mesh)
                executor.materialize_shards(module)
            stages.append(_Stage(
                module, st.index, len(pipe.stages), device,
                input_args=executor.example_inputs(microbatch),
                output_args=executor.example_outputs(), group=world.get_group("pp")))
            modules.append(module)
        arg = stages[0] if spec.single_stage else stages
        sched = spec.torch_type(arg, n_microbatches=m, loss_fn=_stage_loss, scale_grads=True)
        runtime = cls(plan=plan, world_mesh=world, stage_mesh=stage_mesh, pp_rank=pp_rank,
                      stage_plans=mine, modules=modules, stages=stages, schedule=sched,
                      num_microbatches=m)
        runtime._check_torch_placement()
        return runtime

    def _check_torch_placement(self) -> None:
        """The schedule's stage -> rank map must be the plan's."""
        for stage in self.stages:
            got = getattr(stage, "stage_index_to_group_rank", None) or {}
            for st in self.plan.pipeline.stages:
                if st.index in got and got[st.index] != st.pp_rank:
                    raise PipelinePlanError(
                        f"torch's {type(self.schedule).__name__} runs stage {st.index} on "
                        f"pipeline rank {got[st.index]}, the plan on {st.pp_rank}")

    @property
    def has_first(self) -> bool:
        return any(st.index == 0 for st in self.stage_plans)

    @property
    def has_last(self) -> bool:
        return any(st.index == len(self.plan.pipeline.stages) - 1 for st in self.stage_plans)

    @property
    def executors(self) -> list[StageExecutor]:
        return [m.executor for m in self.modules]

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """(FQN, parameter) of every stage this rank runs (FSDP-sharded under ZeRO-2/3)."""
        return [item for m in self.modules for item in m.named_parameters()]

    def step(self, global_inputs: Sequence[Any]) -> list[torch.Tensor] | None:
        """One forward and backward of the global batch; the micro-batch losses on the
        ranks of the last stage (local scalars), None elsewhere."""
        losses: list[torch.Tensor] | None = [] if self.has_last else None
        microbatches = split_microbatches(global_inputs, self.num_microbatches)
        layout = self.executors[0].context_parallel_layout
        if layout is not None:
            # each micro-batch's sequences cut over the cp groups, then put back
            # in one batch that the schedule splits into exactly those
            microbatches = [cut_sequences(mb, layout) for mb in microbatches]
            global_inputs = tuple(torch.cat(parts) if isinstance(parts[0], torch.Tensor)
                                  and parts[0].dim() > 0 else parts[0]
                                  for parts in zip(*microbatches))
        for executor in self.executors:
            executor.microbatches = microbatches
        args = tuple(global_inputs) if self.has_first else ()
        target = torch.zeros(self.num_microbatches) if self.has_last else None
        self.schedule.step(*args, target=target, losses=losses, return_outputs=False)
        return losses

    def make_optimizer(self, make: MakeOptimizer) -> OptimizerGroup:
        """The optimizer of this rank's stages: torch's (``make`` builds it over a
        list of tensors) over the parameters of stages without ZeRO or with
        FSDP2's (ZeRO-2/3), and a :class:`codegen.zero1.ShardedStateOptimizer`
        around it for each ZeRO-1 stage, which reduces that stage's gradients
        itself in its ``step``."""
        plain = [p for module in self.modules if module.zero1 is None
                 for p in module.parameters()]
        zero1 = [ShardedStateOptimizer(module.zero1, make)
                 for module in self.modules if module.zero1 is not None]
        return OptimizerGroup(([make(plain)] if plain else []) + zero1)

    def sync_grads(self) -> int:
        """Redistribute gradients to their parameter's placement in stages
        without ZeRO (FSDP2 reduces ZeRO-2/3 stages' gradients in the backward,
        the ZeRO-1 optimizer its stage's in its step); returns how many moved."""
        moved = 0
        for module, st in zip(self.modules, self.stage_plans):
            if st.zero_stage:
                continue
            for p in module.parameters():
                if isinstance(p.grad, DTensor) and tuple(p.grad.placements) != tuple(p.placements):
                    p.grad = redistribute(p.grad, p.device_mesh, p.placements)
                    moved += 1
        return moved

    def full_grads(self) -> dict[str, torch.Tensor | None]:
        """Every parameter gradient of this rank's stages as a full tensor (a collective
        over each stage's mesh: every rank of it must call this)."""
        out: dict[str, torch.Tensor | None] = {}
        for module in self.modules:
            for fqn, p in module.named_parameters():
                g = p.grad if module.zero1 is None else module.zero1.pending_grad(p)
                out[fqn] = g.full_tensor() if isinstance(g, DTensor) else g
        return out

    def zero1_shards(self) -> list[StateShards]:
        """The :class:`codegen.zero1.StateShards` of this rank's ZeRO-1 stages."""
        return [m.zero1 for m in self.modules if m.zero1 is not None]

    @property
    def is_stage_leader(self) -> bool:
        """Whether this rank is the first of its stage mesh (reports for the stage)."""
        return all(c == 0 for c in self.stage_mesh.get_coordinate())
