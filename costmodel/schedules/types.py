"""The values the pipeline schedule modules hand around: a rank's compute
actions, per-rank orders, and a timed step.

Units: seconds (times), bytes (activation sizes), counts otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

__all__ = ["OpTuple", "ScheduleOp", "ScheduleResult", "TimedAction", "TorchOrders"]


class ScheduleOp(NamedTuple):
    """One compute action of a rank, as torch labels it.

    ``kind``: "F" (FORWARD), "B" (FULL_BACKWARD), "I" (BACKWARD_INPUT) or
    "W" (BACKWARD_WEIGHT). ``overlap_group``: for the sub-actions of one torch
    OVERLAP_F_B action, the position of that action in the rank's compute
    list; None otherwise.
    """

    kind: str
    stage: int
    microbatch: int
    overlap_group: int | None = None

    def __str__(self) -> str:  # torch's _Action repr, e.g. "3F0", "5W2"
        return f"{self.stage}{self.kind}{self.microbatch}"


# One compute action as the orders are kept: ScheduleOp's fields as a plain
# tuple (kind, stage, micro-batch, overlap group), cheaper to make and to send
# between processes than the named tuple; rank_orders hands out ScheduleOps.
OpTuple = tuple[str, int, int, "int | None"]
# Per-rank orders and the stage -> rank map of one schedule shape.
TorchOrders = tuple[dict[int, tuple[OpTuple, ...]], dict[int, int]]


@dataclass(frozen=True)
class TimedAction:
    """One executed action: seconds from the start of the step."""

    rank: int
    action: str  # torch-style label, e.g. "4I1"
    kind: str
    stage: int
    microbatch: int
    start: float
    end: float
    overlap_group: int | None = None


@dataclass
class ScheduleResult:
    """What :func:`costmodel.schedules.simulate` returns. Times in seconds;
    per-rank lists by rank."""

    schedule: str
    pp: int
    stages_per_rank: int
    num_microbatches: int
    step_time: float
    busy: list[float]
    idle: list[float]
    bubble_ratio: float
    bubble_fraction: float
    peak_activations: list[int]
    peak_activation_bytes: list[float] | None
    stage_to_rank: dict[int, int]
    timeline: list[TimedAction] = field(repr=False)

    @property
    def num_stages(self) -> int:
        return self.pp * self.stages_per_rank

    def rank_timeline(self, rank: int) -> list[TimedAction]:
        """The actions of ``rank`` in execution order."""
        return [a for a in self.timeline if a.rank == rank]
