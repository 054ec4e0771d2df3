"""Turn a Plan and a model into a running per-rank program; launch it; check it.

* :class:`codegen.executor.PlanExecutor` runs the captured program on DTensors as
  the plan places it (explicit ``redistribute()`` where the plan reshards);
* :mod:`codegen.rank_main` is the per-rank program torchrun starts;
* :func:`codegen.launch.launch` starts it and returns rank 0's result;
* :mod:`codegen.reference` is the single-process run results are checked against.
"""

from codegen.executor import (PlanExecutor, PlanMismatchError, parse_placement, placement_str,
                              placements_of)
from codegen.launch import LaunchError, launch
from codegen.reference import ReferenceResult, reference_step

__all__ = ["LaunchError", "PlanExecutor", "PlanMismatchError", "ReferenceResult", "launch",
           "parse_placement", "placement_str", "placements_of", "reference_step"]
