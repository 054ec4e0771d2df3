"""The Megatron-LM configuration and the parameter layout it fixes.

:class:`MegatronConfig` holds one Megatron-LM parallel configuration, with
Megatron's argument names. :func:`megatron_layout` classifies a traced
program's linears as a Megatron practitioner does (column parallel where a
branch opens, row parallel where it closes into the residual stream,
vocabulary parallel embedding and head) and gives the placements that layout
fixes on the (dp, tp) stage mesh. :mod:`planner.baselines.megatron` plans and prices
configurations; the intra-op solver reads the layout for its warm starts.

Expert parallelism follows Megatron-Core with expert tensor parallel size 1:
the ``expert_model_parallel_size`` (ep) ranks of an expert-parallel group are
carved out of the dp x tp ranks of a stage (tp varying fastest, then ep, as
Megatron-Core numbers them), the batched expert weights (``[E, ...]``
parameters read by ``bmm``, e.g. ``moe.w_in`` of :mod:`models.zoo.moe`) are split
on their expert dimension over them and replicated over the remaining
dp x tp / ep expert-data-parallel ranks. The stage mesh then factors dp or tp
so that the ep group is a set of trailing mesh axes
(:attr:`MegatronConfig.mesh_axes`); the token dispatch and combine show up
as all-to-all reshards of the activations the ILP places.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

from torch.distributed.tensor.placement_types import Placement, Replicate, Shard

from costmodel.schedules.specs import canonical_schedule, schedule_spec
from ir.graph import INPUT, OP, PARAM, Graph
from planner.request import PlanningError

__all__ = ["CP_COMM_TYPES", "MegatronConfig", "MeshAxis", "expert_weights", "megatron_layout", "num_experts"]

_MATMULS = {"aten.mm.default", "aten.addmm.default"}
# batched matmuls whose [E, ...] parameter operand is a stack of expert weights
_BATCHED_MATMULS = {"aten.bmm.default", "aten.baddbmm.default"}
_SEQ_DIM = 1  # of the [batch, seq, hidden] activations sequence parallelism splits
#: Megatron's ``--cp-comm-type`` values the cost model prices.
CP_COMM_TYPES = ("p2p", "all_gather")


class MeshAxis(NamedTuple):
    """One axis of a Megatron stage mesh.

    ``size``: ranks along it; ``parallel``: ``"dp"`` or ``"tp"``, the Megatron
    group it is a factor of (dense weights are replicated along the dp axes
    and split along the tp axes); ``expert``: whether it is part of the
    expert-parallel group (expert weights are split along it)."""

    size: int
    parallel: str
    expert: bool


def _alias(field: str) -> property:
    """A read-only property giving the field ``field``."""
    return property(lambda self: getattr(self, field), doc=f"``{field}``")


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
    ``expert_model_parallel_size`` (ep, Megatron-Core's
    ``--expert-model-parallel-size`` with ``--expert-tensor-parallel-size 1``):
    ranks of one expert-parallel group, carved out of the dp x tp ranks; it
    must divide dp x tp and be a multiple or a divisor of tp (so that the
    stage mesh factors it: :attr:`mesh_axes`). ``pipeline_schedule``: None
    for Megatron's own (1F1B, interleaved 1F1B with virtual stages), or a
    schedule name of :mod:`costmodel.schedules.specs` to price the same
    configuration under another schedule (DeepSeek-V3's ``dualpipev``:
    :mod:`planner.baselines.deepseek_layout`). ``pipeline_model_parallel_layout``
    (Megatron-Core's ``--pipeline-model-parallel-layout``, given as counts):
    layers of each of the pp x stages-per-rank model chunks, in pipeline
    order, for splits the even split and first/last counts cannot express;
    the first chunk may hold no layer (only the embedding) and the last none
    (only the output head and the loss), as Llama 3 405B was trained.
    ``context_parallel_size`` (cp, Megatron's ``--context-parallel-size``):
    each sequence is cut into 2 cp chunks and rank i of a cp group holds
    chunks i and 2 cp - 1 - i (causal load balancing), so activations and
    attention are split over cp on the sequence; the dense weights are
    replicated over dp x cp (Megatron's data-parallel group with cp: their
    gradients reduce over it and the distributed optimizer shards over it).
    ``cp_comm_type`` (Megatron's ``--cp-comm-type``): ``"p2p"`` (ring
    attention: K/V passed around the cp group, overlapped with the attention
    kernels) or ``"all_gather"`` (K/V all-gathered before the attention, as
    Llama 3 ran). :mod:`planner.baselines.megatron` prices both.
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
    expert_model_parallel_size: int = 1
    pipeline_schedule: str | None = None
    pipeline_model_parallel_layout: tuple[int, ...] | None = None
    context_parallel_size: int = 1
    cp_comm_type: str = "p2p"

    def __post_init__(self) -> None:
        for name in ("tensor_model_parallel_size", "data_parallel_size",
                     "pipeline_model_parallel_size", "context_parallel_size"):
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
        if self.cp_comm_type not in CP_COMM_TYPES:
            raise PlanningError(f"cp_comm_type={self.cp_comm_type!r} is not modelled; use one "
                                f"of {', '.join(CP_COMM_TYPES)}")
        self._check_experts()
        self._check_schedule()

    def _check_experts(self) -> None:
        """ep must split the dp x tp ranks into groups the stage mesh can factor.

        Raises:
            PlanningError (a ValueError): it does not.
        """
        ep, tp, dp = self.expert_model_parallel_size, self.tp, self.dp * self.cp
        if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
            raise PlanningError(f"expert_model_parallel_size must be an integer >= 1, got {ep!r}")
        if (dp * tp) % ep:
            raise PlanningError(
                f"expert_model_parallel_size={ep} must divide data_parallel_size x "
                f"tensor_model_parallel_size x context_parallel_size = {dp * tp} (the "
                f"expert-parallel groups are carved out of the data- and tensor-parallel ranks)")
        if ep % tp and tp % ep:
            raise PlanningError(
                f"expert_model_parallel_size={ep} must be a multiple or a divisor of "
                f"tensor_model_parallel_size={tp}: with expert tensor parallel size 1 an "
                f"expert-parallel group then holds whole tensor-parallel groups or lies inside "
                f"one, which a device mesh can express")

    def _check_schedule(self) -> None:
        """``pipeline_schedule`` and ``pipeline_model_parallel_layout`` fit the pipeline.

        Raises:
            PlanningError: they do not.
        """
        name = self.pipeline_schedule
        if name is not None:
            try:
                spec = schedule_spec(canonical_schedule(name))
                spec.stages_per_rank(self.virtual_pipeline_model_parallel_size)
            except ValueError as err:
                raise PlanningError(f"pipeline_schedule={name!r}: {err}") from None
            if self.pp < 2:
                raise PlanningError(f"pipeline_schedule={name!r} needs "
                                    f"pipeline_model_parallel_size >= 2, got {self.pp}")
        layout = self.pipeline_model_parallel_layout
        if layout is None:
            return
        if self.decoder_first_pipeline_num_layers is not None or \
                self.decoder_last_pipeline_num_layers is not None:
            raise PlanningError("pipeline_model_parallel_layout already gives every stage's "
                                "layers: drop decoder_first/last_pipeline_num_layers")
        layout = tuple(int(n) for n in layout)
        object.__setattr__(self, "pipeline_model_parallel_layout", layout)  # lists too
        chunks = self.pp * self.stages_per_rank
        if len(layout) != chunks or any(n < 1 for n in layout[1:-1]) or min(layout) < 0 \
                or sum(layout) < 1:
            raise PlanningError(f"pipeline_model_parallel_layout={tuple(layout)} must give "
                                f"{chunks} model chunks (pp x stages per rank) at least one "
                                f"layer each (the first and the last may have none: the "
                                f"embedding, the head and loss alone)")

    @property
    def recompute(self) -> bool | None:
        """The intra-op solver's ``recompute``: True under full recomputation,
        None (its own choice) otherwise."""
        return True if self.recompute_granularity == "full" else None

    # Megatron's short names of the five sizes
    tp = _alias("tensor_model_parallel_size")
    dp = _alias("data_parallel_size")
    pp = _alias("pipeline_model_parallel_size")
    ep = _alias("expert_model_parallel_size")
    cp = _alias("context_parallel_size")

    @property
    def weight_data_parallel_size(self) -> int:
        """Ranks of a stage holding the same part of a dense weight: dp x cp
        (Megatron's data-parallel group with cp), over which its gradient is
        reduced and the distributed optimizer shards its states."""
        return self.dp * self.cp

    @property
    def expert_data_parallel_size(self) -> int:
        """Ranks of a stage holding the same experts: dp x tp / ep (expert
        tensor parallel size 1); expert gradients are reduced over them."""
        return self.dp * self.cp * self.tp // self.ep

    @property
    def stages_per_rank(self) -> int:
        if self.pipeline_schedule is not None:
            return schedule_spec(canonical_schedule(self.pipeline_schedule)).stages_per_rank(
                self.virtual_pipeline_model_parallel_size)
        return self.virtual_pipeline_model_parallel_size or 1

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    @property
    def schedule(self) -> str:
        """The pipeline schedule Megatron runs (1F1B of one stage without a
        pipeline: gradient accumulation when there are several micro-batches),
        or ``pipeline_schedule`` (its canonical name) when given."""
        if self.pipeline_schedule is not None:
            return canonical_schedule(self.pipeline_schedule)
        return "interleaved_1f1b" if self.virtual_pipeline_model_parallel_size else "1f1b"

    @property
    def mesh_axes(self) -> tuple[MeshAxis, ...]:
        """The axes of one stage's mesh, outermost first, size-1 axes dropped (at
        least one axis): (dp, tp) without expert parallelism; with ep a
        multiple of tp, (dp x tp / ep, ep / tp, tp), the last two the
        expert-parallel group; with ep dividing tp, (dp, tp / ep, ep), the
        last one the expert-parallel group. Ranks are numbered row-major, so
        an expert-parallel group is ep consecutive ranks, as in Megatron-Core.
        With context parallelism, dp here is dp x cp: the program priced is
        one cp rank's (its sequence chunks as more rows of the batch,
        :func:`planner.search.cp_search.context_parallel_inputs`), and the weights are
        replicated over dp x cp as in Megatron."""
        dp, tp, ep = self.weight_data_parallel_size, self.tp, self.ep
        if ep == 1:
            axes = [MeshAxis(dp, "dp", False), MeshAxis(tp, "tp", False)]
        elif ep % tp == 0:
            axes = [MeshAxis(dp * tp // ep, "dp", False), MeshAxis(ep // tp, "dp", True),
                    MeshAxis(tp, "tp", True)]
        else:
            axes = [MeshAxis(dp, "dp", False), MeshAxis(tp // ep, "tp", False),
                    MeshAxis(ep, "tp", True)]
        return tuple(a for a in axes if a.size > 1) or (MeshAxis(1, "dp", False),)

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """Mesh of one stage: the sizes of :attr:`mesh_axes` ((dp, tp) without
        expert parallelism, size-1 axes dropped, at least one axis)."""
        return tuple(a.size for a in self.mesh_axes)

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
        layout = self.pipeline_model_parallel_layout
        if layout is not None:
            if sum(layout) != num_layers:
                raise PlanningError(f"{self.label()}: the layout places {sum(layout)} layers, "
                                    f"the model has {num_layers}")
            return [int(n) for n in layout]
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
        """Megatron terms, e.g. ``tp=2 pp=4 dp=8 ep=8 mbs=1 vpp=2 sp`` (``ep``
        only when > 1, so labels without expert parallelism stay as they were)."""
        out = f"tp={self.tp} pp={self.pp} dp={self.dp}"
        if self.cp > 1:
            out += f" cp={self.cp}" + (f" cp-comm={self.cp_comm_type}"
                                       if self.cp_comm_type != "p2p" else "")
        if self.ep > 1:
            out += f" ep={self.ep}"
        if self.micro_batch_size is not None:
            out += f" mbs={self.micro_batch_size}"
        if self.virtual_pipeline_model_parallel_size:
            out += f" vpp={self.virtual_pipeline_model_parallel_size}"
        if self.pipeline_schedule is not None:
            out += f" {self.schedule}"
        if self.pipeline_model_parallel_layout is not None:
            out += f" layout={','.join(map(str, self.pipeline_model_parallel_layout))}"
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


def expert_weights(graph: Graph) -> dict[str, int]:
    """Expert weight FQN -> its number of experts: the parameters of at least
    3 dimensions that a batched matmul (``bmm``) reads, directly or through
    views, as a stack of per-expert matrices whose dimension 0 is the
    expert (``moe.w_in`` [E, h, f] and ``moe.w_out`` [E, f, h] of
    :mod:`models.zoo.moe`)."""
    users = graph.users()
    out: dict[str, int] = {}
    for p in graph.nodes:
        if p.kind != PARAM or len(p.output.shape) < 3:
            continue
        if any(graph[u].target in _BATCHED_MATMULS
               for v in _views_of(graph, p.name, users) for u in users[v]):
            out[p.fqn] = int(p.output.shape[0])
    return out


def num_experts(graph: Graph) -> int | None:
    """Experts per MoE layer of ``graph`` (the greatest common divisor of the
    expert counts of :func:`expert_weights`, which an expert-parallel size
    must divide), or None for a model without experts."""
    counts = set(expert_weights(graph).values())
    return math.gcd(*counts) if counts else None


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


def _expert_layout(graph: Graph, cfg: MegatronConfig) -> dict[str, tuple[Placement, ...]]:
    """Expert weight FQN -> placements: ``S(0)`` (the expert dimension) on the
    expert-parallel axes of ``cfg.mesh_axes``, replicated on the others (all
    replicated without expert parallelism, as Megatron-Core with expert tensor
    parallel size 1).

    Raises:
        PlanningError: ep > 1 and the model has no expert weights, or ep does
            not divide an expert count.
    """
    ep = cfg.expert_model_parallel_size
    weights = expert_weights(graph)
    if ep > 1 and not weights:
        raise PlanningError(f"{cfg.label()}: expert_model_parallel_size={ep} but the model has "
                            f"no expert weights ([E, ...] parameters read by a batched "
                            f"matmul); use expert_model_parallel_size=1")
    bad = sorted(f for f, e in weights.items() if e % ep)
    if bad:
        raise PlanningError(f"{cfg.label()}: expert_model_parallel_size={ep} does not divide "
                            f"the {weights[bad[0]]} experts of {bad[0]}"
                            + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else "")
                            + "; choose an ep that divides the expert count")
    placements = tuple(Shard(0) if a.expert else Replicate() for a in cfg.mesh_axes)
    return {f: placements for f in weights}


def megatron_layout(graph: Graph, cfg: MegatronConfig) -> dict[str, tuple[Placement, ...]]:
    """Fixed placements (FQN, input or op node name -> one placement per axis of
    ``cfg.mesh_axes``): dense parameters replicated on the dp axes and split
    on the tp axes as Megatron splits them, expert weights split on their
    expert dimension over the expert-parallel axes and replicated on the
    others, the inputs' batch split over the dp axes.

    Raises:
        PlanningError: ``cfg.sequence_parallel`` and tp does not divide the
            sequence length, or the model has no activations it could split;
            ``cfg.expert_model_parallel_size`` > 1 and the model has no
            expert weights, or ep does not divide their expert count.
    """
    tp = cfg.tensor_model_parallel_size
    axes = cfg.mesh_axes

    def on_mesh(dp_p: Placement, tp_p: Placement) -> tuple[Placement, ...]:
        if axes[0].size == 1:  # one device: nothing to split
            return (Replicate(),)
        return tuple(dp_p if a.parallel == "dp" else tp_p for a in axes)

    r = Replicate()
    experts = _expert_layout(graph, cfg)
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
            if n.fqn in experts:
                layout[n.fqn] = experts[n.fqn]
            elif kind == "column":
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
