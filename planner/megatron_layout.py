"""The Megatron-LM configuration and the parameter layout it fixes.

:class:`MegatronConfig` holds one Megatron-LM parallel configuration, with
Megatron's argument names. :func:`megatron_layout` classifies a traced
program's linears as a Megatron practitioner does (column parallel where a
branch opens, row parallel where it closes into the residual stream,
vocabulary parallel embedding and head) and gives the placements that layout
fixes on the (dp, tp) stage mesh. :mod:`planner.megatron` plans and prices
configurations; the intra-op solver reads the layout for its warm starts.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.tensor.placement_types import Placement, Replicate, Shard

from ir.graph import INPUT, OP, PARAM, Graph
from planner.request import PlanningError

__all__ = ["MegatronConfig", "megatron_layout"]

_MATMULS = {"aten.mm.default", "aten.addmm.default"}
_SEQ_DIM = 1  # of the [batch, seq, hidden] activations sequence parallelism splits


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
