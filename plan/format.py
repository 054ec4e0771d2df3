"""The Plan: what the planner decided, and its plan.json form.

A plan.json is meant to be read by people: parameters by FQN with one placement per
mesh axis ("R", "S(d)", "P"), the placement of every op's inputs and outputs, the
points where the plan reshards, and the predicted time (seconds) and memory (bytes)
per device. ``Plan.to_json()`` and ``load_plan()`` round-trip exactly, and the
same inputs always give the same bytes (no timestamps, no wall-clock times).
"""

from __future__ import annotations

import json
import os
import dataclasses
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, TypedDict

if TYPE_CHECKING:
    from ir.precision import Precision

FORMAT_VERSION = 3
# Versions this planner reads: 1 has no ``pipeline`` section (it means one stage);
# 1 and 2 record no training precision (they trained in the dtype they name).
READABLE_VERSIONS = (1, 2, 3)


class PlanError(ValueError):
    """A plan.json that cannot be used; the message says what is wrong and what to do."""


# plan.json ``model``: what the plan was made for. ``name``: the zoo name or
# file.py:factory, else the class name; ``source``: how `planner run` rebuilds
# the model (None: it cannot); ``class``: the model's class name;
# ``fingerprint``: ir.Graph.fingerprint of the captured program. (The
# functional form, because ``class`` is a keyword.)
ModelRecord = TypedDict("ModelRecord", {"name": str, "source": "str | None", "class": str,
                                        "fingerprint": str, "num_parameters": int})


class MemoryReport(TypedDict):
    """Bytes per device by kind (``params``, ``grads``, ``optimizer``,
    ``activations``, ``backward_transient``); ``total`` their sum (what the
    memory budget bounds) and ``peak`` the step's predicted peak."""

    total: int
    peak: int


class TrainingRecord(TypedDict, total=False):
    """plan.json ``training``: the step the prediction assumed."""

    dtype: str                 # compute dtype, e.g. "bfloat16"
    precision: str             # training precision (ir.precision), e.g. "bf16-mixed"
    reduce_dtype: str          # dtype gradients are reduced in, e.g. "float32"
    optimizer: str             # "adam", "adamw", "sgd_momentum" or "sgd"
    input_shapes: list[list[int] | None]   # of the whole-batch example inputs
    zoo_kwargs: dict[str, int]  # batch_size / seq_len a zoo model was built with
    microbatch_size: int       # pipelines and accumulation: sequences per micro-batch
    global_batch: int          # sequences per step
    manual: dict[str, Any]     # a Megatron baseline's configuration (Megatron's names)
    compile: bool              # the per-rank program runs through torch.compile (absent: eager)
    compile_collectives: dict[str, Any]  # compiled: collectives in the graphs and outside them


class PredictedStep(TypedDict, total=False):
    """plan.json ``predicted``: one training step on the cluster (seconds, bytes)."""

    step_time_s: float
    compute_s: float
    communication_s: float
    resharding_s: float
    host_s: float              # GPUs: the host's time to issue the step's ops (a lower bound)
    bubble_s: float            # pipelines: idle time of the schedule
    p2p_s: float               # pipelines: stage-to-stage sends
    grad_sync_s: float         # pipelines: once-per-step gradient reduction
    update_s: float            # pipelines: optimizer update and parameter casts
    accumulate_s: float        # pipelines: adding micro-batches' gradients, a step
    memory_bytes_per_device: MemoryReport


@dataclass
class SolverReport:
    """How the intra-op ILP was solved.

    ``objective_s`` and ``bound_s`` are in seconds; ``gap`` is relative
    ((objective - bound) / objective, 0 when proven optimal).
    """

    solver: str
    status: str
    objective_s: float
    bound_s: float
    gap: float
    time_limit_s: float
    num_variables: int = 0
    num_constraints: int = 0


@dataclass
class OpPlacement:
    """Placements of one op's tensor inputs (in argument order) and outputs."""

    op: str
    module: str
    inputs: list[list[str]]
    outputs: list[list[str]]


@dataclass
class Reshard:
    """A tensor moved between placements before ``node`` reads it from ``arg``."""

    node: str
    arg: str
    module: str
    src: list[str]
    dst: list[str]
    time_s: float


