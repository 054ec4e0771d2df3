"""What this runtime cannot run, said before any work starts.

:func:`unrunnable_reason` is the one list of plan features that are planned and
priced but not run (``planner run``, ``planner train`` and :func:`parallelize`
refuse them with its sentence).
"""

from __future__ import annotations

from typing import Any

__all__ = ["unrunnable_reason"]


def unrunnable_reason(plan: Any) -> str | None:
    """Why this runtime cannot run ``plan`` (a sentence that ends with what to do),
    or None when it can."""
    if plan.precision.compute_dtype_name == "float16":
        return (f"it trains in {plan.precision.name}, which needs loss scaling that this "
                f"runtime does not do; re-plan with --precision bf16-mixed to run it")
    return None
