"""ZeRO-3's units: the parameters FSDP2 gathers one run of ops at a time.

:func:`shard_units` reads them off a program's layers (:attr:`ir.graph.Graph.layers`,
the repeated blocks of :mod:`ir.repeated_blocks`) and its parameters' module
paths, as torchtitan shards a transformer; the cost model prices them
(:func:`costmodel.strategy_cost.zero3_param_sets`) and the code generator
wraps them (:mod:`codegen.zero3_units`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from ir.graph import Graph
from ir.node import OP, PARAM
from ir.repeated_blocks import block_of

__all__ = ["ShardUnit", "shard_units"]


@dataclass(frozen=True)
class ShardUnit:
    """Parameters that ZeRO-3 shards as one FSDP2 unit: gathered for a run of
    ops alone and resharded after it (:func:`shard_units`).

    Attributes:
        name: module path of the unit (a layer, ``transformer.h.3``, or the
            module owning parameters outside the layers, ``lm_head``).
        ops: names of its op nodes, contiguous in program order: the layer's
            ops, or those from the first to the last that reads the parameters.
        params: names of the parameter nodes only its ops read.
    """

    name: str
    ops: tuple[str, ...]
    params: tuple[str, ...]


def shard_units(graph: Graph, within: Iterable[str] | None = None) -> list[ShardUnit]:
    """The units of ``graph`` (a program: :class:`ir.graph.Graph`, whose layers
    it finds once) that ZeRO-3 gathers one at a time, in program order, as
    torchtitan shards a transformer:

    * each layer whose op nodes are contiguous, with the parameters that no
      op outside the layer reads;
    * outside the layers, the parameters of each module (the embedding, the
      final norm, the head), with the ops from the first to the last that
      reads them, where those overlap no layer and no shorter such run.

    An op reading a view of a parameter reads the parameter. A parameter read
    across units (a tied embedding and head) belongs to none:
    FSDP2 keeps it gathered for the whole pass. ``within``: the op names of
    one pipeline stage, whose units alone are wanted."""
    nodes = list(graph.nodes)
    stage = None if within is None else set(within)
    ops = [n.name for n in nodes if n.kind == OP and (stage is None or n.name in stage)]
    position = {name: i for i, name in enumerate(ops)}
    # a view of a parameter (a transpose for a matmul) is read as the parameter:
    # it shares the storage FSDP2 frees when it reshards
    viewed: dict[str, str] = {n.name: n.name for n in nodes if n.kind == PARAM}
    readers: dict[str, list[int]] = {}
    for n in nodes:
        if n.kind == OP:
            for a in n.args:
                if a in viewed:
                    readers.setdefault(viewed[a], []).append(position.get(n.name, -1))
            if n.is_view and n.args and n.args[0] in viewed:
                viewed[n.name] = viewed[n.args[0]]
    params = [n for n in nodes if n.kind == PARAM and readers.get(n.name)
              and min(readers[n.name]) >= 0]
    kinds = {n.name: n.kind for n in nodes}
    # (first op, last op, name, params) of each candidate
    layers: list[tuple[int, int, str, tuple[str, ...]]] = []
    in_layers: set[str] = set()
    for layer in graph.layers:
        layer_ops = [m for m in layer.nodes if kinds.get(m) == OP]
        layer_params = [p for p in params if block_of(p.fqn or "") == layer.name]
        in_layers.update(p.name for p in layer_params)
        if not layer_ops or any(m not in position for m in layer_ops):
            continue
        idx = sorted(position[m] for m in layer_ops)
        if idx[-1] - idx[0] + 1 != len(idx):
            continue
        mine = tuple(p.name for p in layer_params
                     if idx[0] <= min(readers[p.name]) and max(readers[p.name]) <= idx[-1])
        if mine:
            layers.append((idx[0], idx[-1], layer.name, mine))
    owned: dict[str, list[str]] = {}
    for p in params:
        owner = (p.fqn or "").rpartition(".")[0]
        if p.name not in in_layers and owner:
            owned.setdefault(owner, []).append(p.name)
    modules = [(min(min(readers[p]) for p in members), max(max(readers[p]) for p in members),
                owner, tuple(members)) for owner, members in owned.items()]

    def overlap(a: tuple, b: tuple) -> bool:
        return a[0] <= b[1] and b[0] <= a[1]

    spans = list(layers)
    for m in sorted(modules, key=lambda m: (m[1] - m[0], m)):  # the shortest first
        if not any(overlap(m, other) for other in spans):
            spans.append(m)
    return [ShardUnit(name, tuple(ops[first: last + 1]), mine)
            for first, last, name, mine in sorted(spans)]
