"""The context-parallel rules both the search and the runtime read.

Which values of a cp rank's program hold token rows (:func:`carries_rows`),
and how many copies of each K/V head an attention input holds after
grouped-query attention's repeat (:func:`kv_head_repeats`,
:func:`local_kv_repeats`): the search prices the exchange by them
(:mod:`planner.search.cp_search`) and the runtime exchanges by them
(:mod:`codegen.context_parallel`), so the two agree by construction.

Units: counts (rows, heads).
"""

from __future__ import annotations

import math
from typing import Any

from ir.graph import INPUT, Graph

__all__ = ["carries_rows", "kv_head_repeats", "local_kv_repeats"]


# ops that pass K or V on unchanged in value between grouped-query attention's
# repeat and the attention (views aside)
_KV_COPIES = {"aten.clone.default", "aten._unsafe_view.default"}


def kv_head_repeats(graph: Graph, node: Any, index: int) -> int:
    """How many times, side by side, each K/V head appears in input ``index``
    (1: k, 2: v) of attention op ``node``: ``n_rep`` where the input is
    grouped-query attention's repeat, an ``expand`` of ``[..., kv, 1, d]`` to
    ``[..., kv, n_rep, d]`` whose two head dims a reshape then merges into the
    attention's heads (head ``g n_rep + r`` is K/V head ``g``), with only
    views and copies between; 1 for any other input. A cp rank sends each K/V
    head once (:func:`local_kv_repeats`; codegen.context_parallel)."""
    heads = (node.inputs[index] if node.inputs else graph[node.args[index]].outputs[0]).shape[1]
    name, after = node.args[index], []  # shapes between the op reached and the attention
    while True:
        n = graph[name]
        shape = tuple(n.outputs[0].shape)
        if n.target == "aten.expand.default" and n.args:
            merged = next((s for s in reversed(after) if len(s) != len(shape)), None)
            return _merged_repeat(tuple(graph[n.args[0]].outputs[0].shape), shape, merged, heads)
        if not n.args or not (n.is_view or n.target in _KV_COPIES):
            return 1
        after.append(shape)
        name = n.args[0]


def _merged_repeat(source: tuple[int, ...], expanded: tuple[int, ...],
                   merged: tuple[int, ...] | None, heads: int) -> int:
    """``n_rep`` where ``expanded`` grows one size-1 dim of ``source`` right
    after a dim of K/V heads and ``merged`` joins the two, minor-most the
    repeat, into one dim of ``heads``; else 1."""
    grown = [d for d, (a, b) in enumerate(zip(source, expanded)) if a != b]
    if merged is None or len(source) != len(expanded) or len(grown) != 1:
        return 1
    e = grown[0]
    if e == 0 or source[e] != 1 or expanded[e - 1] * expanded[e] != heads:
        return 1
    outer, inner = math.prod(expanded[:e - 1]), math.prod(expanded[e + 1:])
    for j, size in enumerate(merged):
        if size == heads and math.prod(merged[:j]) == outer and math.prod(merged[j + 1:]) == inner:
            return expanded[e]
    return 1


def local_kv_repeats(n_rep: int, local_heads: int) -> int:
    """Copies of each K/V head among a device's ``local_heads`` consecutive
    heads of an input with ``n_rep`` (:func:`kv_head_repeats`): the devices'
    blocks of heads begin at multiples of ``local_heads``, so runs of
    ``gcd(n_rep, local_heads)`` heads are one K/V head."""
    return math.gcd(n_rep, local_heads)


def carries_rows(node: Any, rows: int, carried: set[str]) -> bool:
    """Whether graph ``node`` of a cp rank's program holds token rows: it is
    computed from an input of ``rows`` batch rows (``carried``: the names of
    the nodes before it that do, which it adds itself to) and its first
    output's dim 0 is a multiple of ``rows`` (the rows, or rows x tokens)."""
    if node.kind == INPUT:
        held = bool(node.output.shape) and node.output.shape[0] == rows
    else:
        held = any(a in carried for a in node.args)
    if held:
        carried.add(node.name)
    out = node.outputs[0].shape if node.outputs else ()
    return held and bool(out) and out[0] % rows == 0
