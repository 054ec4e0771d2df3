"""Turn a Plan and a model into a running per-rank program; launch it; check it.

* :class:`codegen.executor.PlanExecutor` runs the captured program on DTensors as
  the plan places it (explicit ``redistribute()`` where the plan reshards), from
  the capture (:mod:`codegen.capture`), its placed inputs
  (:mod:`codegen.program_inputs`), one node at a time (:mod:`codegen.node_runner`,
  :mod:`codegen.redistribution`, :mod:`codegen.checkpointed_layers`), recording
  the placements met (:mod:`codegen.placement_record`);
* :mod:`codegen.pipeline` runs a pipeline plan's stages with it;
* :mod:`codegen.rank_main` is the per-rank program torchrun starts;
* :func:`codegen.launch.launch` starts it and returns rank 0's result;
* :mod:`codegen.reference` is the single-process run results are checked against.
"""

from codegen.capture import PlanMismatchError
from codegen.executor import PlanExecutor
from codegen.launch import LaunchError, launch
from codegen.reference import ReferenceResult, reference_step

__all__ = ["LaunchError", "PlanExecutor", "PlanMismatchError", "ReferenceResult", "launch",
           "reference_step"]
