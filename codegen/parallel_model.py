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

import atexit
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate

from codegen.capture import PlanMismatchError
from codegen.reference import loss_of
from codegen.runnable import unrunnable_reason
from codegen.zero1 import StateShards
from plan.format import Plan, load_plan

__all__ = ["BatchShapeError", "InputSpec", "ParallelModel", "backward_to_placements",
           "check_batch", "parallelize", "peak_memory", "resident_bytes", "runtime_device"]

#: How the parameters get their first values: ``"fresh"`` (the model's own
#: initialisation, exactly as one process builds it) or ``"empty"`` (allocated
#: only, for a checkpoint to fill). Buffers are always the model's own.
INITS = ("fresh", "empty")


class BatchShapeError(ValueError):
    """A batch that is not of the shapes and dtypes the plan was made for."""


def runtime_device(cluster: dict[str, Any], local_rank: int) -> tuple[str, torch.device]:
    """The process-group backend and the device this rank trains on, as the
    plan's ``cluster`` says: a gloo cluster (CPU ranks) runs on the CPU even where
    CUDA is present; an NCCL one on GPU ``local_rank``, or on the CPU with gloo
    where this machine has no CUDA (the launcher says so before it starts).

    Raises:
        ValueError: an NCCL plan on a machine with fewer CUDA devices than the
            ranks started on it.
    """
    if cluster.get("backend") == "gloo" or not torch.cuda.is_available():
        return "gloo", torch.device("cpu")
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise ValueError(
            f"the plan is for {cluster.get('name', 'a GPU cluster')} (one GPU a rank), but this "
            f"machine has {count} CUDA device(s) for local rank {local_rank}; start at most "
            f"{count} rank(s) per node, or plan for a CPU cluster (local-cpu:N)")
    return "nccl", torch.device("cuda", local_rank)


def _ensure_process_group(plan: Plan) -> torch.device:
    """This rank's device; the default process group, started from torchrun's
    environment where none is yet. Refuses a world of another size than the plan's."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    backend, device = runtime_device(plan.cluster, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            raise RuntimeError(f"parallelize needs torchrun's environment: start the script with "
                               f"torchrun --nproc_per_node {plan.world_size}")
        dist.init_process_group(backend, **_restart_store())
        atexit.register(_close_process_group)
    if dist.get_world_size() != plan.world_size:
        raise PlanMismatchError(f"the plan is for {plan.world_size} devices (mesh "
                                f"{list(plan.mesh_shape)}) but {dist.get_world_size()} ranks run")
    return device


def _close_process_group() -> None:
    """At interpreter exit, close the process group :func:`parallelize` started.

    Left to interpreter finalization, gloo's worker threads can still hold
    work whose tensors need the GIL of an interpreter being torn down, and the
    rank aborts (SIGABRT) after its last step. No barrier first: a rank leaving
    on an error must not wait for peers blocked in a collective with it."""
    if dist.is_initialized():
        dist.destroy_process_group()


def _restart_store() -> dict[str, Any]:
    """``init_process_group`` arguments for ranks torchrun restarted after a
    failure: its agent's store under a prefix of their own attempt, since the
    store still holds the addresses the failed attempt's ranks published (gloo
    would connect to those dead ranks). Nothing for a first attempt."""
    from datetime import timedelta

    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if attempt == 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=timedelta(minutes=10))
    return {"store": dist.PrefixStore(f"attempt_{attempt}", store),
            "rank": int(os.environ["RANK"]), "world_size": int(os.environ["WORLD_SIZE"])}


def _as_tuple(inputs: Any) -> tuple:
    return tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)


def _build_on_meta(plan: Plan, device: torch.device, init: str) -> tuple[nn.Module, tuple, Any]:
    """The plan's model and example inputs on meta, and how to give a state
    tensor its whole value on ``device`` (:data:`INITS`)."""
    from codegen.deferred_init import record_build
    from codegen.reference import zoo_kwargs
    from models.source import build_model

    def build() -> tuple[nn.Module, tuple]:
        return build_model(plan.model["source"], device="meta", seed=0,
                           **zoo_kwargs(plan.training))

    (model, inputs), record = record_build(build, device)
    release_freed_memory(device)
    parameters = {id(p) for p in model.parameters()}

    def materialize(fqn: str, t: torch.Tensor) -> torch.Tensor:
        # buffers (rotary frequencies, masks) are the model's own either way: a
        # checkpoint holds the parameters
        if init == "empty" and id(t) in parameters:
            return torch.empty(t.shape, dtype=t.dtype, device=device)
        return record.materialize(t)

    return model, inputs, materialize


#: Host allocations of at least this many bytes get a mapping of their own (CPU ranks).
_OWN_MAPPING_BYTES = 1 << 20
#: glibc's mallopt parameter for that threshold
_M_MMAP_THRESHOLD = -3


def _libc() -> Any:
    """The C library, where it is glibc (``malloc_trim`` and ``mallopt``), else None."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "malloc_trim") else None


