"""Layers: the repeated blocks of a model, found by module path and structure.

A block is the set of graph nodes issued under one indexed child of a module
list (``transformer.h.3`` for every path ``transformer.h.3.*``), together with the
parameters it reads. Two blocks with the same :attr:`Layer.signature` compute the
same thing on tensors of the same shapes, so the planner may treat their nodes
position by position as one.

Blocks are read off the nodes alone, so :class:`ir.graph.Graph` finds its own
once (``Graph.layers``); the pipeline layers built on them are
:mod:`ir.layers`, the units ZeRO-3 shards :mod:`ir.shard_units`.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass
from typing import Iterable

from ir.node import OP, PARAM, Node


@dataclass(frozen=True)
class Layer:
    """One repeated block.

    Attributes:
        name: module path of the block (``transformer.h.3``).
        nodes: names of its nodes in program order.
        signature: structural hash; equal for blocks that compute the same thing.
    """

    name: str
    nodes: tuple[str, ...]
    signature: str


@functools.lru_cache(maxsize=1 << 16)
def block_of(path: str) -> str | None:
    """``transformer.h.3.attn.c_attn`` -> ``transformer.h.3``; None outside lists.
    Memoised: a program's few thousand module paths are asked millions of
    times (ZeRO-3 units of every stage: 2.0M calls in a llama3-405b search)."""
    parts = path.split(".") if path else []
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return None


def _node_block(node: Node) -> str | None:
    if node.kind == PARAM:
        return block_of(node.fqn or "")
    if node.kind == OP:
        return block_of(node.module_path)
    return None


def _first_shape(node: Node) -> list[int]:
    """Shape of ``node``'s first output, as a list ([] when it has none)."""
    return list(node.outputs[0].shape) if node.outputs else []


def find_layers(nodes: Iterable[Node]) -> list[Layer]:
    """Blocks under indexed module-list children of a program's ``nodes`` (a
    :class:`ir.graph.Graph` itself, or its nodes), in program order."""
    nodes = list(nodes)
    by_name = {n.name: n for n in nodes}
    members: dict[str, list[Node]] = {}
    for n in nodes:
        block = _node_block(n)
        if block is not None:
            members.setdefault(block, []).append(n)
    layers = []
    for name, block_nodes in members.items():
        position = {n.name: i for i, n in enumerate(block_nodes)}
        records = []
        for n in block_nodes:
            args = [["in", position[a]] if a in position else ["ext", _first_shape(by_name[a])]
                    for a in n.args]
            records.append([n.kind, n.target if n.kind == OP else "", n.arg_index, args,
                            [o.to_json() for o in n.outputs]])
        digest = hashlib.sha256(json.dumps(records).encode()).hexdigest()[:16]
        layers.append(Layer(name=name, nodes=tuple(n.name for n in block_nodes), signature=digest))
    return layers
