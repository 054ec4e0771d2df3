"""A plan as a trainable parallel model for the user's own loop.

    import torch
    from codegen.parallel_model import parallelize

    model = parallelize("plan.json")          # under torchrun, one process per device
    opt = model.optimizer(torch.optim.AdamW, lr=3e-4)
    for step in range(100):
        loss = model.step(*batch_of(step))    # forward and backward of one global batch
        model.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()

:func:`parallelize` builds the plan's model on the meta device and gives each
rank only what the plan places on it: a single-stage plan's parameters as
DTensors of their planned placements (:class:`codegen.executor.PlanExecutor`),
a pipeline plan's stages of this rank (:class:`codegen.pipeline.PipelineRuntime`,
FSDP2 for ZeRO-2/3 stages, :class:`codegen.zero1.StateShards` for ZeRO-1). Fresh
weights are exactly those one process building the model with seed 0 gets
(:mod:`codegen.deferred_init` replays each tensor's initialisation alone, one
tensor at a time); ``init="empty"`` allocates the shards for a checkpoint to
fill.

:class:`ParallelModel` is what the user trains: :meth:`ParallelModel.step`
(every plan kind: one stage, accumulation, pipelines, ZeRO-1/2/3, experts),
:meth:`ParallelModel.optimizer` (torch's own optimizer, so torch's LR
schedulers work), :meth:`ParallelModel.clip_grad_norm_` (the global norm over
every DTensor and stage), :meth:`ParallelModel.state_dict` and
:meth:`ParallelModel.optimizer_state_dict` (the original model's FQNs, tensors
as DTensors of their global shapes, so ``torch.distributed.checkpoint`` saves
them and loads them under another plan).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate

from codegen.plan_model import loss_of
from codegen.rank_process import ensure_process_group, release_freed_memory
from codegen.runnable import unrunnable_reason
from codegen.step_phases import backward_tracer, during
from codegen.zero1 import StateShards
from costmodel.host_allocator import keep_freed_host_memory
from plan.format import Plan, load_plan
from ir.torch_compat import outside_fake_mode

__all__ = ["BatchShapeError", "InputSpec", "ParallelModel", "backward_to_placements",
           "check_batch", "parallelize"]

#: How the parameters get their first values: ``"fresh"`` (the model's own
#: initialisation, exactly as one process builds it) or ``"empty"`` (allocated
#: only, for a checkpoint to fill). Buffers are always the model's own.
INITS = ("fresh", "empty")


class BatchShapeError(ValueError):
    """A batch that is not of the shapes and dtypes the plan was made for."""


def _as_tuple(inputs: Any) -> tuple:
    return tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)


def _build_on_meta(plan: Plan, device: torch.device, init: str) -> tuple[nn.Module, tuple, Any]:
    """The plan's model and example inputs on meta, and how to give a state
    tensor its whole value on ``device`` (:data:`INITS`)."""
    from codegen.deferred_init import record_build
    from codegen.plan_model import build_plan_model

    (model, inputs), record = record_build(lambda: build_plan_model(plan, "meta"), device)
    release_freed_memory(device)
    parameters = {id(p) for p in model.parameters()}

    def materialize(fqn: str, t: torch.Tensor) -> torch.Tensor:
        # buffers (rotary frequencies, masks) are the model's own either way: a
        # checkpoint holds the parameters
        if init == "empty" and id(t) in parameters:
            return torch.empty(t.shape, dtype=t.dtype, device=device)
        return record.materialize(t)

    return model, inputs, materialize


@dataclass(frozen=True)
class InputSpec:
    """The shape and dtype of one tensor input the plan was made for."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @classmethod
    def of(cls, value: Any) -> "InputSpec | None":
        """The spec of an example input (None for a value that is not a tensor)."""
        if not isinstance(value, torch.Tensor):
            return None
        return cls(tuple(int(d) for d in value.shape), value.dtype)


