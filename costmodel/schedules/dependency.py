"""A schedule's actions in one order that can be timed in a single pass.

Each action waits for its rank's previous action and for the actions that
produce its inputs (the dependencies of the timing model in
:mod:`costmodel.schedules.timing`):

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

from costmodel.schedules.types import OpTuple, ScheduleOp

__all__ = ["DependencyOrder", "dependency_order"]

# The kind part of an action's duration code (see DependencyOrder.steps).
_KIND_CODE = {"F": 0, "B": 1, "I": 2, "W": 3}


@dataclass(frozen=True)
class DependencyOrder:
    """Every rank's actions in one order in which each comes after its
    rank's earlier actions and after the actions it waits for. At position
    ``k`` the action ``ops[k]``, and ``steps[k]`` = (rank, duration code,
    first, first boundary, second, second boundary): the code = kind code
    (F 0, B 1, I 2, W 3) * stages + stage picks its duration; it waits for
    the actions at positions ``first`` and ``second`` (-1: none), each plus
    the p2p latency of that stage boundary (-1: same rank, none). One tuple
    per position, which the timing pass unpacks in one step."""

    steps: list[tuple[int, int, int, int, int, int]]
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
    out = DependencyOrder([], [])
    reached = _place_actions(orders, s2r, out)
    _raise_if_deadlocked(orders, reached, name)
    return out


def _cross_rank_boundaries(s2r: dict[int, int]) -> list[int]:
    """Per stage ``s``: the p2p boundary (``s``) that a dependency between
    stages ``s`` and ``s + 1`` crosses, or -1 when both are on one rank (or
    ``s`` is the last stage)."""
    S = len(s2r)
    return [s if s + 1 < S and s2r[s + 1] != s2r[s] else -1 for s in range(S)]


# The slots of _place_actions' position table: forward, gradient (B or I,
# what the previous stage waits for), I (what a W waits for), and B and W
# (only to catch repeats); and the slots each kind of action fills.
_F, _G, _I, _B, _W = range(5)
_FILLS = {"F": (_F,), "B": (_G, _B), "I": (_G, _I), "W": (_W,)}


def _place_actions(orders: dict[int, Sequence[ScheduleOp]], s2r: dict[int, int],
                   out: DependencyOrder) -> dict[int, int]:
    """Append to ``out`` the actions of :func:`dependency_order`: each rank
    in turn walks its order until an action waits for one not yet placed;
    placing that one wakes the rank again. Returns per rank how many of its
    actions were placed (fewer than it has: it deadlocked). Raises
    ``ValueError`` when an action repeats.

    Actions are ints, ``stage * M + micro-batch`` (``M``: one more than the
    largest micro-batch index), and their positions one flat list, ``slot *
    N + action`` (``N = stages * M``, slots :data:`_F` ... :data:`_W`), -1
    until placed: a search orders schedules of ~400k actions (DeepSeek-V3,
    zbv, pp=16, m=4096)."""
    S = len(s2r)
    M = 1 + max((op[2] for o in orders.values() for op in o), default=0)
    N = S * M
    placed = [-1] * (5 * N)
    g_at, i_at = _G * N, _I * N
    cross_next = _cross_rank_boundaries(s2r)
    waiting: dict[int, list[int]] = {}  # a table index -> the ranks waiting for it
    steps, ops = out.steps, out.ops
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
                    a1, b1 = placed[at - M], cross_next[s - 1]
                    if a1 < 0:
                        waiting.setdefault(at - M, []).append(r)
                        break
            elif kind == "W":
                a1, b1 = placed[i_at + at], -1
                if a1 < 0:
                    waiting.setdefault(i_at + at, []).append(r)
                    break
            else:  # B or I: after its F and the gradient from the next stage
                a1, b1 = placed[at], -1
                if a1 < 0:
                    waiting.setdefault(at, []).append(r)
                    break
                if s < S - 1:
                    a2, b2 = placed[g_at + at + M], cross_next[s]
                    if a2 < 0:
                        waiting.setdefault(g_at + at + M, []).append(r)
                        break
            p += 1
            k = len(steps)
            steps.append((r, _KIND_CODE[kind] * S + s, a1, b1, a2, b2))
            ops.append(op)
            for slot in _FILLS[kind]:
                key = slot * N + at
                if placed[key] >= 0:
                    raise ValueError(f"rank {r}: action {ScheduleOp._make(op)} appears "
                                     f"twice in torch's order")
                placed[key] = k
                woken = waiting.pop(key, None)
                if woken is not None:
                    for other in woken:
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
