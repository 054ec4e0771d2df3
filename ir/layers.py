"""Layers: the repeated blocks of a model, found by module path and structure.

A block is the set of graph nodes issued under one indexed child of a module
list (``transformer.h.3`` for every path ``transformer.h.3.*``), together with the
parameters it reads. Two blocks with the same :attr:`Layer.signature` compute the
same thing on tensors of the same shapes, so the planner may treat their nodes
position by position as one.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from ir.graph import OP, PARAM, Graph, Node


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


def _block_of(path: str) -> str | None:
    """``transformer.h.3.attn.c_attn`` -> ``transformer.h.3``; None outside lists."""
    parts = path.split(".") if path else []
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return None


def _node_block(node: Node) -> str | None:
    if node.kind == PARAM:
        return _block_of(node.fqn or "")
    if node.kind == OP:
        return _block_of(node.module_path)
    return None


def find_layers(graph: Graph) -> list[Layer]:
    """Blocks of ``graph`` under indexed module-list children, in program order."""
    members: dict[str, list[Node]] = {}
    for n in graph.nodes:
        block = _node_block(n)
        if block is not None:
            members.setdefault(block, []).append(n)
    layers = []
    for name, nodes in members.items():
        position = {n.name: i for i, n in enumerate(nodes)}
        records = []
        for n in nodes:
            args = [["in", position[a]] if a in position else ["ext", list(graph[a].outputs[0].shape)
                                                              if graph[a].outputs else []]
                    for a in n.args]
            records.append([n.kind, n.target if n.kind == OP else "", n.arg_index, args,
                            [o.to_json() for o in n.outputs]])
        digest = hashlib.sha256(json.dumps(records).encode()).hexdigest()[:16]
        layers.append(Layer(name=name, nodes=tuple(n.name for n in nodes), signature=digest))
    return layers
