"""Turn a Plan and a model into a running per-rank step.

* :func:`codegen.parallel_model.parallelize` gives each rank its part of a plan
  as a :class:`codegen.parallel_model.ParallelModel` (the step the training job,
  :mod:`training.job`, and a user's own loop call);
* :class:`codegen.executor.PlanExecutor` runs the captured program on DTensors as
  the plan places it (explicit ``redistribute()`` where the plan reshards), from
  the capture (:mod:`codegen.capture`), its placed inputs
  (:mod:`codegen.program_inputs`), one node at a time (:mod:`codegen.node_runner`,
  :mod:`codegen.redistribution`, :mod:`codegen.checkpointed_layers`), recording
  the placements met (:mod:`codegen.placement_record`);
* :mod:`codegen.pipeline` runs a pipeline plan's stages with it;
* :mod:`codegen.plan_model` builds a plan's model (the one place) and reads its loss;
* :mod:`codegen.rank_process` is a rank's device, process group and memory.
"""

from codegen.capture import PlanMismatchError
from codegen.executor import PlanExecutor

__all__ = ["PlanExecutor", "PlanMismatchError"]
