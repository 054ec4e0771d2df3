"""Reusing one pipeline stage's intra-op solution for another stage of the same structure.

Deep models cut into many stages repeat themselves: gpt3-175b on 64 stages has
dozens of stages of one or two identical blocks, which differ only in their
node names and in how many micro-batches' activations they hold at once (a
1F1B stage ``s`` keeps ``pp - s``). The exact stage solve is then the same
problem again up to the activation-memory factor, and the answer carries over:

* :func:`node_map` checks that two stage graphs are the same program node for
  node (kind, op, shapes, FLOPs, bytes and wiring) and maps the names;
* :func:`moved_result` is the first stage's solution written with the second
  stage's names and its number of in-flight micro-batches (saved activations
  scale with that number; nothing else depends on it).

Why the answer stays optimal: more in-flight copies only add memory, so the
problem with ``c`` copies is a relaxation of the one with ``c' >= c`` under the
same budget and objective (seconds). The optimum of the relaxation that also
fits the tighter budget is optimal there too. Callers therefore reuse a
solution only for stages with at least as many copies, and only when it fits.
"""

from __future__ import annotations

import dataclasses

from ir.graph import OP, Graph
from planner.ilp.intra_op import IntraOpResult
from planner.ilp.strategies import NodeStrategies


def node_map(src: Graph, dst: Graph) -> dict[str, str] | None:
    """``src`` node name -> ``dst`` node name when the two graphs are the same
    program (position by position: kind, operator, tensor shapes and dtypes,
    FLOPs, bytes and argument wiring; parameter and input names may differ);
    None when they are not."""
    if len(src.nodes) != len(dst.nodes):
        return None
    names: dict[str, str] = {}
    for a, b in zip(src.nodes, dst.nodes):
        if (a.kind != b.kind or (a.kind == OP and a.target != b.target)
                or a.arg_index != b.arg_index or a.inputs != b.inputs or a.outputs != b.outputs
                or a.flops != b.flops or a.bytes_moved != b.bytes_moved
                or tuple(names.get(x) for x in a.args) != b.args):
            return None
        names[a.name] = b.name
    return names


def total_memory(result: IntraOpResult) -> float:
    """Bytes per device of a stage solution (parameters, gradients, optimizer
    states and the saved activations of its in-flight micro-batches)."""
    return float(sum(result.memory.values()))


def moved_result(result: IntraOpResult, graph: Graph, copies_ratio: float
                 ) -> IntraOpResult | None:
    """``result`` (a solution of another stage) for the stage ``graph``, which
    keeps ``copies_ratio`` times as many micro-batches' activations; None when
    ``graph`` is not the same program as ``result.graph``."""
    names = node_map(result.graph, graph)
    if names is None:
        return None
    layers: dict[str, str] = {}
    if result.checkpointed:  # layer names, only when there are some to map
        layers = dict(zip((l.name for l in result.graph.layers),
                          (l.name for l in graph.layers)))
        if any(name not in layers for name in result.checkpointed):
            return None
    by_name = {n.name: n for n in graph.nodes}
    memory = dict(result.memory)
    if "activations" in memory:
        memory["activations"] *= copies_ratio
    return dataclasses.replace(
        result, graph=graph,
        strategies=[NodeStrategies(by_name[names[ns.node.name]], ns.strategies, ns.fallback)
                    for ns in result.strategies],
        chosen={names[k]: s for k, s in result.chosen.items()},
        memory=memory, checkpointed=[layers[name] for name in result.checkpointed])
