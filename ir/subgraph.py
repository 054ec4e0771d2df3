"""The part of a captured graph that one pipeline stage runs.

:func:`subgraph` keeps a set of op nodes with the parameters and buffers they
read; every value they read from outside (an earlier stage's activation, a user
input) becomes an ``input`` node of the same name, so node names stay those of
the whole program and a stage's placements can be merged back into one plan.
"""

from __future__ import annotations

from typing import Iterable

from ir.graph import BUFFER, INPUT, OP, PARAM, Graph, Node


def boundary_values(graph: Graph, stage_ops: list[Iterable[str]]) -> list[tuple[list[str], list[str]]]:
    """For consecutive stages (lists of op names covering all ops in program
    order): the values each stage receives and the values it sends on.

    A value is received by stage ``s`` when an op of ``s`` or of a later stage
    reads it and it was produced before ``s`` (user inputs count as produced
    before stage 0); the last stage sends the program's outputs.
    """
    owner: dict[str, int] = {}
    for s, ops in enumerate(stage_ops):
        for name in ops:
            owner[name] = s
    last_reader: dict[str, int] = {}
    for n in graph.nodes:
        if n.kind == OP:
            for a in n.args:
                if graph[a].kind in (OP, INPUT):
                    last_reader[a] = max(last_reader.get(a, -1), owner[n.name])
    if not stage_ops:
        return []
    # each value goes from the stage after its owner up to its last reader:
    # one pass over the nodes in program order (stages x nodes took 1.3 s
    # per call for gpt3-175b's 98 layers)
    recv: list[list[str]] = [[] for _ in stage_ops]
    send: list[list[str]] = [[] for _ in stage_ops]
    for n in graph.nodes:
        last = last_reader.get(n.name)
        if n.kind not in (OP, INPUT) or last is None:
            continue
        first = owner.get(n.name, -1)
        for s in range(first + 1, last + 1):
            recv[s].append(n.name)
        for s in range(max(first, 0), last):
            send[s].append(n.name)
    send[-1] = list(graph.output_names)
    return list(zip(recv, send))


def subgraph(graph: Graph, ops: Iterable[str], receives: Iterable[str],
             sends: Iterable[str]) -> Graph:
    """The program of one stage: ``ops`` with the parameters/buffers they read,
    ``receives`` as input nodes, returning ``sends``."""
    keep = set(ops)
    receives = list(receives)
    nodes: list[Node] = []
    for name in receives:
        src = graph[name]
        nodes.append(Node(name=name, kind=INPUT, target=name, outputs=(src.outputs[0],)))
    used = {a for name in keep for a in graph[name].args}
    for n in graph.nodes:
        if n.kind in (PARAM, BUFFER) and n.name in used:
            nodes.append(n)
    nodes += [n for n in graph.nodes if n.name in keep]
    grad_inputs = tuple(name for name in receives if graph[name].kind == OP
                        and graph[name].outputs[0].is_float)
    return Graph(nodes=nodes, output_names=tuple(sends), model_name=graph.model_name,
                 exported=graph.exported, grad_inputs=grad_inputs,
                 buffer_updates={v: b for v, b in graph.buffer_updates.items() if v in keep})