def check_batch(batch: Sequence[Any], specs: Sequence[InputSpec | None]) -> None:
    """Refuse (:class:`BatchShapeError`, one line) a batch whose inputs differ in
    number, shape or dtype from ``specs`` (the plan's example inputs, in order)."""
    if len(batch) != len(specs):
        raise BatchShapeError(f"the plan's model takes {len(specs)} inputs, the batch has "
                              f"{len(batch)}; give the model's inputs in the plan's order")
    for i, (value, spec) in enumerate(zip(batch, specs)):
        if spec is None:
            continue
        if not isinstance(value, torch.Tensor):
            raise BatchShapeError(f"batch input {i} is a {type(value).__name__}, the plan "
                                  f"takes a tensor of shape {list(spec.shape)}")
        if tuple(value.shape) != spec.shape or value.dtype != spec.dtype:
            raise BatchShapeError(
                f"batch input {i} is {list(value.shape)} {value.dtype}, the plan was made "
                f"for {list(spec.shape)} {spec.dtype}; give batches of the planned shape or "
                f"re-plan with --batch-size/--seq-len")


def backward_to_placements(executor: Any, loss: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Backpropagate a single-stage executor's ``loss`` (replicated first, so
    every rank of the mesh backpropagates it) and bring every gradient to its
    parameter's placement (the data-parallel reduction). Returns the loss (this
    rank's 0-d tensor, detached; reading it waits for the step) and how many
    gradients were redistributed."""
    from codegen.grad_reduction import grads_to_placements

    mesh = executor.mesh
    if isinstance(loss, DTensor) and any(not p.is_replicate() for p in loss.placements):
        loss = loss.redistribute(mesh, [Replicate()] * mesh.ndim)
    loss.backward()
    moved = grads_to_placements(executor.parameters())  # a few flat all-reduces
    local = loss.to_local() if isinstance(loss, DTensor) else loss
    return local.detach(), moved


class ParallelModel:
    """This rank's part of a plan, ready to train; make with :func:`parallelize`.

    Attributes:
        plan: the Plan.
        device: this rank's device.
        rank: this rank's global rank.
    """

    def __init__(self, plan: Plan, device: torch.device, example_inputs: Sequence[Any], *,
                 executor: Any = None, pipeline: Any = None):
        self.plan = plan
        self.device = device
        self.rank = dist.get_rank()
        self._executor = executor
        self._pipeline = pipeline
        self._inputs = [InputSpec.of(t) for t in example_inputs]
        self._zero1: list[StateShards] = pipeline.zero1_shards() if pipeline is not None else []
        #: whether :meth:`state_dict` handed out ZeRO-1 master values that may have
        #: been written since the parameters forward reads were gathered from them
        self._masters_exposed = False
        #: gradients the last :meth:`step` redistributed to their placements (this rank)
        self.grad_reductions = 0
        self._steps_done = 0
        #: id(parameter forward reads) -> its ZeRO-1 stage's shards
        self._zero1_of = {id(p): z for z in self._zero1 for p in z.parameters()}
        sharded = {k: v for z in self._zero1 for k, v in z.stepped().items()}
        #: FQN -> (parameter, what the optimizer steps for it, that tensor's
        #: placements as a shard of the parameter, None where it is the parameter)
        self._stepped: dict[str, tuple[nn.Parameter, torch.Tensor, Any]] = {}
        for fqn, p in self.named_parameters():
            tensor, placements = sharded.get(id(p), (p, None))
            self._stepped[fqn] = (p, tensor, placements)

    # ------------------------------------------------------------ parameters
    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """(FQN, parameter) of this rank: DTensors (FSDP2-sharded in ZeRO-2/3
        stages), or plain tensors on a one-device plan."""
        if self._pipeline is not None:
            return iter(self._pipeline.named_parameters())
        return self._executor.named_parameters()

    def parameters(self) -> Iterator[nn.Parameter]:
        return (p for _, p in self.named_parameters())

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The model's parameters by their original FQNs (DTensors of the
        parameters' global shapes; a pipeline rank holds its stages' only), in
        the master dtype: a ZeRO-1 stage under a mixed precision gives its fp32
        master values (this rank's slices), not the bf16 parameters forward
        reads. Written in place (a checkpoint or Hugging Face load), they reach
        those parameters at the next :meth:`step` (every rank calls this, as
        a DCP save or load does)."""
        if any(z.mixed for z in self._zero1):
            self._masters_exposed = True
        return self._master_tensors()

    def _master_tensors(self) -> dict[str, torch.Tensor]:
        """FQN -> the parameter's master values (:meth:`state_dict`)."""
        masters = {}
        for fqn, p in self.named_parameters():
            shards = self._zero1_of.get(id(p))
            masters[fqn] = p if shards is None else shards.master_of(p)
        return masters

    def forward_flops(self) -> float:
        """FLOPs of one step's forward over the global batch, as captured (the
        program the plan was made for; a pipeline's micro-batch program times
        its micro-batches)."""
        if self._pipeline is not None:
            graph = self._pipeline.executors[0].graph
            return graph.forward_flops * self._pipeline.num_microbatches
        return self._executor.graph.forward_flops

    # ---------------------------------------------------------------- step
    @property
    def input_shapes(self) -> list[tuple[int, ...] | None]:
        """The shape of each input :meth:`step` takes (None for a non-tensor):
        the model's own, whole sequences under context parallelism (the
        plan's ``training["input_shapes"]`` are then one cp rank's)."""
        return [spec.shape if spec is not None else None for spec in self._inputs]

    def check_batch(self, batch: Sequence[Any]) -> None:
        """Refuse (:class:`BatchShapeError`) a batch of other shapes or dtypes
        than the plan's inputs."""
        check_batch(batch, self._inputs)

    def step(self, *batch: Any) -> torch.Tensor:
        """Forward and backward of one global batch (every rank passes the same
        batch); afterwards every gradient is reduced to its parameter's
        placement (ZeRO-1: to this rank's slice). Returns the step's loss (the
        mean over micro-batches for a pipeline) on every rank, as a detached
        0-d tensor on this rank's device: ``float(loss)`` waits for the step, so
        a loop that reads it only now and then lets the host run ahead."""
        self.check_batch(batch)
        batch = tuple(self._to_device(t) for t in batch)
        if self._masters_exposed:
            self._gather_zero1()
            self._masters_exposed = False
        if self._pipeline is not None:
            return self._pipeline_step(batch)
        return self._single_stage_step(batch)

    def eval_loss(self, *batch: Any) -> torch.Tensor:
        """The loss of one global batch (every rank passes the same), forward
        only (no autograd, gradients and optimizer states untouched): the
        plan's program, or the pipeline schedule's ``eval`` (the mean over
        micro-batches). A 0-d float64 tensor, the same on every rank."""
        self.check_batch(batch)
        batch = tuple(self._to_device(t) for t in batch)
        if self._masters_exposed:
            self._gather_zero1()
            self._masters_exposed = False
        with torch.no_grad():
            if self._pipeline is None:
                loss = loss_of(self._executor(*batch))
                loss = loss.full_tensor() if isinstance(loss, DTensor) else loss
                return loss.detach().double()
            losses = self._pipeline.step(batch, forward_only=True)
        return self._broadcast_mean(losses)

    def _broadcast_mean(self, losses: list[torch.Tensor] | None) -> torch.Tensor:
        """The mean of the last stage's micro-batch ``losses``, on every rank."""
        value = torch.zeros((), dtype=torch.float64, device=self.device)
        if losses:
            value += torch.stack([x.detach().double() for x in losses]).mean()
        dist.broadcast(value, src=self._last_stage_rank())
        return value

    def _to_device(self, value: Any) -> Any:
        """A batch tensor on this rank's device; from the CPU to a GPU through
        pinned memory without waiting (a pageable copy would wait for the
        device to finish the previous step)."""
        if not isinstance(value, torch.Tensor) or value.device == self.device:
            return value
        if self.device.type == "cuda" and value.device.type == "cpu":
            return value.pin_memory().to(self.device, non_blocking=True)
        return value.to(self.device)

    def _single_stage_step(self, batch: tuple) -> torch.Tensor:
        self._steps_done += 1
        step = self._steps_done
        with during(f"the forward of step {step}"):
            loss = loss_of(self._executor(*batch))
        # the first step names the op whose gradient fails, if one does
        entered = backward_tracer(loss) if step == 1 else lambda: None
        try:
            loss, self.grad_reductions = backward_to_placements(self._executor, loss)
        except Exception as err:
            op = entered()
            err.rank_phase = f"the backward of step {step}" + (f", at {op}" if op else "")
            raise
        return loss

    def _pipeline_step(self, batch: tuple) -> torch.Tensor:
        runtime = self._pipeline
        self._steps_done += 1
        with during(f"the pipelined step {self._steps_done}"):
            losses = runtime.step(batch)
        self.grad_reductions = runtime.sync_grads()
        for shards in self._zero1:
            self.grad_reductions += shards.reduce_grads()
        return self._broadcast_mean(losses)

    def _last_stage_rank(self) -> int:
        """The global rank of the first device of the last stage's mesh."""
        pipe = self.plan.pipeline
        last = pipe.stages[-1].pp_rank
        return int(self._pipeline.world_mesh.mesh[last].flatten()[0])

    # ------------------------------------------------- what the step did
    def compile_regions(self) -> list[Any]:
        """The regions of this rank's program the plan compiles, as far as they
        have run (:class:`codegen.compiled_program.RegionCompile`: the compile
        time, or why one runs eager); empty for an eager plan."""
        return [region for ex in self.executors for region in ex.compile_report.regions]

    @property
    def executors(self) -> list[Any]:
        """The plan executors of this rank (one, or one per pipeline stage it
        runs), with the placements each recorded (:attr:`PlanExecutor.record`)."""
        return self._pipeline.executors if self._pipeline is not None else [self._executor]

    @property
    def reports_for_stage(self) -> bool:
        """Whether this rank speaks for its stage mesh (its first rank): the
        one of its mesh whose records and whole gradients count."""
        return self._pipeline.is_stage_leader if self._pipeline is not None else self.rank == 0

    def recorded_plan(self) -> Plan:
        """The plan with the placements the single stage observed filled in."""
        if self._pipeline is not None:
            raise ValueError("a pipelined plan records no placements; record single stages")
        return self._executor.recorded_plan()

    def full_grads(self) -> dict[str, torch.Tensor | None]:
        """Every gradient of this rank's stages as a whole tensor (None where a
        parameter has none), after :meth:`step` (a collective over each stage's
        mesh: every rank of it calls this)."""
        out: dict[str, torch.Tensor | None] = {}
        for fqn, (param, tensor, placements) in self._stepped.items():
            grad = tensor.grad
            if grad is not None and placements is not None:
                grad = self._global(grad, tensor, param, placements)
            out[fqn] = grad.full_tensor() if isinstance(grad, DTensor) else grad
        return out

    def updated_buffers(self) -> dict[str, torch.Tensor]:
        """Every buffer forward updates (BatchNorm's running statistics) as a
        whole tensor, for a single stage; none for a pipeline (a collective)."""
        if self._pipeline is not None:
            return {}
        updated = set(self._executor.graph.buffer_updates.values())
        return {fqn: (v.full_tensor() if isinstance(v, DTensor) else v)
                for fqn, v in self._executor.named_buffers() if fqn in updated}

    # ----------------------------------------------------- optimizer, clipping
    def optimizer(self, optimizer_class: Callable[..., torch.optim.Optimizer],
                  **kwargs: Any) -> torch.optim.Optimizer:
        """torch's ``optimizer_class(tensors, **kwargs)`` over what this rank
        updates: its parameters, and for ZeRO-1 stages its slices of them (the
        fp32 master slices under a mixed precision; after each ``step`` the
        updated slices are cast to the compute dtype and all-gathered into the
        parameters forward reads). It is a plain torch
        optimizer, so torch's LR schedulers drive it."""
        from codegen.grad_reduction import prefer_foreach

        opt = prefer_foreach(optimizer_class([t for _, t, _ in self._stepped.values()], **kwargs))
        if self._zero1:
            opt.register_step_post_hook(lambda *_: self._gather_zero1())
        return opt

    def _gather_zero1(self) -> None:
        for shards in self._zero1:
            shards.gather_params()

    def _grads(self) -> list[tuple[torch.Tensor, DTensor | None, Any]]:
        """(the gradient this rank holds, its parameter, its placements as a shard
        of the parameter or None) of every parameter with one."""
        out = []
        for p, tensor, placements in self._stepped.values():
            if tensor.grad is not None:
                out.append((tensor.grad, p, placements))
        return out

    @torch.no_grad()
    def grad_norm(self) -> float:
        """The 2-norm of every gradient of the model, over all ranks and stages
        (a collective: every rank calls it)."""
        return float(self._grad_norm())

    def _grad_norm(self) -> torch.Tensor:
        """:meth:`grad_norm` as a 0-d float64 tensor on this rank's device
        (reading it waits for the step). The local tensors' norm is torch's
        (``torch.nn.utils.get_total_norm``, as ``clip_grad_norm_`` takes it);
        its squares are summed in fp64 over the mesh axes that split the
        tensors, then over pipeline stages."""
        groups: dict[Any, list[torch.Tensor]] = {}
        for grad, param, placements in self._grads():
            if isinstance(grad, DTensor):
                mesh, placements, local = grad.device_mesh, grad.placements, grad.to_local()
            elif placements is not None:
                mesh, local = param.device_mesh, grad
            else:
                mesh, placements, local = None, None, grad
            # squares summed over the axes that split the tensor, not the replicated ones
            summed = None if placements is None else tuple(
                Partial() if q.is_shard() or q.is_partial() else Replicate() for q in placements)
            groups.setdefault((id(mesh), summed), [mesh]).append(local.detach())
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for (_, summed), (mesh, *locals_) in groups.items():
            part = torch.nn.utils.get_total_norm(locals_).double().square()
            if summed is not None:
                part = DTensor.from_local(part, mesh, summed, run_check=False).full_tensor()
            total += part
        if self._pipeline is not None and self.plan.pipeline.pp > 1:
            dist.all_reduce(total, group=self._pipeline.world_mesh.get_group("pp"))
        return total.sqrt()

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale every gradient by ``max_norm / (norm + 1e-6)`` where that is
        below 1, as ``torch.nn.utils.clip_grad_norm_`` does on one device, with
        the norm over the whole model (:meth:`grad_norm`); returns the norm, a
        0-d tensor as torch's does (the host does not wait for it)."""
        norm = self._grad_norm()
        coefficient = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for grad, _, _ in self._grads():  # a shard scaled in place scales its DTensor
            local = grad.to_local() if isinstance(grad, DTensor) else grad
            local.mul_(coefficient)  # a 0-d tensor: computed in the gradient's dtype
        return norm

    # ------------------------------------------------------- optimizer state
    def optimizer_state_dict(self, opt: torch.optim.Optimizer) -> dict[str, Any]:
        """``opt``'s state by parameter FQN (``{"state": {fqn: {name: value}},
        "param_groups": [...]}``), each per-element state a DTensor of the
        parameter's global shape, so ``torch.distributed.checkpoint`` reshards
        it. The tensors alias ``opt``'s own: loading into them in place loads
        the optimizer (see :meth:`init_optimizer_state`)."""
        state: dict[str, dict[str, Any]] = {}
        for fqn, (param, tensor, placements) in self._stepped.items():
            entry = opt.state.get(tensor)
            if not entry:
                continue
            state[fqn] = {name: self._global(value, tensor, param, placements)
                          for name, value in entry.items()}
        groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
        return {"state": state, "param_groups": groups}

    @staticmethod
    def _global(value: Any, tensor: torch.Tensor, param: Any, placements: Any) -> Any:
        if (placements is None or not isinstance(value, torch.Tensor)
                or value.shape != tensor.shape):
            return value
        return DTensor.from_local(value, param.device_mesh, placements, run_check=False,
                                  shape=param.shape, stride=param.stride())

    @torch.no_grad()
    def init_optimizer_state(self, opt: torch.optim.Optimizer) -> None:
        """Create ``opt``'s state (one step with zero gradients and a zero
        learning rate, which leaves the parameters as they are), so that a
        checkpoint can be loaded into :meth:`optimizer_state_dict` in place."""
        saved = [(g, g["lr"]) for g in opt.param_groups]
        for g, _ in saved:
            g["lr"] = 0.0
        for _, tensor, _ in self._stepped.values():
            tensor.grad = torch.zeros_like(tensor)
        opt.step()
        opt.zero_grad(set_to_none=True)
        for g, lr in saved:
            g["lr"] = lr

    def load_param_groups(self, opt: torch.optim.Optimizer, groups: Sequence[dict]) -> None:
        """Set ``opt``'s hyper-parameters (``lr``, betas, ...) from a saved
        :meth:`optimizer_state_dict`'s ``param_groups``."""
        if len(groups) != len(opt.param_groups):
            raise ValueError(f"the saved optimizer has {len(groups)} parameter groups, this one "
                             f"{len(opt.param_groups)}")
        for group, saved in zip(opt.param_groups, groups):
            group.update({k: v for k, v in saved.items() if k != "params"})

    # ---------------------------------------------------------------- export
    def full_tensors(self) -> Iterator[tuple[str, torch.Tensor | None]]:
        """(FQN, whole parameter) of every parameter of the plan, one at a time,
        in the master dtype (:meth:`state_dict`'s values): whole on rank 0 (on
        the CPU), None on the other ranks. A collective that every rank runs
        through to the end."""
        here = self._master_tensors()
        for fqn, (owner, shape, dtype) in self._parameter_owners().items():
            full = None
            if fqn in here:
                p = here[fqn]
                full = (p.full_tensor() if isinstance(p, DTensor) else p).detach().contiguous()
            if owner != 0:
                if self.rank != owner:
                    full = torch.empty(shape, dtype=dtype, device=self.device)
                dist.broadcast(full, src=owner)
            yield fqn, (full.cpu() if self.rank == 0 else None)

    def parameter_shapes(self) -> dict[str, list[int]]:
        """FQN -> global shape of every parameter of the plan, every stage's (a
        collective: every rank calls it)."""
        return {fqn: list(shape) for fqn, (_, shape, _) in self._parameter_owners().items()}

    def _parameter_owners(self) -> dict[str, tuple[int, list[int], torch.dtype]]:
        """Every parameter FQN of the plan -> (the lowest rank holding it, its
        global shape, dtype), the same on every rank (a collective)."""
        mine = {fqn: (list(p.shape), p.dtype) for fqn, p in self._master_tensors().items()}
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        owners: dict[str, tuple[int, list[int], torch.dtype]] = {}
        for rank, table in enumerate(every):
            for fqn, (shape, dtype) in table.items():
                owners.setdefault(fqn, (rank, shape, dtype))
        return owners


