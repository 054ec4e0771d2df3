"""Run a pipeline Plan: a DTensor stage runtime per stage under torch's pipeline schedule.

A pipeline plan (``plan.pipeline``) cuts the program captured at *micro-batch*
shapes into stages. Every rank of the world mesh ``[pp] + stage_mesh`` runs the
stages whose ``pp_rank`` is its row of the ``pp`` axis:

* :class:`codegen.stage_executor.StageExecutor` runs one stage's nodes on
  DTensors over the stage's sub-mesh, from and to local boundary shards;
* :class:`codegen.stage_module.StageModule` owns the stage's parameters (FSDP2
  sharded for ZeRO-2/3, with :class:`codegen.zero1.StateShards` for ZeRO-1);
* :class:`PipelineRuntime` builds the stages (``torch.distributed.pipelining.
  PipelineStage``, static shapes) and the plan's schedule class
  (``costmodel.schedules.specs.SCHEDULE_SPECS``), and runs one step on the
  global batch: torch splits it into ``num_microbatches`` micro-batches along
  dim 0 (:func:`split_microbatches`), the last stage's output is the
  micro-batch loss, and the schedule averages gradients over micro-batches
  (``scale_grads``), which gives the full-batch mean loss's gradients when the
  model's loss is a per-micro-batch mean.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.tensor import DTensor

from codegen.capture import capture_program
from codegen.context_parallel import cut_sequences, layout_of
from codegen.grad_reduction import grads_to_placements
from codegen.pipeline_validation import PipelinePlanError, validate_pipeline_plan
from codegen.program_inputs import Materialize
from codegen.stage_executor import StageExecutor
from codegen.stage_module import StageModule, fully_shard_stage
from codegen.zero1 import MakeOptimizer, OptimizerGroup, ShardedStateOptimizer, StateShards
from costmodel.schedules.specs import schedule_spec
from costmodel.strategy_cost import FSDP_STAGES
from ir.torch_compat import without_local_backward_handoff
from plan.format import Plan, StagePlan

__all__ = ["PipelineRuntime", "split_microbatch", "split_microbatches"]


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


# ------------------------------------------------------------------ torch's stage
#: the FSDP2 settings torch's stage turns off for a backward that is not the last
_NO_SYNC_SETTERS = ("set_is_last_backward", "set_reshard_after_backward",
                    "set_requires_gradient_sync")


def _ignore(*args: Any, **kwargs: Any) -> None:
    """A setting left as it is."""


def _weight_pass_done() -> Callable[..., None]:
    """The weight pass of a stage whose input pass ran its whole backward.

    A compiled stage's backward is one autograd node (AOTAutograd's compiled
    backward graph) that makes input and weight gradients together, so torch's
    split of it (``autograd.grad`` over the inputs, then over the weights) would
    run it twice. Given as torch's ``dw_builder``, this has the stage run its
    whole backward in the input pass and nothing in the weight pass; the cost
    model prices a compiled stage so (``planner.search.stage_dp.stage_times``)."""
    return _ignore


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
                fully_shard_stage(module, st, plan, stage_mesh[names[st.zero_axis]]
                                   if len(names) > 1 else stage_mesh)
                executor.materialize_shards(module)
            stages.append(_Stage(
                module, st.index, len(pipe.stages), device,
                input_args=executor.example_inputs(microbatch),
                output_args=executor.example_outputs(), group=world.get_group("pp"),
                dw_builder=_weight_pass_done if plan.compiles else None))
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

    def step(self, global_inputs: Sequence[Any], *, forward_only: bool = False
             ) -> list[torch.Tensor] | None:
        """One forward and backward of the global batch (``forward_only``: the
        forward alone, the schedule's ``eval``); the micro-batch losses on the
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
        if forward_only:
            with without_local_backward_handoff(self.stages):
                self.schedule.eval(*args, target=target, losses=losses, return_outputs=False)
        else:
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
        return grads_to_placements(p for module, st in zip(self.modules, self.stage_plans)
                                   if not st.zero_stage for p in module.parameters())

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
