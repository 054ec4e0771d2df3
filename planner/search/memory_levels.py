"""The memory levels of a layer profile: the supported Pareto points of
(seconds, bytes) of one layer's intra-op plans, found as in the
non-inferior set estimation (NISE) method. Level 0 is the fastest plan, the
next the least-memory one (memory weighted
:data:`PROFILE_LEAST_MEMORY_WEIGHT` x the fastest plan's seconds per byte),
and each further point comes from the widest gap between two known points,
solved with memory weighted by the slope between them (it is new if it
beats both there). A weight, unlike a memory budget row, keeps every ILP as
easy as the unconstrained one. The search asks for the first two (the
least-memory point decides whether a configuration fits at all);
``refine()`` adds the rest for the leading candidates' (mesh, micro-batch
size) pairs.

The solver is the caller's (:data:`WeightedSolve`); what is here only
chooses the weights and keeps the points.

Units: seconds, bytes; weights in seconds per byte.
"""

from __future__ import annotations

import math
from typing import Callable

from planner.search.stage_dp import LayerProfile
from planner.search.stage_times import StageTimes
from planner.ilp.intra_op import IntraOpResult

PROFILE_LEVELS = 4
PROFILE_LEAST_MEMORY_WEIGHT = 1e3

# memory weight -> the layer's plan solved with memory priced at that weight
# and its times; None when the ILP found nothing in time
WeightedSolve = Callable[[float], "tuple[IntraOpResult, StageTimes] | None"]


def add_levels(prof: LayerProfile, levels: int, solve: WeightedSolve) -> None:
    """Add memory levels to ``prof`` until it has ``levels`` (marked
    exhausted where no further level exists)."""
    while len(prof.points) < levels and not prof.exhausted:
        if not _next_level(prof, solve):
            prof.exhausted = True


def _next_level(prof: LayerProfile, solve: WeightedSolve) -> bool:
    """Add the profile's next memory level (points stay sorted, fastest
    first); False when there is none: no gap left that a weight splits, or
    the ILP found nothing in time."""
    if not prof.points:
        return _add_point(prof, solve, 0.0)
    if len(prof.points) == 1:
        fastest = prof.points[0]
        weight = PROFILE_LEAST_MEMORY_WEIGHT * fastest.total_s / max(fastest.memory(1.0), 1.0)
        return _add_point(prof, solve, weight, below=0.999 * fastest.memory(1.0))
    gaps = sorted(zip(prof.points, prof.points[1:]),
                  key=lambda ab: -ab[0].memory(1.0) / max(ab[1].memory(1.0), 1.0))
    for a, b in gaps:  # the widest gap first
        key = (a.memory(1.0), b.memory(1.0))
        if key in prof.closed or b.total_s <= a.total_s:
            continue
        # the weight at which a and b tie; a new point must beat both there
        weight = (b.total_s - a.total_s) / (a.memory(1.0) - b.memory(1.0))
        tie = a.total_s + weight * a.memory(1.0)
        found = solve(weight)
        if found is None:
            return False
        t = found[1]
        if (t.total_s + weight * t.memory(1.0) < tie * (1 - 1e-6)
                and b.memory(1.0) < t.memory(1.0) < a.memory(1.0)):
            _insert(prof, weight, *found)
            return True
        prof.closed.add(key)
    return False


def _add_point(prof: LayerProfile, solve: WeightedSolve, weight: float,
               below: float = math.inf) -> bool:
    """Solve with memory weighted by ``weight`` and add the point if it uses
    less than ``below`` bytes."""
    found = solve(weight)
    if found is None or found[1].memory(1.0) >= below:
        return False
    _insert(prof, weight, *found)
    return True


def _insert(prof: LayerProfile, weight: float, result: IntraOpResult, t: StageTimes) -> None:
    """File the point ``t`` (solved at ``weight``) in memory order, most first."""
    at = sum(p.memory(1.0) > t.memory(1.0) for p in prof.points)
    prof.points.insert(at, t)
    prof.weights.insert(at, weight)
    prof.assignments.insert(at, result.chosen)
