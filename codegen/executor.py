"""Run a Plan with DTensor: an interpreter over the captured aten program.

:class:`PlanExecutor` captures the model exactly as the planner did
(:mod:`codegen.capture`), refuses a plan made for a different program,
distributes every parameter with ``distribute_tensor`` as the plan says
(:mod:`codegen.program_inputs`), and then executes the exported graph one aten
op at a time on DTensors (:mod:`codegen.node_runner`):

* placeholders become the DTensor parameters, buffers and user inputs;
* values computed only from constants (``arange``/``full`` masks and the like) stay
  plain tensors and become replicated DTensors where they meet a DTensor op;
* before each op, every DTensor argument is ``redistribute()``-d to the placement
  the plan gives for that argument (an *explicit reshard*, recorded);
* the op itself is dispatched by DTensor (autograd flows through it); the output
  placements it produced are recorded and, where they differ from the plan's,
  redistributed to the planned ones (a *mismatch*, counted);
* an op DTensor cannot shard runs replicated (inputs gathered, local op, output
  wrapped back as ``Replicate``) with a warning that names the op;
* layers the plan checkpoints run under ``torch.utils.checkpoint``
  (:mod:`codegen.checkpointed_layers`).

On a mesh of one device every placement is the whole tensor: the first forward
is interpreted (and recorded) as above, later ones (unless every step records)
run the program as Python code on plain tensors (:meth:`PlanExecutor._compile`),
each op called through the public torch function that dispatches its aten
overload where one does (:func:`codegen.node_runner.public_binding`),
checkpointed layers as submodules under ``torch.utils.checkpoint``.

Nodes the plan does not list run in *follow DTensor* mode: no redistribution, only
recording (:mod:`codegen.placement_record`). Running a plan that lists only
parameter and input placements therefore records what DTensor does by itself;
:meth:`PlanExecutor.recorded_plan` turns that record into a complete Plan (used by
the tests to make plans without the ILP; :func:`record_plan` does it in one call).

Placement strings are the plan's (:mod:`ir.placements`): ``R``, ``S(d)``, ``P``
(sum), ``P(avg)``, ``S(d)[sf=k]`` (a strided shard), ``P(mask)`` (recorded only).
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.export.graph_signature import InputKind, OutputKind

from codegen.capture import (CapturedProgram, PlanMismatchError, capture_program,
                             check_plan_fits_program)
from codegen.compiled_program import CompileReport, CompiledRegion
from codegen.checkpointed_layers import checkpoint_segments, run_checkpointed
from codegen.context_parallel import ContextParallelRuntime, cut_sequences, layout_of
from codegen.lowered_program import lower
from codegen.node_runner import NodeRunner, tensor_leaves
from codegen.placement_record import PlacementRecord
from codegen.program_code import CheckpointedLayer, program_code, segment_program
from codegen.program_inputs import InputPlacer, Materialize
from codegen.redistribution import plan_on_mesh
from codegen.zero3_units import UnitRun, run_unit
from ir.exported_graph import tied_parameters
from ir.precision import cast_float
from ir.torch_compat import (fake_store_type, register_fused_attention_sharding,
                             register_zeros_like_input_sharding, tree_leaves)
from plan.format import Plan

__all__ = ["PlanExecutor", "record_plan"]


class PlanExecutor:
    """Executes a captured program on DTensors as a Plan says.

    Args:
        plan: the Plan (``plan.nodes`` may be empty: follow-DTensor mode).
        model: the real, materialised model (same weights on every rank).
        example_inputs: inputs of the same shapes the plan was made for.
        mesh: the DeviceMesh, of shape ``plan.mesh_shape``.
        record_every_step: keep recording placements after the first forward
            (recording asks DTensor's sharding propagator about every op).
        program: the model already captured with these inputs (see
            :func:`codegen.capture.capture_program`), to share one capture
            between executors.
        materialize: the whole value of a state tensor ``model`` holds on meta
            (:class:`codegen.program_inputs.InputPlacer`); this rank keeps its shard.

    Subclasses run part of the program (a pipeline stage, ``codegen.pipeline``)
    by overriding :meth:`_program_calls`, :meth:`_kept_values`,
    :meth:`_wants_placeholder`, :meth:`_checkpoint_layers`,
    :meth:`_check_mesh` and :meth:`_planned_node_names`.

    Attributes:
        record: the :class:`codegen.placement_record.PlacementRecord` of the
            last forward: the placements each op consumed and produced, the
            reshards (explicit, by DTensor, of mismatched outputs), the
            mismatches and the ops that ran replicated.
        context_parallel_layout: the plan's cp groups
            (:func:`codegen.context_parallel.layout_of`); None without cp.
    """

    def __init__(self, plan: Plan, model: torch.nn.Module, example_inputs: Any,
                 mesh: DeviceMesh, *, record_every_step: bool = False,
                 program: CapturedProgram | None = None,
                 materialize: Materialize | None = None):
        self.plan = plan
        self.mesh = mesh
        self.record_every_step = record_every_step
        self._check_mesh(mesh)
        self.plan = plan_on_mesh(plan, tuple(mesh.shape))
        # one device: every placement is the whole tensor, so the program runs on
        # plain tensors, without DTensor's per-op sharding propagation
        self.local = self._runs_locally()
        self.precision = plan.precision
        register_fused_attention_sharding()
        register_zeros_like_input_sharding()
        # context parallelism: the program is one cp rank's, fed whole
        # sequences cut into its rows (codegen.context_parallel)
        self.context_parallel_layout = layout_of(self.plan)
        if self.context_parallel_layout is not None and program is None:
            example_inputs = cut_sequences(tree_leaves(example_inputs),
                                           self.context_parallel_layout)
        if program is None:
            program = capture_program(model, example_inputs, self.precision,
                                      torch.device(mesh.device_type))
        check_plan_fits_program(plan, program, model)
        self.ep, self.graph = program.ep, program.graph
        self.record = PlacementRecord()
        self._runner = NodeRunner(self.plan, mesh, self.record, local=self.local,
                                  context_parallel=self._context_parallel(example_inputs))
        self._inputs = InputPlacer(self.plan, mesh, self.record.placeholder_placements,
                                   local=self.local, materialize=materialize,
                                   parameters_on_meta=self._parameters_on_meta())
        self._forwards = 0
        # one device: the program as Python code (made by the first forward, or
        # before it when the plan compiles) and its placeholders' names, in
        # argument order
        self._compiled: Callable[..., Any] | None = None
        self._compiled_inputs: list[str] = []
        #: how the program's regions compiled (:mod:`codegen.compiled_program`)
        self.compile_report = CompileReport()
        self._compile_refused = False
        #: the plan's redistributions in one forward of the compiled program
        self._compiled_reshards = 0
        self._calls = self._program_calls()
        self._last_use = self._last_uses(self._calls, self._kept_values())
        self._segments = checkpoint_segments(self.graph, self._calls, self._checkpoint_layers())
        # first op name -> the ops of a ZeRO-3 unit, run through its module (run_by_unit)
        self._units: dict[str, UnitRun] = {}
        self._unit_params: set[str] = set()
        placed = self._inputs.place_state(self.ep, self._wants_placeholder,
                                          tied_parameters(model))
        self._params = placed.params
        self._placeholders = placed.placeholders
        self.user_input_names = placed.user_input_names
        self._hold_only_placed(placed.params)

    def _context_parallel(self, cut_inputs: Any) -> ContextParallelRuntime | None:
        """The plan's context parallelism at run time (its cp groups made
        here, on every rank alike), or None without; ``cut_inputs``: the
        program's example inputs, one cp rank's rows."""
        if self.context_parallel_layout is None:
            return None
        tokens = next(t.shape[1] for t in tree_leaves(cut_inputs)
                      if isinstance(t, torch.Tensor) and t.dim() >= 2)
        return ContextParallelRuntime(self.plan, self.mesh, self.ep.graph, self.graph,
                                      self.context_parallel_layout, int(tokens))

    def _hold_only_placed(self, params: dict[str, torch.nn.Parameter]) -> None:
        """Point the program's state at the parameters placed here, so that it no
        longer holds the model's own where they differ (the fp32 originals of a
        bf16 plan, whole tensors of a sharded one): a rank then holds what the
        plan prices. Parameters of other stages are left for their executors."""
        for fqn, param in params.items():
            self._hold_in_state(fqn, param)

    def _hold_in_state(self, fqn: str, value: torch.Tensor | None) -> None:
        """Make the program's state dict hold ``value`` for parameter ``fqn`` (one
        this executor places), or nothing when ``value`` is None, so that it
        keeps alive only what the rank runs with."""
        state = self.ep.state_dict
        if fqn not in state:
            return
        if value is None:
            del state[fqn]
        else:
            state[fqn] = value

    # ------------------------------------------------ what part of the program runs
    def _check_mesh(self, mesh: DeviceMesh) -> None:
        """Refuse a device mesh of another shape than the plan's."""
        if tuple(mesh.shape) != tuple(self.plan.mesh_shape):
            raise PlanMismatchError(
                f"plan is for a mesh of shape {list(self.plan.mesh_shape)} but the device mesh "
                f"has shape {list(mesh.shape)}; launch with {self.plan.world_size} ranks")

    def _runs_locally(self) -> bool:
        """Whether the program runs on plain tensors: a mesh of one device."""
        return self.mesh.size() == 1

    def _parameters_on_meta(self) -> bool:
        """Whether parameters the model holds on meta stay there when placed
        (their owner materialises them; here: never)."""
        return False

    def _program_calls(self) -> list[torch.fx.Node]:
        """The op nodes this executor runs, in program order (here: all of them)."""
        return [n for n in self.ep.graph.nodes if n.op == "call_function"]

    def _kept_values(self) -> set[str]:
        """Values that must outlive their last reader (here: the program's outputs)."""
        out = next(n for n in self.ep.graph.nodes if n.op == "output")
        return {a.name for a in out.all_input_nodes}

    def _wants_placeholder(self, name: str) -> bool:
        """Whether the parameter/buffer/constant placeholder ``name`` is set up here."""
        return True

    def _checkpoint_layers(self) -> list[str]:
        """Module paths of the layers run under activation checkpointing."""
        return list(self.plan.checkpoint)

    def _planned_node_names(self) -> list[str]:
        """Nodes :meth:`compare_with_plan` checks."""
        return list(self.plan.nodes)

    @staticmethod
    def _last_uses(calls: Sequence[torch.fx.Node], kept: set[str]) -> dict[str, list[str]]:
        """Node name -> the values read for the last time by it (freed right after it runs)."""
        last_reader: dict[str, str] = {}
        for node in calls:
            for arg in node.all_input_nodes:
                last_reader[arg.name] = node.name
        last_use: dict[str, list[str]] = {}
        for value, reader in last_reader.items():
            if value not in kept:
                last_use.setdefault(reader, []).append(value)
        return last_use

    # ----------------------------------------------------------------- parameters
    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """(FQN, DTensor parameter) pairs, in capture order."""
        return iter(self._params.items())

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        return iter(self._params.values())

    def named_buffers(self) -> Iterator[tuple[str, Any]]:
        """(FQN, current value) of every buffer this executor holds, in capture
        order: plain tensors or DTensors, in the compute dtype. A buffer that
        forward updates (BatchNorm's running statistics) has the value of the
        last forward's update (:meth:`_user_outputs`), as the model's own
        buffer would after the same forwards in one process."""
        for spec in self.ep.graph_signature.input_specs:
            if spec.kind == InputKind.BUFFER and spec.arg.name in self._placeholders:
                yield spec.target, self._placeholders[spec.arg.name]

    # ---------------------------------------------------------------- running
    def __call__(self, *inputs: Any) -> Any:
        return self.forward(*inputs)

    def forward(self, *inputs: Any) -> Any:
        """Run the program; returns its user outputs (one value, or a tuple)."""
        self._begin_forward()
        flat_inputs = tree_leaves(inputs)
        if self.context_parallel_layout is not None:
            flat_inputs = list(cut_sequences(flat_inputs, self.context_parallel_layout))
        if len(flat_inputs) != len(self.user_input_names):
            raise ValueError(f"program takes {len(self.user_input_names)} inputs "
                             f"({', '.join(self.user_input_names)}), got {len(flat_inputs)}")
        env: dict[str, Any] = {}
        for name, value in zip(self.user_input_names, flat_inputs):
            env[name] = self._inputs.place_input(name, value)
        if self.plan.compiles and self._compiled is None and not self._compile_refused:
            self._start_compiled()
        self._compile_units()
        if self._compiled is not None and (self.plan.compiles or not self.record.recording):
            args = [env[name] if name in env else self._placeholder_value(name)
                    for name in self._compiled_inputs]
            if self.record.recording:
                self._record_program(args)
                self._compiled_reshards = self.record.explicit_reshards
            # the lowered program redistributes where the interpreter does
            self.record.explicit_reshards = self._compiled_reshards
            self._forwards += 1
            return self._user_outputs(self._compiled(*args))
        self._execute(env)
        self._forwards += 1
        if self.local and self._compiled is None and not self.record_every_step:
            # made in the recording forward, whose time is a warm-up's anyway
            self._use_program(self._compile())
        out = next(n for n in self.ep.graph.nodes if n.op == "output")
        outputs = torch.fx.node.map_arg(out.args[0], lambda n: env[n.name])
        return self._user_outputs(outputs)

    def _use_program(self, program: Callable[..., Any]) -> None:
        """Run the program as ``program`` (:meth:`_compile`'s GraphModule, or it
        compiled) from now on, its placeholders in :attr:`_compiled_inputs` order."""
        module = program.program if isinstance(program, CompiledRegion) else program
        self._compiled = program
        self._compiled_inputs = [n.name for n in module.graph.nodes if n.op == "placeholder"]

    def _start_compiled(self) -> None:
        """Run the program compiled from now on (:mod:`codegen.compiled_program`):
        on one device its GraphModule, on a mesh that module with the plan's
        placements written in (:func:`codegen.lowered_program.lower`). A
        program that cannot be lowered stays interpreted, and a warning says why."""
        if self.local:
            program = self._compile()
        else:
            if self._units:  # each ZeRO-3 unit compiles; the ops between them are few
                self._compile_refused = True
                return
            program = lower(self._compile(), self.plan, self.mesh,
                            context_parallel=self._runner.context_parallel)
            self._compile_checkpointed_layers(program)
        self._use_program(CompiledRegion(program, self._region_name(), self.compile_report,
                                         eager=self._interpreted))

    def _compile_checkpointed_layers(self, program: torch.fx.GraphModule) -> None:
        """Give each checkpointed layer of lowered ``program`` its own compiled
        region, run inside an eager checkpoint: torch's compiler traces a
        checkpoint over DTensors but saves the ``DeviceMesh`` among the
        backward's tensors and fails (:class:`codegen.program_code.CheckpointedLayer`)."""
        for name, layer in program.named_children():
            if isinstance(layer, CheckpointedLayer):
                layer.region = CompiledRegion(
                    layer.program, f"{self._region_name()}'s checkpointed layer {name}",
                    self.compile_report)

    def _compile_units(self) -> None:
        """Under a compiling plan, give each ZeRO-3 unit its ops as a compiled
        program of their own (lowered: :func:`codegen.lowered_program.lower`), run
        inside the unit's module so that FSDP2's hooks gather and free its
        parameters around it, as torchtitan compiles its blocks. Done after the
        first forward, which records the units' placements interpreted."""
        if not (self.plan.compiles and self._units and not self.record.recording):
            return
        memo: dict[Any, Any] = {}
        cp = self._runner.context_parallel
        for unit in self._units.values():
            if unit.program is not None:
                continue
            program, external, _ = segment_program(
                unit.segment, memo,
                eager_first=cp.positions_region(unit.segment) if cp else ())
            region = CompiledRegion(lower(program, self.plan, self.mesh, context_parallel=cp),
                                    f"{self._region_name()}'s unit {unit.name}",
                                    self.compile_report)
            unit.program_inputs = [v.name for v in external]
            unit.program = region

    def _interpreted(self, *args: Any) -> Any:
        """The program's outputs for placeholder values ``args`` (in
        :attr:`_compiled_inputs` order), interpreted op by op."""
        env = dict(zip(self._compiled_inputs, args))
        self._execute(env)
        return torch.fx.node.map_arg(self._program_outputs(), lambda n: env[n.name])

    def _record_program(self, args: list[Any]) -> None:
        """Record the placements of a forward the compiled program runs: on one
        device every placement is ``R``; on a mesh the program is also
        interpreted once, without autograd, and its placements recorded."""
        if not self.local:
            with torch.no_grad():
                self._interpreted(*args)
            return
        replicated = ["R"] * self.mesh.ndim
        for node in self._calls:
            entry = self.plan.nodes.get(node.name)
            self.record.observe(node.name, [replicated for _ in (entry.inputs if entry else ())],
                                [replicated for _ in tensor_leaves(node.meta.get("val"))])

    def _region_name(self) -> str:
        """The program's name in compile log lines."""
        return "the program"

    def _compile(self) -> torch.fx.GraphModule:
        """The program (:meth:`_program_calls`) as Python code
        (``torch.fx.GraphModule``): it runs the same ops in the same order as
        :meth:`_execute` without interpreting each node, takes the values they
        read from outside as arguments named as in the captured program, and
        returns :meth:`_program_outputs` (:func:`codegen.program_code.program_code`:
        a checkpointed layer is one submodule run under
        ``torch.utils.checkpoint``; context parallelism's token positions one
        run eager, first)."""
        cp = self._runner.context_parallel
        return program_code(self._calls, self._program_inputs(), self._program_outputs(), {},
                            layers=list(self._segments.values()),
                            eager_first=cp.positions_region(self._calls) if cp else ())

    def _program_inputs(self) -> list[torch.fx.Node]:
        """The values the program takes (graph nodes, in argument order): here
        every placeholder of the captured program, in its order."""
        return [n for n in self.ep.graph.nodes if n.op == "placeholder"]

    def _program_outputs(self) -> Any:
        """The values the program returns (graph nodes, in the output's structure):
        here the captured program's outputs."""
        return next(n for n in self.ep.graph.nodes if n.op == "output").args[0]

    def _begin_forward(self) -> None:
        """Reset the per-forward records (recording only on the first forward)."""
        self.record.begin(self.record_every_step or self._forwards == 0)

    def _placeholder_value(self, name: str) -> Any:
        """The value of a parameter/buffer/constant placeholder for this forward:
        under a mixed precision a parameter's compute-dtype copy (autograd
        brings its gradient back to the master parameter in the master dtype,
        so gradients are reduced in it)."""
        value = self._placeholders[name]
        if self.precision.mixed and isinstance(value, torch.nn.Parameter):
            return cast_float(value, self.precision.compute_dtype)
        return value

    def _execute(self, env: dict[str, Any]) -> None:
        """Run :meth:`_program_calls` on ``env`` (user inputs or boundary values in it).

        Values are dropped from ``env`` after their last reader (autograd keeps
        what backward needs), except :meth:`_kept_values`.
        """
        for node in self.ep.graph.nodes:
            if (node.op == "placeholder" and node.name not in env
                    and node.name in self._placeholders and node.name not in self._unit_params):
                env[node.name] = self._placeholder_value(node.name)
        skip: set[str] = set()
        for node in self._calls:
            if node.name in skip:
                continue
            if node.name in self._units:
                unit = self._units[node.name]
                run_unit(unit, env, self._runner.run, self._placeholder_value, self.record,
                         self._last_use)
                skip.update(n.name for n in unit.segment)
                continue
            if node.name in self._segments:
                segment = self._segments[node.name]
                run_checkpointed(segment, env, self._runner.run, self.record, self._last_use)
                skip.update(n.name for n in segment)
                continue
            env[node.name] = self._runner.run(node, env)
            for name in self._last_use.get(node.name, ()):
                env.pop(name, None)

    def _user_outputs(self, outputs: Any) -> Any:
        """The program's user outputs; buffer mutations update the buffers."""
        specs = self.ep.graph_signature.output_specs
        user = []
        for spec, value in zip(specs, outputs):
            if spec.kind in (OutputKind.USER_OUTPUT, OutputKind.LOSS_OUTPUT):
                user.append(value)
            elif spec.kind == OutputKind.BUFFER_MUTATION:
                name = next(s.arg.name for s in self.ep.graph_signature.input_specs
                            if s.kind == InputKind.BUFFER and s.target == spec.target)
                self._placeholders[name] = value.detach()
            else:
                raise NotImplementedError(f"program output kind {spec.kind.name} is not supported")
        return user[0] if len(user) == 1 else tuple(user)

    def _wrap_replicated(self, t: torch.Tensor) -> DTensor:
        """A plain tensor (the same on every rank) as a replicated DTensor."""
        return self._runner.wrap_replicated(t)

    # ------------------------------------------------------------- reporting
    def compare_with_plan(self) -> list[str]:
        """Differences between the recorded placements and the plan's, one line each."""
        return self.record.compare_with_plan(self.plan, self._planned_node_names())

    def recorded_plan(self) -> Plan:
        """A copy of the plan whose ``nodes`` and ``reshards`` are what was observed.

        Run a plan that lists only parameter and input placements once, then call
        this: the result, fed back, makes every reshard explicit.
        """
        return self.record.recorded_plan(self.plan, self.graph)


def record_plan(plan: Plan, model: torch.nn.Module, example_inputs: Any) -> Plan:
    """Run ``plan`` once in this process and return it with the observed placements.

    Where no process group exists, a fake one of the plan's world size is used
    (collectives do nothing; the placements DTensor chooses depend only on shapes
    and placements, so they are those a real run observes). The model must be
    materialised (CPU is fine); only the forward pass runs.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("fake", store=fake_store_type()(), rank=0,
                                world_size=plan.world_size)
    try:
        device_type = next((p.device.type for p in model.parameters()), "cpu")
        mesh = init_device_mesh(device_type, plan.mesh_shape)
        executor = PlanExecutor(plan, model, example_inputs, mesh)
        with torch.no_grad():
            executor(*(example_inputs if isinstance(example_inputs, (tuple, list))
                       else (example_inputs,)))
        return executor.recorded_plan()
    finally:
        if own_group:
            dist.destroy_process_group()
