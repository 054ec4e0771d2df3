"""A schedule's actions in one order that can be timed in a single pass.

Each action waits for its rank's previous action and for the actions that
produce its inputs (the dependencies of the timing model in
:mod:`costmodel.schedule_timing`):

* ``F(s, j)`` after ``F(s-1, j)``;
* ``B|I(s, j)`` after ``F(s, j)`` and after ``B|I(s+1, j)`` (the action that
  produces the input gradient; for the last stage the loss is computed inside
  its F);
* ``W(s, j)`` after ``I(s, j)``.

A dependency between stages on different ranks crosses a p2p stage
boundary; stages on the same rank (the V-schedule turn at ``pp-1``/``pp``)
pass tensors locally, at no cost. :func:`dependency_order` lists every rank's
actions so that each comes after all it waits for, with those dependencies
as positions in the list; timing is then one pass over it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from costmodel.schedule_types import OpTuple, ScheduleOp

__all__ = ["DependencyOrder", "dependency_order"]

# The kind part of an action's duration code (see DependencyOrder.codes).
_KIND_CODE = {"F": 0, "B": 1, "I": 2, "W": 3}


@dataclass(frozen=True)
class DependencyOrder:
    """Every rank's actions in one order in which each comes after its
    rank's earlier actions and after the actions it waits for, column-wise
    (lists indexed by position in the order; timing walks them together):
    at position ``k`` the action ``ops[k]`` of rank ``ranks[k]``; ``codes[k]``
    = kind code (F 0, B 1, I 2, W 3) * stages + stage, which picks its
    duration; it waits for the actions at positions ``first[k]`` and
    ``second[k]`` (-1: none), each plus the p2p latency of stage boundary
    ``first_boundary[k]`` / ``second_boundary[k]`` (-1: same rank, none)."""

    ranks: list[int]
    codes: list[int]
    first: list[int]
    first_boundary: list[int]
    second: list[int]
    second_boundary: list[int]
    ops: list[OpTuple]


def dependency_order(orders: dict[int, Sequence[ScheduleOp]], s2r: dict[int, int],
                     name: str) -> DependencyOrder:
    """Every rank's actions (``orders``, ranks placed by the stage -> rank
    map ``s2r``) in one order in which each comes after its rank's earlier
    actions and after the actions it waits for: an F after the F of the
    previous stage, a B or I after its F and the gradient of the next stage
    (that stage's B or I), a W after its I. Timing is then one pass over it.
    Raises ``ValueError`` (naming schedule ``name``) when the orders deadlock
    or an action repeats."""
    out = DependencyOrder([], [], [], [], [], [], [])
    reached = _place_actions(orders, s2r, out)
    _raise_if_deadlocked(orders, reached, name)
    return out


def _cross_rank_boundaries(s2r: dict[int, int]) -> list[int]:
    """Per stage ``s``: the p2p boundary (``s``) that a dependency between
    stages ``s`` and ``s + 1`` crosses, or -1 when both are on one rank (or
    ``s`` is the last stage)."""
    S = len(s2r)
    return [s if s + 1 < S and s2r[s + 1] != s2r[s] else -1 for s in range(S)]


def _placement_tables(orders: dict[int, Sequence[ScheduleOp]], S: int
                      ) -> tuple[int, dict[str, list[int]]]:
    """How :func:`_place_actions` names the actions of ``orders`` (``S``
    stages) and keeps where each was placed: actions are ints,
    ``stage * M + micro-batch`` (``M``, returned: one more than the largest
    micro-batch index), and their positions are lists per kind, -1 until
    placed (F, gradient G = B or I, I, and B and W to catch repeats): a
    search orders schedules of ~150k actions (gpt3-175b, m = 1536)."""
    M = 1 + max((op[2] for o in orders.values() for op in o), default=0)
    return M, {kind: [-1] * (S * M) for kind in "FGIBW"}


def _place_actions(orders: dict[int, Sequence[ScheduleOp]], s2r: dict[int, int],
                   out: DependencyOrder) -> dict[int, int]:
    """Append to ``out`` the actions of :func:`dependency_order`: each rank
    in turn walks its order until an action waits for one not yet placed;
    placing that one wakes the rank again. Returns per rank how many of its
    actions were placed (fewer than it has: it deadlocked). Raises
    ``ValueError`` when an action repeats."""
    S = len(s2r)
    M, placed = _placement_tables(orders, S)
    pos_f, pos_g, pos_i = placed["F"], placed["G"], placed["I"]
    cross_next = _cross_rank_boundaries(s2r)
    waiting: dict[tuple[str, int], list[int]] = {}
    ranks, codes, first, first_b, second, second_b, ops = (
        out.ranks, out.codes, out.first, out.first_boundary, out.second,
        out.second_boundary, out.ops)
    ptr = {r: 0 for r in orders}
    ready = deque(sorted(orders))
    queued = set(orders)
    while ready:
        r = ready.popleft()
        queued.discard(r)
        order = orders[r]
        p = ptr[r]
        while p < len(order):
            op = order[p]
            kind, s, j = op[0], op[1], op[2]
            at = s * M + j
            a2 = b2 = -1
            if kind == "F":
                if s == 0:
                    a1 = b1 = -1
                else:
                    a1, b1 = pos_f[at - M], cross_next[s - 1]
                    if a1 < 0:
                        waiting.setdefault(("F", at - M), []).append(r)
                        break
            elif kind == "W":
                a1, b1 = pos_i[at], -1
                if a1 < 0:
                    waiting.setdefault(("I", at), []).append(r)
                    break
            else:  # B or I: after its F and the gradient from the next stage
                a1, b1 = pos_f[at], -1
                if a1 < 0:
                    waiting.setdefault(("F", at), []).append(r)
                    break
                if s < S - 1:
                    a2, b2 = pos_g[at + M], cross_next[s]
                    if a2 < 0:
                        waiting.setdefault(("G", at + M), []).append(r)
                        break
            p += 1
            k = len(ranks)
            ranks.append(r)
            codes.append(_KIND_CODE[kind] * S + s)
            first.append(a1)
            first_b.append(b1)
            second.append(a2)
            second_b.append(b2)
            ops.append(op)
            done = (kind, "G") if kind in ("B", "I") else (kind,)
            for key in done:
                where = placed[key]
                if where[at] >= 0:
                    raise ValueError(f"rank {r}: action {ScheduleOp._make(op)} appears "
                                     f"twice in torch's order")
                where[at] = k
                for other in waiting.pop((key, at), ()):
                    if other not in queued:
                        queued.add(other)
                        ready.append(other)
        ptr[r] = p
    return ptr


def _raise_if_deadlocked(orders: dict[int, Sequence[ScheduleOp]], reached: dict[int, int],
                         name: str) -> None:
    """``ValueError`` naming the action each rank is blocked at, when some
    rank's order was not placed to its end (``reached``: placed per rank)."""
    stuck = {r: str(ScheduleOp._make(orders[r][reached[r]])) for r in sorted(orders)
             if reached[r] < len(orders[r])}
    if stuck:
        raise ValueError(f"{name}: schedule deadlocks; ranks blocked at {stuck}")
