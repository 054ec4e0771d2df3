"""The planner: sharding strategies, the intra-op ILP, plans and the ``planner`` command.

    >>> import planner
    >>> p = planner.plan(model, "dgx-a100-80g:2", example_inputs=inputs, mesh_shape=(2, 8))
    >>> p.save("plan.json"); planner.load_plan("plan.json") == p
"""

from planner.api import PlanningError, plan
from planner.plan_format import FORMAT_VERSION, Plan, PlanError, load_plan

__all__ = ["FORMAT_VERSION", "Plan", "PlanError", "PlanningError", "load_plan", "plan"]
