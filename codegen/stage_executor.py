"""One pipeline stage's part of the program: :class:`StageExecutor`.

:class:`StageExecutor` is :class:`codegen.executor.PlanExecutor` restricted to
the stage's ``nodes``: it receives the stage's boundary values as *local*
tensors (the local shards of the planned placements; the first stage receives
the user inputs whole and slices them), wraps them with ``DTensor.from_local``,
runs its nodes on DTensors over the stage's sub-mesh exactly as the
single-stage executor does (planned reshards, observed placements,
checkpointed layers) and returns its outputs redistributed to the placements
``stage.outputs`` names, as local tensors. The sender reshards; the ranks of
consecutive stages correspond by position, so local shards line up
(:func:`local_shape`: a rank's shard shape, in elements).

The stage's parameters are owned by :class:`codegen.stage_module.StageModule`;
:class:`codegen.pipeline.PipelineRuntime` builds both and runs the schedule.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import Placement

from codegen.capture import CapturedProgram, PlanMismatchError
from codegen.checkpointed_layers import segment_boundary
from codegen.executor import PlanExecutor
from codegen.program_inputs import Materialize
from codegen.pipeline_validation import PipelinePlanError
from codegen.redistribution import contiguous_strides, redistribute
from codegen.zero3_units import UnitModule, UnitRun
from costmodel.strategy_cost import FSDP_STAGES
from ir.node import draws_random
from ir.placements import parse_placements, placement_str
from ir.precision import cast_float
from ir.repeated_blocks import find_layers
from ir.shard_units import ShardUnit, shard_units
from ir.torch_compat import is_strided_shard
from plan.format import Plan, StagePlan

__all__ = ["StageExecutor", "local_shape", "recomputable_cones"]


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
            tensor the stage computes with (set by
            :class:`codegen.stage_module.StageModule`, which owns the
            parameters); None uses the executor's own DTensor parameters.
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
        # The program's constants (attributes torch.export lifts, e.g. rotary
        # tables) are the program's inputs too, but each stage holds its own.
        # Values that carry no gradient and come from the user inputs alone (an
        # attention mask) are computed again by each stage that reads them.
        users = set(self.user_input_names)
        self.constants = {spec.arg.name for spec in sig.input_specs
                          if spec.kind.name == "CONSTANT_TENSOR"}
        not_sent = set() if self.is_last else set(recomputable_cones(self.ep, self.stage.outputs))
        self.received = [n for n in self.stage.inputs if n not in self.constants
                         and (self.is_first or (n not in users and n not in self._recomputed))]
        self.sent = [n for n in self.stage.outputs if n not in self.constants
                     and (self.is_last or n not in users) and n not in not_sent]
        self._local_inputs = [n for n in self.user_input_names if n in self._reads_of_calls()
                              or (n in self.stage.inputs and n not in self.received)]
        if not self.is_first:
            for n in self.received:
                val = self._vals.get(n)
                if isinstance(val, torch.Tensor) and not val.is_floating_point():
                    raise PipelinePlanError(
                        f"stage {stage.index} would receive {n} ({val.dtype}) from the stage "
                        f"before; only floating values, which carry a gradient, cross stages, "
                        f"and it is not made from the user inputs alone; plan this model "
                        f"without a pipeline (--pp 1)")
        # set by the runtime for each step and micro-batch (:class:`codegen.pipeline._Stage`)
        self.microbatches: list[tuple[Any, ...]] = []
        self.microbatch_index = 0
        self._check_boundary()
        if any(s.kind.name == "BUFFER_MUTATION" for s in sig.output_specs):
            raise PipelinePlanError("the model updates buffers in forward (e.g. BatchNorm "
                                    "statistics); pipeline stages do not support that yet")

    def drop_own_parameters(self) -> None:
        """Let go of this executor's parameter DTensors: their owner (an FSDP2
        :class:`codegen.stage_module.StageModule`) gives every forward its values through
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
        (:func:`ir.shard_units.shard_units`), in program order."""
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
                                                   unit.name in checkpointed, unit.name)
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

    def _region_name(self) -> str:
        return f"stage {self.stage.index}"

    def _program_inputs(self) -> list[torch.fx.Node]:
        """The values the stage's ops read from outside them, in first-use
        order, and any it sends without computing them."""
        external, _ = segment_boundary(self._calls)
        inside = set(self._calls)
        return external + [n for n in self._program_outputs()
                           if n not in inside and n not in external]

    def _program_outputs(self) -> tuple[torch.fx.Node, ...]:
        """What the stage sends on (before its send placements), in :attr:`sent` order."""
        nodes = {n.name: n for n in self.ep.graph.nodes}
        return tuple(nodes[name] for name in self.sent)

    def _runs_locally(self) -> bool:
        """Never: a stage's parameters are DTensors on its sub-mesh even when it
        has one device (:class:`codegen.stage_module.StageModule` reads their placements, FSDP2
        shards them, the boundary values arrive as DTensors)."""
        return False

    def _check_mesh(self, mesh: DeviceMesh) -> None:
        want = [int(d) for d in self.plan.pipeline.stage_mesh["shape"]]
        if list(mesh.shape) != want:
            raise PlanMismatchError(f"stage {self.stage.index} is planned on a mesh of shape "
                                    f"{want} but its sub-mesh has shape {list(mesh.shape)}")

    def _program_calls(self) -> list[torch.fx.Node]:
        """The stage's ops, and before a later stage's, the ops that compute the
        values it recomputes instead of receiving (:func:`recomputable_cones`)."""
        calls = [n for n in self.ep.graph.nodes if n.op == "call_function"]
        names = {n.name for n in calls}
        unknown = [n for n in self.stage.nodes if n not in names]
        if unknown:
            raise PlanMismatchError(f"stage {self.stage.index} runs node {unknown[0]} that the "
                                    f"captured program does not have; re-plan this model")
        cones = {} if self.stage.index == 0 else recomputable_cones(self.ep, self.stage.inputs)
        self._recomputed = set(cones)
        wanted = set(self.stage.nodes) | {n.name for cone in cones.values() for n in cone}
        return [n for n in calls if n.name in wanted]

    def _kept_values(self) -> set[str]:
        return set(self.stage.outputs)

    def _wants_placeholder(self, name: str) -> bool:
        return name in self._reads_of_calls()

    def _reads_of_calls(self) -> set[str]:
        """The names of the values the stage's ops read."""
        if not hasattr(self, "_reads"):
            self._reads = {a.name for n in self._calls for a in n.all_input_nodes}
        return self._reads

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
        return [n.name for n in self._calls]

    def _check_boundary(self) -> None:
        """Every value the stage reads is its input, its own, or a parameter/buffer/constant."""
        have = set(self.stage.inputs) | set(self._placeholders) | set(self._local_inputs)
        if self.is_first:
            have |= set(self.user_input_names)
            extra = [n for n in self.stage.inputs
                     if n not in self.user_input_names and n not in self.constants]
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
        if self.plan.compiles and self._compiled is None and not self._compile_refused:
            self._start_compiled()
        self._compile_units()
        if self._compiled is not None:
            values = [env[name] if name in env else self._placeholder_value(name)
                      for name in self._compiled_inputs]
            if self.record.recording:
                self._record_program(values)
            sent = self._compiled(*values)
        else:
            self._execute(env)
            sent = tuple(env[n] for n in self.sent)
        self._forwards += 1
        outs = tuple(self._send(n, v) for n, v in zip(self.sent, sent))
        return outs[0] if len(outs) == 1 else outs

    def _local_user_inputs(self) -> dict[str, DTensor]:
        """The user inputs a later stage reads, from this rank's copy of the
        current micro-batch, at the stage's planned placements."""
        wanted = self._local_inputs
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