def parallelize(plan: Plan | str | os.PathLike, model: nn.Module | None = None,
                example_inputs: Any = None, *, init: str = "fresh",
                compile: bool | None = None) -> ParallelModel:
    """This rank's part of ``plan`` as a :class:`ParallelModel`.

    Call it in every rank of a ``torchrun`` job of ``plan.world_size``
    processes (it starts the default process group from torchrun's
    environment if none is started, and closes the group it started at
    interpreter exit).

    Args:
        plan: a Plan or a plan.json path.
        model, example_inputs: the model and inputs the plan was made for. By
            default the plan's model source is built on the meta device and each
            rank materialises only its shards. A model given on a real device
            (the same weights on every rank) is distributed as it is.
        init: for a model built on meta, ``"fresh"`` (exactly the weights one
            process building it with seed 0 gets) or ``"empty"`` (allocated,
            for a checkpoint to fill).
        compile: run the per-rank program through ``torch.compile`` (True),
            eager (False), or as the plan's ``training.compile`` says (None);
            :mod:`codegen.compiled_program`, and :meth:`ParallelModel.compile_regions`
            after the first step.

    Raises:
        ValueError: a plan this runtime cannot run (:func:`codegen.runnable.unrunnable_reason`).
        codegen.capture.PlanMismatchError: the model captures as another program than
            the plan's (or the world is of another size than the plan's).
        codegen.pipeline_validation.PipelinePlanError: a pipeline this runtime
            cannot run.
    """
    if init not in INITS:
        raise ValueError(f"init must be one of {', '.join(INITS)}, got {init!r}")
    if not isinstance(plan, Plan):
        plan = load_plan(plan)
    if compile is not None:
        plan = plan.with_compile(compile)
    reason = unrunnable_reason(plan)
    if reason:
        raise ValueError(f"this plan cannot run: {reason}")
    device = ensure_process_group(plan)
    if device.type == "cpu":
        keep_freed_host_memory()
    materialize = None
    if model is None:
        model, example_inputs, materialize = _build_on_meta(plan, device, init)
    elif any(p.is_meta for p in model.parameters()):
        raise ValueError("a model on the meta device has no values: let parallelize build the "
                         "plan's model itself (model=None)")
    example_inputs = _as_tuple(example_inputs)
    model.train()
    if plan.pipeline is not None:
        from codegen.pipeline import PipelineRuntime

        with during("building the plan's pipeline stages"):
            runtime = PipelineRuntime.build(plan, model, example_inputs, device,
                                            materialize=materialize)
        release_freed_memory(device)
        return ParallelModel(plan, device, example_inputs, pipeline=runtime)
    from torch.distributed.device_mesh import init_device_mesh

    from codegen.executor import PlanExecutor

    names = plan.mesh.get("axis_names")
    names = tuple(names) if names and len(names) == len(plan.mesh_shape) else None
    # the mesh's rank table is real even under a FakeTensorMode (a model's
    # memory counted on fake tensors: benchmarks/memory_fidelity.py)
    with outside_fake_mode():
        mesh = init_device_mesh(device.type, plan.mesh_shape, mesh_dim_names=names)
    with during("building the plan's model"):
        executor = PlanExecutor(plan, model, example_inputs, mesh, materialize=materialize)
    release_freed_memory(device)
    return ParallelModel(plan, device, example_inputs, executor=executor)
