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

from costmodel.cluster import Cluster, ClusterError, check_mesh_shape
from costmodel.memory import reserve_bytes
from ir.precision import Precision, get_precision, precision_of_dtype

__all__ = ["MEMORY_MODEL_ERROR", "MEMORY_RESERVE", "PlanRequest", "PlanningError", "check_mesh",
           "default_memory_budget", "default_precision", "mesh_candidates",
           "resolve_precision"]

# Fraction of device memory kept free for the allocator's fragmentation and workspaces.
MEMORY_RESERVE = 0.1
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
        pp, schedules, num_microbatches: restrict the pipeline search.
        zero_stages: ZeRO stages of pipeline stages to try: 0 (none), 1
            (optimizer states sharded over the stage mesh's first axis), 2
            (FSDP2 over it without resharding after forward: optimizer states
            and gradients sharded), 3 (FSDP2, parameters sharded too); None:
            all four (which of them the search prices:
            :func:`planner.search.pipeline_search.zero_stages_priced`).
        precision: a training precision name (:mod:`ir.precision`) or a
            :class:`Precision`; None: :func:`default_precision`.
        recompute: None: the search checkpoints where that is fastest; True:
            every layer; False: none (needs ``mesh_shape`` or ``pipeline=False``).
        context_parallel: context-parallel sizes (cp) to search, e.g. ``(1, 2, 4)``
            (powers of two dividing the devices whose 2 cp chunks cut the
            sequence; 1 = without); None: automatic
            (:func:`planner.search.cp_search.search_sizes`: cp > 1 at sequences
            of at least 32,768 tokens, or where no plan without it fits).
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

    @property
    def single_stage(self) -> bool:
        """Only single-stage plans are searched (a mesh given, or no pipeline)."""
        return bool(self.mesh_shape) or not self.pipeline


def mesh_candidates(num_devices: int) -> list[tuple[int, ...]]:
    """Logical mesh shapes tried when the user gives none: (N,) and every (a, N/a)."""
    shapes: list[tuple[int, ...]] = [(num_devices,)]
    for a in range(2, num_devices):
        if num_devices % a == 0:
            shapes.append((a, num_devices // a))
    return shapes


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
    return float(cluster.device.memory - reserve_bytes(cluster.device.memory, MEMORY_RESERVE))
