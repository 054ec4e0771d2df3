"""The pipeline schedules torch.distributed.pipelining runs: one
:class:`ScheduleSpec` per schedule, the only place their names and traits
are written.

Units: counts (ranks, stages, micro-batches).

What torch's classes tell, the spec asks them: whether a schedule runs one
stage per rank (a ``PipelineScheduleSingle`` subclass) and which rank runs
each stage (torch's ``generate_stage_to_rank_mapping`` for the spec's
style). What torch only checks when a schedule is built is written here
and tested against it: ZBV and DualPipeV run exactly two stages per rank,
placed in a V; 1F1B and DualPipeV need at least as many micro-batches as
stages.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

__all__ = [
    "LOOPED_STAGES_PER_RANK",
    "SCHEDULES",
    "SCHEDULE_SPECS",
    "ScheduleSpec",
    "canonical_schedule",
    "default_stages_per_rank",
    "schedule_spec",
]

# Stages per rank of a looped multi-stage schedule when none is given.
LOOPED_STAGES_PER_RANK = 2
# Stages per rank of a V-style schedule (torch accepts no other count).
V_STAGES_PER_RANK = 2


def _alias_key(name: str) -> str:
    """``name`` as the alias table files it: lower case, no '_', '-' or ' '."""
    return name.lower().replace("_", "").replace("-", "").replace(" ", "")


@dataclass(frozen=True)
class ScheduleSpec:
    """One pipeline schedule of torch.distributed.pipelining.

    ``name``: the canonical name; ``torch_class``: its class name in
    ``torch.distributed.pipelining.schedules``; ``style``: how stages sit on
    ranks, "loop" (stage ``s`` on rank ``s % pp``) or "v" (rank ``r`` runs
    stages ``r`` and ``2 pp - 1 - r``); ``microbatch_per_stage``: torch
    refuses fewer micro-batches than stages; ``aliases``: further names it
    is known by (besides the canonical name, the class name and the class
    name without "Schedule"); ``splits_backward``: its backward runs as an
    input-gradient pass and a later weight-gradient pass (torch's ``I`` and
    ``W`` actions).
    """

    name: str
    torch_class: str
    style: str = "loop"
    microbatch_per_stage: bool = False
    aliases: tuple[str, ...] = ()
    splits_backward: bool = False

    def zero_stage_problem(self, zero_stage: int) -> str | None:
        """Why stages of ZeRO stage ``zero_stage`` cannot run under this schedule
        (a sentence that ends with what to do), or None: ZeRO-3 reshards each
        unit after its backward (:mod:`codegen.zero3_units`), which a
        separate weight-gradient pass would find resharded."""
        if zero_stage == 3 and self.splits_backward:
            return (f"ZeRO-3 stages gather and reshard unit by unit in each backward, and "
                    f"{self.name} computes weight gradients in a separate pass after it; "
                    f"use ZeRO-2 (or 1) with {self.name}, or a schedule without a split "
                    f"backward (1f1b, gpipe, interleaved_1f1b)")
        return None

    @property
    def torch_type(self) -> type:
        """The torch schedule class (imports torch's pipelining on first use)."""
        from torch.distributed.pipelining import schedules

        return getattr(schedules, self.torch_class)

    @property
    def single_stage(self) -> bool:
        """Whether torch runs it with one stage per rank (a ``PipelineScheduleSingle``)."""
        from torch.distributed.pipelining.schedules import PipelineScheduleSingle

        return issubclass(self.torch_type, PipelineScheduleSingle)

    @property
    def default_stages_per_rank(self) -> int:
        """Stages per rank when none is given: 1 for a single-stage schedule,
        2 for a V, :data:`LOOPED_STAGES_PER_RANK` for a looped one."""
        if self.single_stage:
            return 1
        return V_STAGES_PER_RANK if self.style == "v" else LOOPED_STAGES_PER_RANK

    def stages_per_rank(self, v: int | None = None) -> int:
        """``v`` checked against what torch runs (the default when None);
        ``ValueError`` for a count torch refuses."""
        if v is None:
            return self.default_stages_per_rank
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"stages_per_rank must be an integer >= 1, got {v!r}")
        if self.single_stage and v != 1:
            raise ValueError(f"{self.name} runs one stage per rank, got stages_per_rank={v}")
        if self.style == "v" and v != V_STAGES_PER_RANK:
            raise ValueError(f"{self.name} runs exactly {V_STAGES_PER_RANK} stages per rank, "
                             f"got stages_per_rank={v}")
        return v

    def min_microbatches(self, pp: int, v: int | None = None) -> int:
        """The fewest micro-batches torch accepts with ``pp`` ranks of ``v``
        stages (default: :attr:`default_stages_per_rank`)."""
        return pp * self.stages_per_rank(v) if self.microbatch_per_stage else 1

    def stage_to_rank(self, pp: int, v: int | None = None) -> dict[int, int]:
        """Pipeline rank of every global stage (``pp * v`` of them), as torch
        places them (``generate_stage_to_rank_mapping`` of the spec's style)."""
        from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

        return generate_stage_to_rank_mapping(pp, pp * self.stages_per_rank(v), style=self.style)

    def rank_stages(self, pp: int, rank: int, v: int | None = None) -> list[int]:
        """The global stages ``rank`` runs, in stage order."""
        return [s for s, r in self.stage_to_rank(pp, v).items() if r == rank]

    @property
    def names(self) -> tuple[str, ...]:
        """Every name :func:`canonical_schedule` takes for it (alias keys)."""
        short = self.torch_class.removeprefix("Schedule")
        return tuple(dict.fromkeys(_alias_key(n) for n in (
            self.name, self.torch_class, short, *self.aliases)))


