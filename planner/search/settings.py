"""What one search is asked for (:class:`SearchSettings`): fixed when the
search starts, the same in every process of it.

Units: bytes, seconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from costmodel.cluster import Cluster

__all__ = ["SearchSettings"]


@dataclass(frozen=True, eq=False)
class SearchSettings:
    """The settings of one search.

    Attributes:
        cluster: the devices the plan runs on.
        dtype: the precision (its name or :class:`ir.precision.Precision`).
        optimizer: the optimizer whose states the memory counts.
        budget: memory per device, bytes.
        time_limit_s: each exact stage ILP's time limit.
        fixed: placements every stage must use (a manual layout), by
            parameter FQN / input name.
        context_parallel: cp of the program searched (one cp rank's:
            :mod:`planner.search.cp_search`); > 1 pins the batch rows to stage
            mesh axis 0 (:func:`planner.search.cp_search.layout_allows`,
            :func:`planner.search.cp_search.pinned_strategies`).
    """

    cluster: Cluster
    dtype: str
    optimizer: str
    budget: float
    time_limit_s: float
    fixed: Mapping[str, tuple] = field(default_factory=dict)
    context_parallel: int = 1

    def __post_init__(self) -> None:
        # a copy of the layout given, and cp as an int
        object.__setattr__(self, "fixed", dict(self.fixed or {}))
        object.__setattr__(self, "context_parallel", int(self.context_parallel))
