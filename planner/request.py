"""What a planning request asks for, checked and resolved before any search.

:class:`PlanRequest` carries every setting of :func:`planner.api.plan` other
than the model, its example inputs and the cluster, from the command line (or
a caller) to the search. The functions beside it resolve a request's defaults
(precision, memory budget, mesh shapes) and refuse what cannot be planned with
a :class:`PlanningError` that says what to change.

Units: bytes, seconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from costmodel.cluster import Cluster, ClusterError, candidate_mesh_shapes, check_mesh_shape
from costmodel.memory import MEMORY_RESERVE, usable_memory
from costmodel.presets import load_cluster
from costmodel.strategy_cost import ZERO_STAGES
from ir.precision import Precision, get_precision, precision_of_dtype

__all__ = ["MEMORY_MODEL_ERROR", "MEMORY_RESERVE", "ClusterSettings", "PlanRequest",
           "PlanningError", "check_mesh", "check_zero_stages", "default_memory_budget",
           "default_precision", "resolve_on_cluster", "resolve_precision"]

#: The memory model's stated error: a predicted peak within this fraction of the
#: budget may exceed it when run. It is the band `benchmarks/memory_fidelity.py`
#: holds the prediction to, against torch's own count of the same step (CPU,
#: FakeTensorMode and one GPU: ``benchmarks/results/memory_fidelity*.json``).
MEMORY_MODEL_ERROR = 0.05


class PlanningError(ValueError):
    """The request cannot be planned; the message says what to change."""


@dataclass(frozen=True)
class PlanRequest:
    """The settings of one planning request (every field optional).

    Attributes:
        mesh_shape: plan one stage on exactly this logical mesh, e.g. ``(2, 2)``
            (no pipeline).
        model_source: how ``planner run`` rebuilds the model (zoo name or
            ``file.py:factory``); recorded in the plan.
        time_limit_s: limit of each ILP solve, seconds.
        optimizer: ``adam``, ``adamw``, ``sgd_momentum`` or ``sgd``.
        memory_budget: bytes per device a plan may use; None: the device's
            memory less :data:`MEMORY_RESERVE`.
        zoo_kwargs: batch_size / seq_len a zoo model was built with (recorded
            so that the runner builds the same shapes).
        pipeline: also search pipeline plans (ignored with ``mesh_shape``).
        pp, schedules, num_microbatches: restrict the pipeline search. A
            single stage (``mesh_shape``, or ``pipeline=False``) takes pp 1
            only and no schedules; its ``num_microbatches`` > 1 accumulate
            its gradients (:mod:`planner.search.single_stage`).
        zero_stages: ZeRO stages of pipeline stages to try: 0 (none), 1
            (optimizer states sharded over the stage mesh's first axis), 2
            (FSDP2 over it without resharding after forward: optimizer states
            and gradients sharded), 3 (FSDP2, parameters sharded too); None:
            all four (which of them the search prices:
            :func:`planner.search.pipeline_search.zero_stages_priced`). A
            single stage shards over its mesh's first axis; None there: 0.
        precision: a training precision name (:mod:`ir.precision`) or a
            :class:`Precision`; None: :func:`default_precision`.
        recompute: None: the search checkpoints where that is fastest; True:
            every layer; False: none (needs ``mesh_shape`` or ``pipeline=False``).
        context_parallel: context-parallel sizes (cp) to search, e.g. ``(1, 2, 4)``
            (powers of two dividing the devices whose 2 cp chunks cut the
            sequence; 1 = without); None: automatic
            (:func:`planner.search.cp_search.search_sizes`: cp > 1 at sequences
            of at least 32,768 tokens, or where no plan without it fits).
        compile: the plan's per-rank program runs through ``torch.compile``
            (recorded as ``training.compile``), and the search prices it so:
            memory-bound chains fused, no per-op dispatch (:mod:`costmodel.fusion`).
    """

    mesh_shape: tuple[int, ...] | None = None
    model_source: str | None = None
    time_limit_s: float = 30.0
    optimizer: str = "adam"
    memory_budget: float | None = None
    zoo_kwargs: dict[str, Any] = field(default_factory=dict)
    pipeline: bool = True
    pp: tuple[int, ...] | None = None
    schedules: tuple[str, ...] | None = None
    num_microbatches: tuple[int, ...] | None = None
    zero_stages: tuple[int, ...] | None = None
    precision: str | Precision | None = None
    recompute: bool | None = None
    context_parallel: tuple[int, ...] | None = None
    compile: bool = False

    def __post_init__(self) -> None:
        for name in ("mesh_shape", "pp", "schedules", "num_microbatches", "zero_stages",
                     "context_parallel"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, tuple):
                object.__setattr__(self, name, tuple(value))
        object.__setattr__(self, "zoo_kwargs", dict(self.zoo_kwargs or {}))
        if self.recompute is not None and not self.mesh_shape and self.pipeline:
            raise PlanningError("recompute= pins checkpointing of single-stage plans: give "
                                "mesh_shape or pipeline=False with it")
        cps = self.context_parallel
        if cps is not None and (not cps or any(isinstance(c, bool) or not isinstance(c, int)
                                               or c < 1 for c in cps)):
            raise PlanningError(f"context parallel sizes must be integers >= 1, got {list(cps)}")
        if cps is not None and max(cps) > 1 and self.single_stage:
            raise PlanningError("context parallelism is searched with the pipeline search: "
                                "leave out the mesh (--mesh) and --no-pipeline to plan it")
        check_zero_stages(self.zero_stages)
        if self.single_stage:
            _check_single_stage(self)

    @property
    def single_stage(self) -> bool:
        """Only single-stage plans are searched (a mesh given, or no pipeline)."""
        return bool(self.mesh_shape) or not self.pipeline


def check_zero_stages(zero_stages: Sequence[int] | None) -> list[int] | None:
    """``zero_stages`` as a list, or None (the search's default).

    Raises:
        PlanningError: an empty list, or a stage other than 0, 1, 2 or 3.
    """
    if zero_stages is None:
        return None
    out = [int(z) for z in zero_stages]
    if not out or any(z not in ZERO_STAGES for z in out):
        raise PlanningError(f"ZeRO stages must be 0 (none), 1 (sharded optimizer states), "
                            f"2 or 3 (FSDP2), got {list(zero_stages)}")
    return out


def _check_single_stage(req: PlanRequest) -> None:
    """Refuse what a single-stage request (a mesh given, or no pipeline) asks
    for and one stage cannot do, before any capture or search: a pipeline
    (pp > 1), a pipeline schedule, or ZeRO alone on a mesh whose first axis
    (the one ZeRO shards over) has one rank. Micro-batches (gradients
    accumulated) and ZeRO over the mesh's first axis are planned
    (:mod:`planner.search.single_stage`); ``recompute`` too."""
    if req.mesh_shape:
        mesh = "x".join(map(str, req.mesh_shape))
        what, leave = (f"the mesh given (--mesh {mesh}) plans one stage on exactly that mesh",
                       "leave out --mesh")
    else:
        what, leave = ("--no-pipeline (pipeline=False) plans one stage",
                       "leave out --no-pipeline")
    if req.pp is not None and any(p != 1 for p in req.pp):
        pp = ",".join(map(str, req.pp))
        raise PlanningError(f"--pp {pp} asks for a pipeline, but {what}: {leave} to search "
                            f"pipelines of pp {pp}, or leave out --pp")
    if req.schedules is not None:
        raise PlanningError(f"--schedule orders the stages of a pipeline, but {what} (its "
                            f"--microbatches, if given, accumulate gradients, with no schedule "
                            f"to choose): leave out --schedule, or {leave} to search pipelines")
    zeros = req.zero_stages
    if req.mesh_shape and req.mesh_shape[0] == 1 and zeros is not None and 0 not in zeros:
        flip = "x".join(map(str, req.mesh_shape[::-1]))
        fix = (f"give the data-parallel axis first (--mesh {flip})"
               if len(req.mesh_shape) > 1 and flip != mesh else "give a mesh of more devices")
        raise PlanningError(f"ZeRO shards over the mesh's first axis, which has 1 rank in mesh "
                            f"{mesh}: {fix}, or leave out --zero")


def check_mesh(mesh_shape: Sequence[int], cluster: Cluster | None = None) -> tuple[int, ...]:
    """:func:`costmodel.cluster.check_mesh_shape` as a :class:`PlanningError`:
    positive integer sizes whose product, given ``cluster``, is its device count."""
    try:
        return check_mesh_shape(mesh_shape, cluster)
    except ClusterError as err:
        raise PlanningError(str(err)) from None


def default_precision(model: torch.nn.Module, cluster: Cluster) -> Precision:
    """The precision a step trains in when nobody names one: ``bf16-mixed`` on
    GPU clusters (what Megatron-LM and torchtitan run), ``fp16-mixed`` on GPUs
    without bf16 units (V100); on CPU ranks (gloo) the model's own dtype
    (``fp32``, or ``bf16`` for a model in bf16)."""
    if cluster.backend != "gloo":
        bf16 = "bfloat16" in cluster.device.peak_flops
        return get_precision("bf16-mixed" if bf16 else "fp16-mixed")
    dtypes = [p.dtype for p in model.parameters() if p.is_floating_point()]
    return precision_of_dtype(dtypes[0] if dtypes else torch.float32)


def resolve_precision(model: torch.nn.Module, cluster: Cluster,
                      precision: str | Precision | None) -> Precision:
    """``precision`` as a :class:`Precision` (its default when None).

    Raises:
        PlanningError: an unknown name, or fp32/bf16-mixed master weights asked of a
            model whose parameters are bf16 (their fp32 values are gone).
    """
    if precision is None:
        return default_precision(model, cluster)
    try:
        chosen = get_precision(precision)
    except ValueError as err:
        raise PlanningError(str(err)) from None
    half = next((p.dtype for p in model.parameters()
                 if p.dtype in (torch.bfloat16, torch.float16)), None)
    if chosen.master_dtype == torch.float32 and half is not None:
        name = "bf16" if half == torch.bfloat16 else "fp16"
        raise PlanningError(f"precision {chosen.name} keeps fp32 master parameters but the "
                            f"model's parameters are {name}; give the fp32 model"
                            + (", or plan with precision='bf16'" if name == "bf16" else ""))
    return chosen


def default_memory_budget(cluster: Cluster) -> float:
    """Bytes per device a plan may use: device memory less the allocator reserve."""
    return usable_memory(cluster.device.memory)


@dataclass(frozen=True)
class ClusterSettings:
    """A request's cluster and what its defaults resolve to there.

    Attributes:
        cluster: the cluster planned for.
        precision: the step's precision (the request's, or the cluster's default).
        memory_budget: bytes per device a plan may use.
        mesh_shapes: the logical meshes a single-stage plan is tried on: the
            requested one (checked against the cluster) or every candidate.
    """

    cluster: Cluster
    precision: Precision
    memory_budget: float
    mesh_shapes: tuple[tuple[int, ...], ...]


def resolve_on_cluster(cluster: Cluster | str, model: torch.nn.Module, *,
                       precision: str | Precision | None, memory_budget: float | None,
                       mesh_shape: Sequence[int] | None = None,
                       compiled: bool = False) -> ClusterSettings:
    """Load ``cluster`` (a Cluster, a preset spec or a cluster JSON path) and
    resolve the request's precision, memory budget (bytes per device; None:
    :func:`default_memory_budget`) and meshes on it, before any capture.
    ``compiled``: the program runs through ``torch.compile``, and the cluster
    returned prices it so (:meth:`costmodel.cluster.Cluster.running_compiled`).

    Raises:
        PlanningError: a mesh that does not fit the cluster, or a precision the
            model cannot train in (:func:`resolve_precision`).
    """
    if isinstance(cluster, str):
        cluster = load_cluster(cluster)
    cluster = cluster.running_compiled(compiled)
    budget = usable_memory(cluster.device.memory) if memory_budget is None else memory_budget
    try:
        shapes = ((check_mesh_shape(mesh_shape, cluster),) if mesh_shape
                  else tuple(candidate_mesh_shapes(cluster.num_devices)))
    except ClusterError as err:
        raise PlanningError(str(err)) from None
    return ClusterSettings(cluster, resolve_precision(model, cluster, precision), float(budget),
                           shapes)