def return_freed_host_memory() -> None:
    """Make this CPU rank give freed tensors back to the system: glibc maps
    every allocation of 1 MiB or more on its own (its default threshold grows
    to 32 MiB and the heap keeps what is freed below it, 0.3-1 GiB a rank of a
    1.3B model). So a rank's resident set follows its live tensors, as CUDA's
    peak allocation does. Nothing where the C library is not glibc."""
    libc = _libc()
    if libc is not None:
        libc.mallopt(_M_MMAP_THRESHOLD, _OWN_MAPPING_BYTES)


def release_freed_memory(device: torch.device) -> None:
    """Give memory that was freed back to the system: on CPU ranks glibc's
    heap (``malloc_trim``), on CUDA the caching allocator's unused blocks."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        return
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


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
    from codegen.redistribution import redistribute

    mesh = executor.mesh
    if isinstance(loss, DTensor) and any(not p.is_replicate() for p in loss.placements):
        loss = loss.redistribute(mesh, [Replicate()] * mesh.ndim)
    loss.backward()
    moved = 0
    for p in executor.parameters():
        if isinstance(p.grad, DTensor) and tuple(p.grad.placements) != tuple(p.placements):
            p.grad = redistribute(p.grad, mesh, p.placements)
            moved += 1
    local = loss.to_local() if isinstance(loss, DTensor) else loss
    return local.detach(), moved


def resident_bytes() -> int:
    """This process's resident memory now, in bytes (Linux ``/proc/self/statm``)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_memory(device: torch.device) -> tuple[int, str]:
    """This process's peak memory on ``device``, in bytes, and what it is: CUDA's
    peak allocation, or on CPU ranks the process's peak resident set
    (``ru_maxrss``, KiB on Linux)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device)), "cuda_max_allocated"
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024, "cpu_peak_rss"


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
        loss, _ = backward_to_placements(self._executor, loss_of(self._executor(*batch)))
        return loss

    def _pipeline_step(self, batch: tuple) -> torch.Tensor:
        runtime = self._pipeline
        losses = runtime.step(batch)
        runtime.sync_grads()
        for shards in self._zero1:
            shards.reduce_grads()
        value = torch.zeros((), dtype=torch.float64, device=self.device)
        if losses:
            value += torch.stack([x.detach().double() for x in losses]).mean()
        dist.broadcast(value, src=self._last_stage_rank())
        return value

    def _last_stage_rank(self) -> int:
        """The global rank of the first device of the last stage's mesh."""
        pipe = self.plan.pipeline
        last = pipe.stages[-1].pp_rank
        return int(self._pipeline.world_mesh.mesh[last].flatten()[0])

    # ----------------------------------------------------- optimizer, clipping
    def optimizer(self, optimizer_class: Callable[..., torch.optim.Optimizer],
                  **kwargs: Any) -> torch.optim.Optimizer:
        """torch's ``optimizer_class(tensors, **kwargs)`` over what this rank
        updates: its parameters, and for ZeRO-1 stages its slices of them (the
        fp32 master slices under a mixed precision; after each ``step`` the
        updated slices are cast to the compute dtype and all-gathered into the
        parameters forward reads). It is a plain torch
        optimizer, so torch's LR schedulers drive it."""
        tensors = [tensor for _, tensor, _ in self._stepped.values()]
        opt = optimizer_class(tensors, **kwargs)
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
                example_inputs: Any = None, *, init: str = "fresh") -> ParallelModel:
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

    Raises:
        ValueError: a plan this runtime cannot run (:func:`codegen.runnable.unrunnable_reason`).
        PlanMismatchError: the model captures as another program than the plan's.
        codegen.pipeline_validation.PipelinePlanError: a pipeline this runtime
            cannot run.
    """
    if init not in INITS:
        raise ValueError(f"init must be one of {', '.join(INITS)}, got {init!r}")
    if not isinstance(plan, Plan):
        plan = load_plan(plan)
    reason = unrunnable_reason(plan)
    if reason:
        raise ValueError(f"this plan cannot run: {reason}")
    device = _ensure_process_group(plan)
    if device.type == "cpu":
        return_freed_host_memory()
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

        runtime = PipelineRuntime.build(plan, model, example_inputs, device,
                                        materialize=materialize)
        release_freed_memory(device)
        return ParallelModel(plan, device, example_inputs, pipeline=runtime)
    from torch.distributed.device_mesh import init_device_mesh

    from codegen.executor import PlanExecutor

    names = plan.mesh.get("axis_names")
    names = tuple(names) if names and len(names) == len(plan.mesh_shape) else None
    mesh = init_device_mesh(device.type, plan.mesh_shape, mesh_dim_names=names)
    executor = PlanExecutor(plan, model, example_inputs, mesh, materialize=materialize)
    release_freed_memory(device)
    return ParallelModel(plan, device, example_inputs, executor=executor)
