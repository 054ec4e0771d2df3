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

Pipeline parallelism, interleaving and micro-batching wait for the inter-op pass.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch.distributed.tensor.placement_types import Placement, Replicate, Shard

from costmodel.cluster import Cluster, load_cluster
from ir.graph import INPUT, OP, PARAM, Graph
from ir.layers import find_layers
from ir.trace import trace
from planner.api import (PlanningError, build_plan, default_memory_budget, model_record,
                         training_record)
from planner.intra_op import FixedPlacementError, solve_intra_op
from planner.plan_format import Plan

_MATMULS = {"aten.mm.default", "aten.addmm.default"}


@dataclass(frozen=True)
class MegatronConfig:
    """A Megatron-LM parallel configuration (intra-op part)."""

    tensor_model_parallel_size: int
    data_parallel_size: int
    use_distributed_optimizer: bool = True

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """(data parallel, tensor parallel), size-1 axes dropped (at least one axis)."""
        shape = tuple(d for d in (self.data_parallel_size, self.tensor_model_parallel_size) if d > 1)
        return shape or (1,)

    def label(self) -> str:
        return (f"megatron tp={self.tensor_model_parallel_size} dp={self.data_parallel_size}"
                + (" dist-opt" if self.use_distributed_optimizer else ""))


def _views_of(graph: Graph, name: str, users: dict[str, list[str]]) -> list[str]:
    """``name`` and every view (no bytes moved) chained after it."""
    out, todo = [], [name]
    while todo:
        n = todo.pop()
        out.append(n)
        todo += [u for u in users[n] if graph[u].kind == OP and graph[u].bytes_moved == 0
                 and graph[u].flops == 0 and graph[u].target != "getitem"]
    return out


def _classify_linears(graph: Graph) -> dict[str, str]:
    """Weight FQN -> "column" | "row" for every nn.Linear-like weight in a layer."""
    users = graph.users()
    in_layer = {n for layer in find_layers(graph) for n in layer.nodes}
    kinds: dict[str, str] = {}
    for p in graph.nodes:
        if p.kind != PARAM or len(p.output.shape) != 2:
            continue
        matmuls = [u for v in _views_of(graph, p.name, users) for u in users[v]
                   if graph[u].target in _MATMULS]
        if not matmuls:
            continue
        if p.name not in in_layer:
            kinds[p.fqn] = "column"  # output head: vocabulary parallel
            continue
        closes = any(graph[c].target == "aten.add.Tensor"
                     for m in matmuls for v in _views_of(graph, m, users) for c in users[v])
        kinds[p.fqn] = "row" if closes else "column"
    return kinds


def megatron_layout(graph: Graph, cfg: MegatronConfig) -> dict[str, tuple[Placement, ...]]:
    """Fixed placements (FQN or input name -> one placement per mesh axis)."""
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
    return layout


def megatron_configs(cluster: Cluster) -> list[MegatronConfig]:
    """Every tensor-parallel size a practitioner would try: powers of two up to a node."""
    n, out, tp = cluster.num_devices, [], 1
    while tp <= min(n, cluster.devices_per_node):
        if n % tp == 0:
            out.append(MegatronConfig(tp, n // tp))
        tp *= 2
    return out


def megatron_plan(model: torch.nn.Module, cluster: Cluster | str, cfg: MegatronConfig, *,
                  example_inputs: Any, model_source: str | None = None,
                  zoo_kwargs: dict[str, Any] | None = None, time_limit_s: float = 30.0,
                  graph: Graph | None = None) -> Plan:
    """The Plan of Megatron configuration ``cfg``.

    Raises:
        PlanningError: ``cfg`` does not divide the model or does not fit in memory.
    """
    if isinstance(cluster, str):
        cluster = load_cluster(cluster)
    if cfg.tensor_model_parallel_size * cfg.data_parallel_size != cluster.num_devices:
        raise PlanningError(f"{cfg.label()} needs {cfg.tensor_model_parallel_size * cfg.data_parallel_size}"
                            f" devices but cluster '{cluster.name}' has {cluster.num_devices}")
    graph = graph or trace(model, tuple(example_inputs))
    dtype = str(next(iter(graph.parameters.values())).dtype).replace("torch.", "")
    try:
        result = solve_intra_op(graph, cluster, cfg.mesh_shape, dtype=dtype,
                                time_limit_s=time_limit_s, fixed=megatron_layout(graph, cfg))
    except FixedPlacementError as err:
        raise PlanningError(f"{cfg.label()} does not divide the model: {err}") from err
    if cfg.use_distributed_optimizer and cfg.data_parallel_size > 1:
        result.memory["optimizer"] /= cfg.data_parallel_size  # ZeRO-1 over data parallel
    total = sum(result.memory.values())
    if total > default_memory_budget(cluster):
        raise PlanningError(f"{cfg.label()} needs {total / 2**30:.1f} GiB per device, more than "
                            f"the {default_memory_budget(cluster) / 2**30:.1f} GiB available")
    training = training_record(dtype, "adam", example_inputs, zoo_kwargs,
                               manual={"kind": "megatron", **asdict(cfg)})
    return build_plan(result, cluster, model_record(model, graph, model_source), training)