@dataclass
class StagePlan:
    """One pipeline stage: a contiguous range of layers on one sub-mesh.

    Attributes:
        index: global stage index in program order (0 .. number of stages - 1).
        pp_rank: the pipeline rank (row of the world mesh's ``pp`` axis) that runs
            it; with interleaved/V schedules a rank runs several stages.
        layers: module paths of the layers in the stage (``transformer.h.3``;
            ``""`` stands for the ops outside any block, e.g. embedding or head).
        nodes: names of the captured program's op nodes the stage runs, in
            program order.
        ranks: global ranks of the stage's sub-mesh, row-major in mesh order.
        inputs: boundary values the stage receives (captured node or user input
            names), in order, each with its placements on the stage mesh.
        outputs: values the stage sends on (or returns, for the last stage), in
            order, each with the placements it sends them in.
        checkpoint: module paths of the layers recomputed in backward.
        zero_stage: 0 (parameters as placed), 3 (parameters, gradients and
            optimizer states sharded by FSDP2 ``fully_shard`` over the stage's
            data-parallel axis ``zero_axis``, gradients reduce-scattered once
            per step), 2 (optimizer states and gradients sharded over
            ``zero_axis``, parameters not re-sharded between forward and
            backward: FSDP2 ``fully_shard(reshard_after_forward=False)``,
            which stores the master parameters sharded too, all-gathers them
            once per step and reduce-scatters the gradients once per step;
            with one FSDP2 unit per stage it runs and is priced as 3) or 1
            (optimizer states sharded over ``zero_axis``, parameters and
            gradients whole, gradients reduce-scattered and parameters
            all-gathered once per step: Megatron's distributed optimizer,
            run by :class:`codegen.zero1.ShardedStateOptimizer`).
        predicted: per micro-batch ``forward_s``, ``backward_input_s``,
            ``backward_weight_s``; per step ``grad_sync_s``, ``update_s``
            (optimizer update and parameter casts) and ``accumulate_s``
            (adding each micro-batch's gradients after the first); and
            ``memory_bytes_per_device`` (bytes, by kind).
    """

    index: int
    pp_rank: int
    layers: list[str]
    nodes: list[str]
    ranks: list[int]
    inputs: dict[str, list[str]]
    outputs: dict[str, list[str]]
    checkpoint: list[str] = field(default_factory=list)
    zero_stage: int = 0
    zero_axis: int | None = None
    predicted: dict[str, Any] = field(default_factory=dict)


@dataclass
class PipelinePlan:
    """How the step is pipelined.

    Attributes:
        schedule: canonical schedule name (costmodel.schedules.SCHEDULES:
            ``gpipe``, ``1f1b``, ``interleaved_1f1b``, ``interleaved_zero_bubble``,
            ``zbv``, ``dualpipev``, ...), run with torch.distributed.pipelining's class.
        num_microbatches: micro-batches per step; the global batch is split
            evenly along dim 0 of every user input.
        stages_per_rank: stages each pipeline rank runs (1, or 2+ for
            interleaved and V schedules).
        stages: every stage, by index.
        stage_mesh: ``shape`` and ``axis_names`` of every stage's sub-mesh (all
            stages have the same shape; the world mesh is ``[pp] + shape``).
    """

    schedule: str
    num_microbatches: int
    stages_per_rank: int
    stage_mesh: dict[str, Any]
    stages: list[StagePlan]

    @property
    def pp(self) -> int:
        return len(self.stages) // self.stages_per_rank

    @property
    def zero_stage(self) -> int:
        """The highest ZeRO stage of the stages (the planner gives them all one)."""
        return max(st.zero_stage for st in self.stages)