#: Canonical schedule name -> its spec, in the order the search lists them.
SCHEDULE_SPECS: Mapping[str, ScheduleSpec] = MappingProxyType({spec.name: spec for spec in (
    ScheduleSpec("gpipe", "ScheduleGPipe"),
    ScheduleSpec("1f1b", "Schedule1F1B", microbatch_per_stage=True),
    ScheduleSpec("interleaved_1f1b", "ScheduleInterleaved1F1B"),
    ScheduleSpec("looped_bfs", "ScheduleLoopedBFS"),
    ScheduleSpec("interleaved_zero_bubble", "ScheduleInterleavedZeroBubble",
                 aliases=("interleavedzb", "zb1p"), splits_backward=True),
    ScheduleSpec("zbv", "ScheduleZBVZeroBubble", style="v", splits_backward=True),
    ScheduleSpec("dualpipev", "ScheduleDualPipeV", style="v", microbatch_per_stage=True,
                 splits_backward=True),
)})
SCHEDULES: tuple[str, ...] = tuple(SCHEDULE_SPECS)

# Alias key (see _alias_key) -> canonical name.
_BY_ALIAS: Mapping[str, str] = MappingProxyType(
    {key: spec.name for spec in SCHEDULE_SPECS.values() for key in spec.names})


def canonical_schedule(name: str) -> str:
    """Canonical name (a key of :data:`SCHEDULE_SPECS`) for ``name``.

    Accepts the canonical names, torch's class names and the names of
    ``torch.distributed.pipelining.schedules.get_schedule_class`` ("GPipe",
    "Interleaved1F1B", "ZBVZeroBubble", ...), case-, '-' and '_'-insensitive.
    """
    if not isinstance(name, str):
        raise TypeError(f"schedule name must be a str, got {type(name).__name__}")
    found = _BY_ALIAS.get(_alias_key(name))
    if found is None:
        raise ValueError(f"unknown pipeline schedule {name!r}; known: {', '.join(SCHEDULES)}")
    return found


def schedule_spec(name: str) -> ScheduleSpec:
    """The spec of the schedule ``name`` (any name :func:`canonical_schedule` takes)."""
    return SCHEDULE_SPECS[canonical_schedule(name)]


def default_stages_per_rank(schedule: str) -> int:
    """Stages per rank a schedule uses when none is given (1 or 2)."""
    return schedule_spec(schedule).default_stages_per_rank
