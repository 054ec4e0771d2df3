"""The planner: sharding strategies, the intra-op ILP, plans and the ``planner`` command.

    >>> import planner
    >>> p = planner.plan(model, "dgx-a100-80g:2", example_inputs=inputs, mesh_shape=(2, 8))
    >>> p.save("plan.json"); planner.load_plan("plan.json") == p

``plan`` and ``PlanningError`` are imported when first used: the ranks of
``planner run`` read plans (:mod:`plan.format`) but never search, and
need neither the solver nor OR-Tools.
"""

from typing import Any

from plan.format import FORMAT_VERSION, Plan, PlanError, load_plan

__all__ = ["FORMAT_VERSION", "Plan", "PlanError", "PlanningError", "load_plan", "plan"]


def __getattr__(name: str) -> Any:
    if name in ("plan", "PlanningError"):
        from planner import api

        return getattr(api, name)
    raise AttributeError(f"module 'planner' has no attribute {name!r}")