def recomputable_cones(program: Any, names: Iterable[str]) -> dict[str, list[torch.fx.Node]]:
    """The values among ``names`` that a later stage computes for itself rather
    than receive from the stage before: those that are not floating (they carry
    no gradient, and only values that do cross stages) and that the program
    computes from its user inputs and lifted constants alone, by ops that draw
    no random numbers (an attention mask made from the token ids). Each maps to
    the ops that compute it, in program order. The sending and the receiving
    stage both ask this, so they agree on what crosses."""
    signature = program.graph_signature
    sources = {spec.arg.name for spec in signature.input_specs
               if spec.kind.name in ("USER_INPUT", "CONSTANT_TENSOR")}
    nodes = {n.name: n for n in program.graph.nodes}
    order = {n: i for i, n in enumerate(program.graph.nodes)}
    cones: dict[str, list[torch.fx.Node]] = {}
    for name in names:
        node = nodes.get(name)
        val = node.meta.get("val") if node is not None else None
        if (node is None or node.op != "call_function" or not isinstance(val, torch.Tensor)
                or val.is_floating_point()):
            continue
        cone: set[torch.fx.Node] = set()
        stack, computable = [node], True
        while stack and computable:
            n = stack.pop()
            if n in cone:
                continue
            if n.op == "placeholder":
                computable = n.name in sources
            elif n.op != "call_function" or draws_random(str(n.target)):
                computable = False
            else:
                cone.add(n)
                stack.extend(n.all_input_nodes)
        if computable:
            cones[name] = sorted(cone, key=order.__getitem__)
    return cones


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
