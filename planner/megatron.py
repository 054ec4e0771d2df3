"""Megatron-LM style manual plans, in the same Plan format as the automatic ones.

A Megatron practitioner fixes the parameter layout: inside each transformer layer
the linears that open a branch are column parallel (weight ``[out, in]`` sharded
on ``out``: ``S(0)``) and the ones that close it into the residual stream are row
parallel (``S(1)``); the token embedding and the output head are vocabulary
parallel; everything is replicated over the data-parallel axis, whose optimizer
states the distributed optimizer (ZeRO-1) shards. :func:`megatron_plan` fixes
exactly that layout and lets the intra-op ILP place the activations, so the
manual plan is priced by the same cost model and run by the same code generator.
Arguments use Megatron's names.

With ``pipeline_model_parallel_size`` > 1 the layers are split evenly over the
pipeline stages (Megatron's uniform split) and run by 1F1B, or interleaved 1F1B
with ``virtual_pipeline_model_parallel_size``, each stage on a (dp, tp) sub-mesh
with the same layout fixed.

With ``sequence_parallel`` the activations between the tensor-parallel
blocks (the residual stream and the layer-norm outputs, [batch, seq, hidden])
are also fixed, split on the sequence dimension over the tp axis (and on the
batch over dp); the ILP then prices the reduce-scatter that replaces the
row-parallel all-reduce and the all-gather before each column-parallel block,
and the activation memory those regions no longer replicate.

``recompute_granularity="full"`` (Megatron's ``--recompute-granularity full``
with one layer per checkpoint) checkpoints every transformer layer; without
it the intra-op ILP decides per layer kind whether to checkpoint, under the
memory budget. ``decoder_first_pipeline_num_layers`` and
``decoder_last_pipeline_num_layers`` give the first and last pipeline stages
their own layer counts, the others splitting the rest evenly.

Gradients: with the distributed optimizer they are reduce-scattered once per
step (ZeRO-1); without it Megatron's DDP accumulates them over the
micro-batches and all-reduces them once per step.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Sequence

import torch
from torch.distributed.tensor.placement_types import Placement, Replicate, Shard

from costmodel.cluster import Cluster, load_cluster
from ir.graph import INPUT, OP, PARAM, Graph
from ir.layers import block_count, manual_bounds
from ir.precision import compute_copy
from ir.trace import trace
from planner.api import (PlanningError, build_plan, default_memory_budget, model_record,
                         resolve_precision, training_record)
from planner.intra_op import FixedPlacementError, MemoryInfeasibleError, solve_intra_op
from planner.plan_format import Plan

_MATMULS = {"aten.mm.default", "aten.addmm.default"}
_PAD_HINT = (" (Megatron pads the vocabulary to a multiple of 128 x tp: "
             "--make-vocab-size-divisible-by)")
_SEQ_DIM = 1  # of the [batch, seq, hidden] activations sequence parallelism splits


class MegatronDoesNotFit(PlanningError):
    """A Megatron configuration that divides the model but does not fit in memory."""


@dataclass(frozen=True)
class MegatronConfig:
    """A Megatron-LM parallel configuration, with Megatron's argument names.

    ``micro_batch_size`` is per data-parallel rank, as in Megatron; a pipeline
    runs ``global_batch / (micro_batch_size * data_parallel_size)`` micro-batches
    (in the Plan one micro-batch is split over the stage's data-parallel axis).
    None means the whole local batch in one micro-batch. Without a pipeline,
    more than one micro-batch is gradient accumulation (a one-stage 1F1B).
    ``virtual_pipeline_model_parallel_size`` (None, or v >= 2 model chunks per
    pipeline rank) selects the interleaved 1F1B schedule.
    ``sequence_parallel`` (Megatron's ``--sequence-parallel``, needs tp > 1)
    splits the activations between the tensor-parallel blocks on the sequence
    dimension over the tp axis. ``recompute_granularity``: None (the ILP
    decides) or ``"full"`` (every layer recomputed in backward).
    ``decoder_first_pipeline_num_layers`` / ``decoder_last_pipeline_num_layers``
    (pp > 1, no virtual stages): layers of the first / last stage.
    """

    tensor_model_parallel_size: int
    data_parallel_size: int
    use_distributed_optimizer: bool = True
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int | None = None
    micro_batch_size: int | None = None
    sequence_parallel: bool = False
    recompute_granularity: str | None = None
    decoder_first_pipeline_num_layers: int | None = None
    decoder_last_pipeline_num_layers: int | None = None

    def __post_init__(self) -> None:
        for name in ("tensor_model_parallel_size", "data_parallel_size",
                     "pipeline_model_parallel_size"):
            if int(getattr(self, name)) < 1:
                raise PlanningError(f"{name} must be at least 1, got {getattr(self, name)}")
        v = self.virtual_pipeline_model_parallel_size
        if v is not None and (v < 2 or self.pipeline_model_parallel_size < 2):
            raise PlanningError(
                f"virtual_pipeline_model_parallel_size={v} needs v >= 2 and "
                f"pipeline_model_parallel_size >= 2 (got {self.pipeline_model_parallel_size})")
        if self.micro_batch_size is not None and self.micro_batch_size < 1:
            raise PlanningError(f"micro_batch_size must be at least 1, got {self.micro_batch_size}")
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            raise PlanningError("sequence_parallel splits the tensor-parallel group's activations: "
                                "it needs tensor_model_parallel_size > 1")
        if self.recompute_granularity not in (None, "full"):
            raise PlanningError(f"recompute_granularity={self.recompute_granularity!r} is not "
                                f"modelled; use 'full' or None (the planner decides)")
        for name in ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers"):
            n = getattr(self, name)
            if n is None:
                continue
            if self.pipeline_model_parallel_size < 2 or v is not None:
                raise PlanningError(f"{name} needs pipeline_model_parallel_size >= 2 and no "
                                    f"virtual pipeline stages")
            if n < 1:
                raise PlanningError(f"{name} must be at least 1, got {n}")

    @property
    def recompute(self) -> bool | None:
        """The intra-op solver's ``recompute``: True under full recomputation,
        None (its own choice) otherwise."""
        return True if self.recompute_granularity == "full" else None

    @property
    def tp(self) -> int:
        return self.tensor_model_parallel_size

    @property
    def dp(self) -> int:
        return self.data_parallel_size

    @property
    def pp(self) -> int:
        return self.pipeline_model_parallel_size

    @property
    def stages_per_rank(self) -> int:
        return self.virtual_pipeline_model_parallel_size or 1

    @property
    def world_size(self) -> int:
        return self.tp * self.dp * self.pp

    @property
    def schedule(self) -> str:
        """The pipeline schedule Megatron runs (1F1B of one stage without a
        pipeline: gradient accumulation when there are several micro-batches)."""
        return "interleaved_1f1b" if self.virtual_pipeline_model_parallel_size else "1f1b"

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """Mesh of one stage: (data parallel, tensor parallel), size-1 axes dropped
        (at least one axis)."""
        shape = tuple(d for d in (self.data_parallel_size, self.tensor_model_parallel_size) if d > 1)
        return shape or (1,)

    def num_microbatches(self, global_batch: int) -> int:
        """Micro-batches per step: ``global_batch / (micro_batch_size * dp)``.

        Raises:
            PlanningError: the sizes do not divide the batch.
        """
        mbs = self.micro_batch_size
        if mbs is None:
            if global_batch % self.dp:
                raise PlanningError(f"{self.label()}: dp={self.dp} does not divide the batch "
                                    f"of {global_batch}")
            return 1
        if global_batch % (mbs * self.dp):
            raise PlanningError(f"{self.label()}: micro_batch_size x dp = {mbs * self.dp} does "
                                f"not divide the batch of {global_batch}")
        m = global_batch // (mbs * self.dp)
        if self.virtual_pipeline_model_parallel_size and m % self.pp:
            raise PlanningError(f"{self.label()}: the interleaved schedule needs the "
                                f"{m} micro-batches to be a multiple of pp={self.pp}")
        return m

    def layer_split(self, num_layers: int) -> list[int]:
        """Layers of each of the pp x vpp model chunks, in pipeline order:
        Megatron's even split, or the first and last stages' given counts and
        the rest even.

        Raises:
            PlanningError: the layers do not split that way.
        """
        chunks = self.pp * self.stages_per_rank
        first, last = self.decoder_first_pipeline_num_layers, self.decoder_last_pipeline_num_layers
        ends = [n for n in (first, last) if n is not None]
        middle, rest = chunks - len(ends), num_layers - sum(ends)
        if rest < middle or (middle and rest % middle) or (not middle and rest):
            raise PlanningError(f"{self.label()}: {num_layers} layers do not split evenly into "
                                f"{chunks} pipeline stages"
                                + (f" with {sum(ends)} on the first and last" if ends else ""))
        even = [rest // middle] * middle if middle else []
        return ([first] if first is not None else []) + even + (
            [last] if last is not None else [])

    def label(self) -> str:
        """Megatron terms, e.g. ``tp=2 pp=4 dp=8 mbs=1 vpp=2 sp``."""
        out = f"tp={self.tp} pp={self.pp} dp={self.dp}"
        if self.micro_batch_size is not None:
            out += f" mbs={self.micro_batch_size}"
        if self.virtual_pipeline_model_parallel_size:
            out += f" vpp={self.virtual_pipeline_model_parallel_size}"
        if self.sequence_parallel:
            out += " sp"
        if not self.use_distributed_optimizer and self.dp > 1:
            out += " no-dist-opt"
        if self.recompute_granularity:
            out += f" recompute={self.recompute_granularity}"
        first, last = self.decoder_first_pipeline_num_layers, self.decoder_last_pipeline_num_layers
        if first is not None or last is not None:
            out += f" layers first/last={first or '-'}/{last or '-'}"
        return out


def _views_of(graph: Graph, name: str, users: dict[str, list[str]]) -> list[str]:
    """``name`` and every view (no bytes moved) chained after it."""
    out, todo = [], [name]
    while todo:
        n = todo.pop()
        out.append(n)
        todo += [u for u in users[n] if graph[u].is_view and graph[u].target != "getitem"]
    return out


# elementwise ops a row-parallel output may pass before the residual add (dropout)
_PASS_THROUGH = {"aten.native_dropout.default"}


def _on_to_residual(graph: Graph, name: str, users: dict[str, list[str]]) -> list[str]:
    """``name`` and what carries its values on unchanged in shape towards the
    residual add: views, dropout and the dropout's first output."""
    out, todo = [], [name]
    while todo:
        n = todo.pop()
        out.append(n)
        for u in users[n]:
            node = graph[u]
            if (node.is_view and node.target != "getitem") or node.target in _PASS_THROUGH or (
                    node.target == "getitem" and node.arg_index == 0
                    and graph[node.args[0]].target in _PASS_THROUGH):
                todo.append(u)
    return out


def _matmuls_of(graph: Graph, param: str, users: dict[str, list[str]]) -> list[str]:
    """The matmuls that read parameter ``param`` (directly or through views)."""
    return [u for v in _views_of(graph, param, users) for u in users[v]
            if graph[u].target in _MATMULS]


def _viewed(graph: Graph, name: str) -> str:
    """The node whose data ``name`` views (walking back through views and
    first-output projections; ``name`` itself when it moves bytes)."""
    n = graph[name]
    while n.is_view and len(n.args) == 1 and (n.target != "getitem" or n.arg_index == 0):
        n = graph[n.args[0]]
    return n.name


def _classify_linears(graph: Graph) -> dict[str, str]:
    """Weight FQN -> "column" | "row" for every nn.Linear-like weight in a layer."""
    users = graph.users()
    in_layer = {n for layer in graph.layers for n in layer.nodes}
    kinds: dict[str, str] = {}
    for p in graph.nodes:
        if p.kind != PARAM or len(p.output.shape) != 2:
            continue
        matmuls = _matmuls_of(graph, p.name, users)
        if not matmuls:
            continue
        if p.name not in in_layer:
            kinds[p.fqn] = "column"  # output head: vocabulary parallel
            continue
        closes = any(graph[c].target == "aten.add.Tensor"
                     for m in matmuls for v in _on_to_residual(graph, m, users) for c in users[v])
        kinds[p.fqn] = "row" if closes else "column"
    return kinds


def _sequence_parallel_nodes(graph: Graph, linears: dict[str, str]) -> list[str]:
    """Op nodes (by name) holding the activations between the tensor-parallel
    blocks of each layer, the ones Megatron's sequence parallelism splits:

    * the residual adds: ``aten.add.Tensor`` nodes of a layer with an operand
      of their own shape that comes from outside the layer (the layer's input)
      or from an earlier residual add;
    * the norm outputs: what the column-parallel linears of a layer read
      (through views), i.e. the layer-norm or RMS-norm output.

    Only [batch, seq, hidden] (3-D) values are returned."""
    users = graph.users()
    out: list[str] = []
    for layer in graph.layers:
        members = set(layer.nodes)
        stream: set[str] = set()
        for name in layer.nodes:
            n = graph[name]
            if n.kind == OP and n.target == "aten.add.Tensor" and any(
                    ((a not in members and graph[a].kind in (OP, INPUT)) or a in stream)
                    and graph[a].outputs[0].shape == n.output.shape for a in n.args):
                stream.add(name)
        norms = {_viewed(graph, a) for p in layer.nodes if linears.get(graph[p].fqn) == "column"
                 for m in _matmuls_of(graph, p, users) for a in graph[m].args}
        out += [name for name in layer.nodes if (name in stream or name in norms)
                and graph[name].kind == OP and len(graph[name].outputs[0].shape) == 3]
    return out


def megatron_layout(graph: Graph, cfg: MegatronConfig) -> dict[str, tuple[Placement, ...]]:
    """Fixed placements (FQN, input or op node name -> one placement per mesh axis).

    Raises:
        PlanningError: ``cfg.sequence_parallel`` and tp does not divide the
            sequence length, or the model has no activations it could split.
    """
    dp, tp = cfg.data_parallel_size, cfg.tensor_model_parallel_size

    def on_mesh(dp_p: Placement, tp_p: Placement) -> tuple[Placement, ...]:
        out = []
        if dp > 1:
            out.append(dp_p)
        if tp > 1:
            out.append(tp_p)
        return tuple(out) or (Replicate(),)

    r = Replicate()
    linears = _classify_linears(graph)
    layout: dict[str, tuple[Placement, ...]] = {}
    users = graph.users()
    bias_of: dict[str, str] = {}
    for n in graph.nodes:
        if n.kind == OP and n.target == "aten.addmm.default":
            bias, weight_view = n.args[0], n.args[2]
            weight = next((a for a in [weight_view] + list(graph[weight_view].args)
                           if graph[a].kind == PARAM), None)
            if weight and graph[bias].kind == PARAM:
                bias_of[graph[bias].fqn] = graph[weight].fqn
    for n in graph.nodes:
        if n.kind == INPUT:
            layout[n.name] = on_mesh(Shard(0), r)
        elif n.kind == PARAM:
            kind = linears.get(n.fqn)
            if kind == "column":
                layout[n.fqn] = on_mesh(r, Shard(0))
            elif kind == "row":
                layout[n.fqn] = on_mesh(r, Shard(1))
            elif n.fqn in bias_of and linears.get(bias_of[n.fqn]) == "column":
                layout[n.fqn] = on_mesh(r, Shard(0))
            elif any(graph[u].target == "aten.embedding.default"
                     and graph[graph[u].args[1]].kind == INPUT for u in users[n.name]):
                layout[n.fqn] = on_mesh(r, Shard(0))  # vocabulary-parallel embedding
            else:
                layout[n.fqn] = on_mesh(r, r)
    if cfg.sequence_parallel:
        names = _sequence_parallel_nodes(graph, linears)
        if not names:
            raise PlanningError(f"{cfg.label()}: found no [batch, seq, hidden] activations "
                                f"between tensor-parallel blocks to split; drop sequence_parallel")
        seq = graph[names[0]].outputs[0].shape[_SEQ_DIM]
        if seq % tp:
            raise PlanningError(f"{cfg.label()}: sequence_parallel needs the sequence length "
                                f"({seq}) to be a multiple of tp={tp}; change the sequence "
                                f"length or drop sequence_parallel")
        for name in names:
            layout[name] = on_mesh(Shard(0), Shard(_SEQ_DIM))
    return layout


def megatron_configs(cluster: Cluster, global_batch: int | None = None,
                     num_layers: int | None = None, *,
                     micro_batch_sizes: Sequence[int] = (1, 2, 4),
                     virtual_stages: Sequence[int | None] = (None, 2),
                     sequence_parallel: Sequence[bool] = (False, True),
                     use_distributed_optimizer: bool = True) -> list[MegatronConfig]:
    """The configurations a Megatron practitioner would try on ``cluster``.

    * tensor parallel: powers of two up to a node (and dividing the cluster);
    * pipeline parallel (only when ``num_layers`` is given): every pp that
      divides the layers and the devices left after tp, whose stages are part
      of one node or whole nodes (the sub-meshes the Plan can run);
    * data parallel: the rest;
    * micro-batch size (only when ``global_batch`` is given): each of
      ``micro_batch_sizes`` that divides the batch and leaves at least pp
      micro-batches (fewer leave ranks idle), and without a pipeline also the
      whole local batch (no gradient accumulation);
    * virtual stages: each of ``virtual_stages`` (None = plain 1F1B, v =
      interleaved) where pp >= 2, the layers split into pp x v chunks and the
      micro-batches are a multiple of pp;
    * sequence parallelism: each of ``sequence_parallel`` where tp > 1 (with
      tp = 1 the configuration is listed once, without it, as Megatron turns
      it off there).

    Pruning, to keep the grid small (each pipeline configuration costs one
    ILP per stage): the powers of two above, the micro-batch sizes given
    (default 1, 2, 4) and v <= 2. Memory is pruned later, by the plans
    themselves: a configuration that does not fit raises
    :class:`MegatronDoesNotFit` (and :func:`planner.compare.compare` then skips
    the larger micro-batch sizes of the same tp/pp/dp/vpp/sp).

    Order: pp, then tp, then micro-batch size, then v, ascending, then
    sequence parallelism in the order of ``sequence_parallel`` (off first by
    default).
    """
    from planner.inter_op import stage_mesh_options

    n, dpn = cluster.num_devices, cluster.devices_per_node
    out: list[MegatronConfig] = []

    def add(tp: int, dp: int, pp: int = 1, v: int | None = None, mbs: int | None = None) -> None:
        for sp in dict.fromkeys(bool(s) and tp > 1 for s in sequence_parallel):
            out.append(MegatronConfig(tp, dp, use_distributed_optimizer, pp, v, mbs, sp))

    tps = []
    tp = 1
    while tp <= min(n, dpn):
        if n % tp == 0:
            tps.append(tp)
        tp *= 2
    pps = [1] if num_layers is None else [p for p in range(1, n + 1)
                                          if n % p == 0 and num_layers % p == 0]
    for pp in pps:
        if pp > 1 and not stage_mesh_options(cluster, pp):
            continue
        for tp in tps:
            if (n // pp) % tp:
                continue
            dp = n // (pp * tp)
            mbss = [None] if global_batch is None else [
                b for b in micro_batch_sizes
                if global_batch % (b * dp) == 0 and global_batch // (b * dp) >= pp]
            if pp == 1:  # and the whole local batch at once
                if global_batch is not None and global_batch % dp == 0 \
                        and global_batch // dp not in mbss:
                    mbss.append(global_batch // dp)
                for mbs in mbss:
                    add(tp, dp, mbs=mbs)
                continue
            for mbs in mbss:
                for v in virtual_stages:
                    if v is not None and (num_layers % (pp * v) or (
                            global_batch is not None and (global_batch // (mbs * dp)) % pp)):
                        continue
                    add(tp, dp, pp, v, mbs)
    return out


def _state_floor(graph: Graph, cfg: MegatronConfig, optimizer: str, precision: str) -> float:
    """A lower bound on parameter-state bytes of the fullest device: every
    parameter split tp x pp ways (the fullest stage holds at least the average),
    optimizer states also over dp under the distributed optimizer."""
    from costmodel.memory import training_state_bytes

    total = 0.0
    for t in graph.parameters.values():
        s = training_state_bytes(int(t.numel), precision=precision, optimizer=optimizer)
        opt = s["optimizer"] / (cfg.dp if cfg.use_distributed_optimizer else 1)
        total += s["params"] + s["grads"] + opt
    return total / (cfg.tp * cfg.pp)


def _optimizer_bytes(graph: Graph, layout: dict[str, tuple], mesh_shape: tuple[int, ...],
                     optimizer: str, precision: str) -> float:
    """Optimizer-state bytes per device of ``graph``'s parameters under ``layout``."""
    from costmodel.memory import training_state_bytes
    from planner.intra_op import local_numel

    total = 0.0
    for n in graph.nodes:
        if n.kind == PARAM:
            numel = local_numel(n.output, layout.get(n.fqn, (Replicate(),) * len(mesh_shape)),
                                mesh_shape)
            total += training_state_bytes(int(math.ceil(numel)), precision=precision,
                                          optimizer=optimizer)["optimizer"]
    return total


def _zero1_saving(graph: Graph, cfg: MegatronConfig, layout: dict[str, tuple],
                  optimizer: str, precision: str) -> float:
    """Bytes per device the distributed optimizer saves (ZeRO-1 over dp)."""
    if not cfg.use_distributed_optimizer or cfg.dp == 1:
        return 0.0
    return _optimizer_bytes(graph, layout, cfg.mesh_shape, optimizer, precision) * (1 - 1 / cfg.dp)


def megatron_plan(model: torch.nn.Module, cluster: Cluster | str, cfg: MegatronConfig, *,
                  example_inputs: Any, model_source: str | None = None,
                  zoo_kwargs: dict[str, Any] | None = None, time_limit_s: float = 30.0,
                  graph: Graph | None = None, optimizer: str = "adam",
                  memory_budget: float | None = None,
                  cache: dict | None = None, precision: str | None = None) -> Plan:
    """The Plan of Megatron configuration ``cfg``.

    Without a pipeline and with the whole local batch in one micro-batch: the
    intra-op ILP on the (dp, tp) mesh with the Megatron layout fixed. With
    one (pp > 1), or with several micro-batches (gradient accumulation, a
    one-stage 1F1B): the layers split evenly over pp x vpp
    stages (the embedding with the first, the head and loss with the last, as
    Megatron does), each stage solved by the intra-op ILP on the (dp, tp)
    stage mesh with the layout fixed, priced by the 1F1B (or interleaved 1F1B)
    schedule simulation, exactly as :func:`planner.api.pipeline_plan` with
    ``fixed=megatron_layout(...)`` and a uniform ``layer_split`` (without its
    inter-op DP, whose cut Megatron does not use). The distributed optimizer
    divides the optimizer states by dp (ZeRO-1): a pipeline's stage ILPs
    count that and reduce the gradients once per step (stage meshes with
    ``zero_stage=1``); a single stage of the whole batch has the ILP's memory
    budget grown by what it saves, so activations may use it.

    Args:
        graph: the traced whole-batch program, if already traced.
        cache: a dict shared between calls for the same model and cluster
            (``planner compare``): traces and stage sub-programs are reused.
        precision: as :func:`planner.api.plan` (Megatron runs ``bf16-mixed``).

    Raises:
        PlanningError: ``cfg`` does not divide the model or the batch;
            :class:`MegatronDoesNotFit` (a PlanningError) when it does not fit.
    """
    if isinstance(cluster, str):
        cluster = load_cluster(cluster)
    if cfg.world_size != cluster.num_devices:
        raise PlanningError(f"{cfg.label()} needs {cfg.world_size} devices but cluster "
                            f"'{cluster.name}' has {cluster.num_devices}")
    if not isinstance(example_inputs, (tuple, list)):
        example_inputs = (example_inputs,)
    example_inputs = tuple(example_inputs)
    cache = {} if cache is None else cache
    chosen = resolve_precision(model, cluster, precision)
    model, example_inputs = compute_copy(model, example_inputs, chosen)
    if graph is None:
        graph = cache.get("graph") or trace(model, example_inputs)
    cache["graph"] = graph
    dtype = chosen
    budget = default_memory_budget(cluster) if memory_budget is None else float(memory_budget)
    floor = _state_floor(graph, cfg, optimizer, dtype)
    if floor > budget:
        raise MegatronDoesNotFit(
            f"{cfg.label()} needs at least {floor / 2**30:.1f} GiB per device for parameter "
            f"states alone, more than the {budget / 2**30:.1f} GiB available")
    from planner.search_context import global_batch_of

    m = cfg.num_microbatches(global_batch_of(example_inputs))
    layout = megatron_layout(graph, cfg)
    training = training_record(dtype, optimizer, example_inputs, zoo_kwargs,
                               manual={"kind": "megatron", **asdict(cfg)})
    info = model_record(model, graph, model_source)
    if cfg.pp > 1 or m > 1:  # a pipeline, or gradient accumulation
        return _pipeline_plan(model, cluster, cfg, example_inputs, graph, layout, m, dtype,
                              optimizer, budget, time_limit_s, cache, info, training)
    saving = _zero1_saving(graph, cfg, layout, optimizer, dtype)
    try:
        result = solve_intra_op(graph, cluster, cfg.mesh_shape, dtype=dtype,
                                time_limit_s=time_limit_s, fixed=layout, optimizer=optimizer,
                                memory_budget=budget + saving, recompute=cfg.recompute)
    except FixedPlacementError as err:
        raise PlanningError(f"{cfg.label()} does not divide the model: {err}{_PAD_HINT}") from err
    except MemoryInfeasibleError as err:
        raise MegatronDoesNotFit(f"{cfg.label()} does not fit: {err}") from None
    if cfg.use_distributed_optimizer and cfg.dp > 1:
        result.memory["optimizer"] /= cfg.dp  # ZeRO-1 over data parallel
    total = sum(result.memory.values())
    if total > budget * (1 + 1e-9):
        raise MegatronDoesNotFit(f"{cfg.label()} needs {total / 2**30:.1f} GiB per device, more "
                                 f"than the {budget / 2**30:.1f} GiB available")
    return build_plan(result, cluster, info, training, whole_batch=True)


def _pipeline_plan(model, cluster: Cluster, cfg: MegatronConfig, example_inputs: tuple,
                   graph: Graph, layout: dict[str, tuple], m: int, dtype: str, optimizer: str,
                   budget: float, time_limit_s: float, cache: dict, info: dict,
                   training: dict) -> Plan:
    """A Megatron pipeline: uniform layer split, fixed layout, 1F1B / interleaved
    (with pp = 1: one stage accumulating the gradients of its micro-batches)."""
    from planner.inter_op import PipelineCandidate, StageMeshOption, stage_mesh_options
    from planner.finalists import ExactPipeline, assemble
    from planner.pipeline import p2p_seconds, simulate_step, stage_in_flight
    from planner.search_context import SearchContext

    options = stage_mesh_options(cluster, cfg.pp)
    if not options:
        raise PlanningError(f"{cfg.label()}: pp={cfg.pp} does not cut cluster '{cluster.name}' "
                            f"into sub-meshes inside a node or of whole nodes")
    # the distributed optimizer: optimizer states sharded over dp (mesh axis 0),
    # gradients reduced once per step (ZeRO-1); without it DDP's all-reduce,
    # also once per step
    zero = 1 if cfg.use_distributed_optimizer and cfg.dp > 1 else 0
    mesh = StageMeshOption(cfg.mesh_shape, options[0].num_nodes, options[0].devices_per_node,
                           zero_stage=zero, reduce_once=not zero and cfg.dp > 1)
    key = ("ctx", cfg.dp, cfg.tp, cfg.sequence_parallel, budget, time_limit_s, optimizer)
    ctx = cache.get(key)
    if ctx is None:
        ctx = cache[key] = SearchContext(model, example_inputs, cluster, dtype=dtype,
                                         optimizer=optimizer, budget=budget,
                                         time_limit_s=time_limit_s, fixed=layout,
                                         programs=cache.setdefault("programs", {}),
                                         whole_batch_graph=graph)
    prog = ctx.program(m, traced=True)
    v = cfg.stages_per_rank
    bounds = manual_bounds(prog.layers, cfg.layer_split(block_count(prog.layers)))
    try:
        copies = stage_in_flight(cfg.schedule, cfg.pp, m, v)
    except ValueError as err:
        raise PlanningError(f"{cfg.label()}: torch's {cfg.schedule} schedule rejects pp={cfg.pp} "
                            f"with {m} micro-batches: {err}") from None
    results, times = [], []
    for s, (a, b) in enumerate(bounds):
        try:
            r = ctx.solve_stage(prog, a, b, mesh, budget / v, copies[s], cfg.recompute)
        except FixedPlacementError as err:
            raise PlanningError(f"{cfg.label()} does not divide the model: {err}{_PAD_HINT}"
                                ) from err
        except MemoryInfeasibleError as err:
            raise MegatronDoesNotFit(f"{cfg.label()}: stage {s} does not fit: {err}") from None
        results.append(r)
        t = ctx.times_of(r, mesh)
        times.append(t)
    p2p = p2p_seconds(prog, bounds, mesh, cluster)
    step, bubble = simulate_step(cfg.schedule, cfg.pp, m, v, times, p2p)
    cand = PipelineCandidate(cfg.pp, v, mesh, cfg.schedule, m, None, step, bubble, sum(p2p))
    exact = ExactPipeline(cand, prog, bounds, results, times, copies, step, bubble, p2p)
    return assemble(exact, ctx, lambda r, c: build_plan(r, c, info, training))
