"""Peak live activations per rank of a schedule's per-rank orders, and
each rank's peak bytes over a step (:func:`rank_step_peaks`).

Units: counts of activations; bytes where activation sizes are given.

Activation convention: one "activation" is one micro-batch's saved state of
one stage. It becomes alive when its ``F`` starts (+1) and is freed when the
action that finishes its backward ends (-1): the ``B`` for a full backward,
the ``W`` for a split one (``I`` keeps the tensors that ``W`` still needs).
Actions on a rank run one at a time, so the running count (and its peak)
depends only on torch's order, not on the times. Bytes per stage weight the
count into peak bytes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

from costmodel.schedules.types import ScheduleOp

__all__ = ["StageBytes", "live_activation_peaks", "rank_step_peaks", "stage_counts_at_peak"]


def live_activation_peaks(orders: dict[int, Sequence[ScheduleOp]], pp: int,
                          act_b: list[float] | None) -> tuple[list[int], list[float] | None]:
    """Per-rank peak count of live activations of ranks ``0..pp-1`` (and,
    given bytes per stage ``act_b``, peak bytes): +1 at an F, -1 at the B or
    W that ends its backward."""
    peaks: list[int] = []
    peak_bytes: list[float] | None = [] if act_b is not None else None
    for r in range(pp):
        alive = peak = 0
        alive_b = peak_b = 0.0
        for op in orders[r]:
            kind = op[0]
            if kind == "F":
                alive += 1
                peak = max(peak, alive)
                if act_b is not None:
                    alive_b += act_b[op[1]]
                    peak_b = max(peak_b, alive_b)
            elif kind in ("B", "W"):
                alive -= 1
                if act_b is not None:
                    alive_b -= act_b[op[1]]
        peaks.append(peak)
        if peak_bytes is not None:
            peak_bytes.append(peak_b)
    return peaks, peak_bytes


def stage_counts_at_peak(orders: dict[int, Sequence[ScheduleOp]], pp: int,
                         act_b: dict[int, float] | None = None) -> dict[int, int]:
    """Each stage's live activations at its rank's peak: the count of the
    stage's micro-batches alive at the first moment the rank's live
    activations (weighted by bytes per stage ``act_b`` when given, else
    counted) are at their peak; +1 at an F, -1 at the B or W that ends its
    backward, as :func:`live_activation_peaks` counts.

    Stages of one rank need not hold equal shares of its peak: under
    torch's interleaved 1F1B (pp=16, v=8, m=32) the last rank's final stage
    (the head and loss of Llama 3's layout) has one micro-batch alive at a
    time and the rank's seven other stages 16 each, 113 in all; an even
    share gives the head 14 of them. Summing each stage's own maximum
    over-counts the other way (192 for the first rank, whose peak is 143:
    its stages peak at different moments)."""
    counts: dict[int, int] = {}
    for r in range(pp):
        alive: dict[int, int] = {}
        total = peak = 0.0
        at_peak: dict[int, int] = {}
        for op in orders[r]:
            kind, stage = op[0], op[1]
            if kind == "F":
                alive[stage] = alive.get(stage, 0) + 1
                total += act_b[stage] if act_b is not None else 1.0
                if total > peak:
                    peak, at_peak = total, dict(alive)
            elif kind in ("B", "W"):
                alive[stage] -= 1
                total -= act_b[stage] if act_b is not None else 1.0
        for stage in alive:
            counts[stage] = at_peak.get(stage, 0)
    return counts


class StageBytes(NamedTuple):
    """One stage's memory per device for :func:`rank_step_peaks`, in bytes.

    ``held``: alive throughout (parameters, optimizer states). ``activation``:
    one micro-batch's saved activations. ``grads``: the stage's gradients,
    alive from its first backward on (set to None after each step).
    ``first_backward``: the most its first backward holds beyond the
    activations alive (the gradients made so far, an op's transient, less
    what it has freed: ``IntraOpCost.backward_excess``). ``later_backward``:
    the same in a later backward, its gradients already whole. ``update``:
    beyond ``held`` at the optimizer step (``costmodel.memory.optimizer_step_bytes``).
    """

    held: float
    activation: float
    grads: float
    first_backward: float
    later_backward: float
    update: float


def rank_step_peaks(orders: dict[int, Sequence[ScheduleOp]], pp: int,
                    stages: Mapping[int, StageBytes]) -> list[float]:
    """Peak bytes of each rank ``0..pp-1`` over one step in torch's order:
    its stages' ``held`` bytes, plus the most of (the activations alive and
    the gradients made, at each action: an F adds a micro-batch's
    activations; a B, or the W of a split backward, holds its
    ``first_backward`` or ``later_backward`` bytes on top, then frees the
    micro-batch's activations and leaves the stage's gradients whole; an I
    holds ``later_backward``) and the optimizer step (their ``update``)."""
    peaks: list[float] = []
    for r in range(pp):
        alive = made = peak = 0.0
        done: set[int] = set()
        for op in orders[r]:
            kind, stage = op[0], op[1]
            b = stages[stage]
            if kind == "F":
                alive += b.activation
                peak = max(peak, alive + made)
            elif kind == "I":
                peak = max(peak, alive + made + b.later_backward)
            elif kind in ("B", "W"):
                first = stage not in done
                peak = max(peak, alive + made + (b.first_backward if first else b.later_backward))
                alive -= b.activation
                if first:
                    made += b.grads
                    done.add(stage)
        mine = {op[1] for op in orders[r]}
        update = sum(stages[s].update for s in mine)
        peaks.append(sum(stages[s].held for s in mine) + max(peak, update))
    return peaks