@dataclass
class Plan:
    """A complete parallelization plan for one model on one cluster.

    Attributes:
        model: what the plan was made for (:class:`ModelRecord`).
        cluster: the cluster spec (costmodel.Cluster.to_dict()).
        mesh: ``shape`` (list of ints) and ``axis_names``.
        parameters: parameter FQN -> placements (one string per mesh axis).
        inputs: user input name -> placements.
        nodes: op node name -> placements of its inputs and outputs.
        reshards: every point where a tensor changes placement, in program order.
        predicted: the step's seconds and bytes per device (:class:`PredictedStep`).
        solver: the ILP report.
        training: batch, precision and optimiser settings the prediction
            assumed (:class:`TrainingRecord`).
        checkpoint: module paths of the layers whose activations are recomputed
            in backward (activation checkpointing), in program order.
        pipeline: None for a single-stage plan. For a pipeline plan ``mesh`` is
            the world mesh ``[pp] + stage mesh`` (first axis named ``pp``), and
            the placements in ``parameters``/``inputs``/``nodes`` are on the
            mesh of the stage that owns the node (one string per stage-mesh axis).
    """

    model: ModelRecord
    cluster: dict[str, Any]
    mesh: dict[str, Any]
    parameters: dict[str, list[str]]
    inputs: dict[str, list[str]]
    nodes: dict[str, OpPlacement]
    reshards: list[Reshard]
    predicted: PredictedStep
    solver: SolverReport
    training: TrainingRecord = field(default_factory=dict)  # type: ignore[assignment]
    checkpoint: list[str] = field(default_factory=list)
    pipeline: PipelinePlan | None = None
    format_version: int = FORMAT_VERSION

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return tuple(int(d) for d in self.mesh["shape"])

    @property
    def precision(self) -> "Precision":
        """The training precision the plan was made for (``training.precision``;
        plans of format 1 and 2 trained in their ``training.dtype`` throughout)."""
        return training_precision(self.training)

    @property
    def compiles(self) -> bool:
        """Whether the per-rank program runs through ``torch.compile``
        (``training.compile``; absent in eager plans)."""
        return bool(self.training.get("compile", False))

    def with_compile(self, compile: bool) -> "Plan":
        """This plan with ``training.compile`` set to ``compile``, and which of
        its collectives then run in the compiled graphs
        (``training.compile_collectives``,
        :func:`plan.compiled_collectives.compiled_collectives`); both removed
        when False, as an eager plan records them."""
        from plan.compiled_collectives import compiled_collectives

        training = {k: v for k, v in self.training.items()
                    if k not in ("compile", "compile_collectives")}
        if compile:
            training["compile"] = True
            training["compile_collectives"] = compiled_collectives(self)
        return dataclasses.replace(self, training=training)

    @property
    def world_size(self) -> int:
        n = 1
        for d in self.mesh_shape:
            n *= d
        return n

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        ordered = {"format_version": d.pop("format_version")}
        ordered.update(d)
        return ordered

    def to_json(self) -> str:
        """The plan as JSON text; deterministic for equal plans."""
        return json.dumps(self.to_dict(), indent=1) + "\n"

    def save(self, path: str | os.PathLike) -> None:
        """Write plan.json; refuses to replace a file that is not a plan."""
        path = os.fspath(path)
        if os.path.exists(path) and not _is_plan_file(path):
            raise PlanError(
                f"{path} exists and is not a plan.json; choose another output path "
                f"or remove it yourself")
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            f.write(self.to_json())
        os.replace(tmp, path)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Plan":
        if not isinstance(d, dict):
            raise PlanError("plan.json must hold a JSON object; regenerate it with `planner plan`")
        version = d.get("format_version")
        if version not in READABLE_VERSIONS:
            raise PlanError(
                f"plan.json has format_version {version!r} but this planner reads versions "
                f"{', '.join(map(str, READABLE_VERSIONS))}; regenerate it with `planner plan`")
        required = ("model", "cluster", "mesh", "parameters", "inputs", "nodes",
                    "reshards", "predicted", "solver")
        missing = [k for k in required if k not in d]
        if missing:
            raise PlanError(f"plan.json lacks {', '.join(missing)}; regenerate it with `planner plan`")
        try:
            return cls(
                model=d["model"], cluster=d["cluster"], mesh=d["mesh"],
                parameters={k: list(v) for k, v in d["parameters"].items()},
                inputs={k: list(v) for k, v in d["inputs"].items()},
                nodes={k: OpPlacement(**v) for k, v in d["nodes"].items()},
                reshards=[Reshard(**r) for r in d["reshards"]],
                predicted=d["predicted"], solver=SolverReport(**d["solver"]),
                training=d.get("training", {}), checkpoint=list(d.get("checkpoint", [])),
                pipeline=_pipeline_from_dict(d.get("pipeline")),
                format_version=FORMAT_VERSION)
        except (TypeError, AttributeError) as err:
            raise PlanError(f"plan.json is malformed ({err}); regenerate it with `planner plan`") from err


def placement_error(plan: Plan) -> str | None:
    """What is wrong with the first placement of ``plan`` no reader can read
    (a string outside :mod:`ir.placements`' grammar, or not one per mesh
    axis), or None. ``planner show`` and ``planner run`` check it first."""
    from ir.placements import parse_planned  # torch's placement types: only when checked

    axes = len(plan.pipeline.stage_mesh["shape"]) if plan.pipeline else len(plan.mesh_shape)
    places = [(f"parameter {k}", v) for k, v in plan.parameters.items()]
    places += [(f"input {k}", v) for k, v in plan.inputs.items()]
    for name, op in plan.nodes.items():
        places += [(f"node {name}", v) for v in (*op.inputs, *op.outputs) if v is not None]
    for where, placements in places:
        if len(placements) != axes:
            return (f"{where} has {len(placements)} placements {placements} for a mesh of "
                    f"{axes} axes")
        for text in placements:
            try:
                parse_planned(text)
            except ValueError as err:
                return f"{where} has placement {text!r}: {err}"
    return None


def training_precision(training: dict[str, Any]) -> "Precision":
    """The precision a plan's ``training`` section records (plans of format 1
    and 2 name only the dtype, which they trained in throughout)."""
    from ir.precision import get_precision

    return get_precision(training.get("precision") or training.get("dtype", "float32"),
                         training.get("reduce_dtype"))


def _pipeline_from_dict(d: dict[str, Any] | None) -> PipelinePlan | None:
    if d is None:
        return None
    stages = [StagePlan(**{**st, "inputs": {k: list(v) for k, v in st["inputs"].items()},
                           "outputs": {k: list(v) for k, v in st["outputs"].items()}})
              for st in d["stages"]]
    return PipelinePlan(schedule=d["schedule"], num_microbatches=int(d["num_microbatches"]),
                        stages_per_rank=int(d["stages_per_rank"]), stage_mesh=d["stage_mesh"],
                        stages=stages)


def _is_plan_file(path: str) -> bool:
    try:
        with open(path) as f:
            data = json.load(f)
        return isinstance(data, dict) and "format_version" in data
    except (OSError, ValueError):
        return False


def load_plan(path: str | os.PathLike) -> Plan:
    """Read and validate a plan.json written by :meth:`Plan.save`."""
    path = os.fspath(path)
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise PlanError(f"no plan file at {path}; create one with `planner plan ... -o {path}`") from None
    except json.JSONDecodeError as err:
        raise PlanError(f"{path} is not valid JSON ({err.msg} at line {err.lineno})") from None
    return Plan.from_dict(data)
