"""Checks that a pipeline Plan can run, before any rank builds a stage.

:func:`validate_pipeline_plan` refuses, with a :class:`PipelinePlanError` that
says what is wrong, a plan whose pipeline section does not fit the schedule
torch runs (stages per rank, stage-to-rank placement from
:mod:`costmodel.schedules.specs`), the world mesh, the ZeRO stages this runtime
runs or the chain of boundary values between stages.
"""

from __future__ import annotations

import math

from costmodel.schedules.specs import schedule_spec
from costmodel.strategy_cost import ZERO_STAGES
from plan.format import Plan

__all__ = ["PipelinePlanError", "validate_pipeline_plan"]


class PipelinePlanError(ValueError):
    """A pipeline plan this runtime cannot run; the message says why and what to do."""


# ------------------------------------------------------------------ plan checks
def validate_pipeline_plan(plan: Plan) -> None:
    """Refuse pipeline plans this runtime cannot run, with a one-line reason.

    Checks the schedule name, the stage count and placement on pipeline ranks
    (torch's), the world mesh (``[pp] + stage_mesh``, first axis ``pp``), the
    stage ranks (rows of the world mesh), the ZeRO settings and that every
    stage's outputs are the next stage's inputs, in order, in the same placements.
    """
    pipe = plan.pipeline
    if pipe is None:
        raise PipelinePlanError("plan has no pipeline section; run it with PlanExecutor")
    try:
        spec = schedule_spec(pipe.schedule)
    except (TypeError, ValueError) as err:
        raise PipelinePlanError(str(err)) from None
    stages = pipe.stages
    v = pipe.stages_per_rank
    if v < 1 or not stages or len(stages) % v:
        raise PipelinePlanError(f"{len(stages)} stages cannot be spread {v} per rank")
    pp = pipe.pp
    try:
        stage_to_rank = spec.stage_to_rank(pp, v)
    except ValueError as err:  # stages per rank torch's schedule does not run
        raise PipelinePlanError(f"schedule {err}") from None
    shape = [int(d) for d in pipe.stage_mesh.get("shape", [])]
    names = list(pipe.stage_mesh.get("axis_names") or [])
    if not shape or len(names) != len(shape) or len(set(names)) != len(names) or "pp" in names:
        raise PipelinePlanError(f"stage_mesh {pipe.stage_mesh} needs one distinct axis name "
                                f"(not 'pp') per dimension")
    if list(plan.mesh_shape) != [pp] + shape or (plan.mesh.get("axis_names") or ["pp"])[0] != "pp":
        raise PipelinePlanError(f"plan mesh {plan.mesh} is not the world mesh [pp={pp}] + "
                                f"stage mesh {shape} with first axis 'pp'")
    size = math.prod(shape)
    for i, st in enumerate(stages):
        if st.index != i:
            raise PipelinePlanError(f"stage at position {i} has index {st.index}; list stages "
                                    f"in index order")
        want = stage_to_rank[i]
        if st.pp_rank != want:
            raise PipelinePlanError(f"stage {i} is on pipeline rank {st.pp_rank} but torch's "
                                    f"{spec.torch_class} runs it on rank {want}")
        if list(st.ranks) != list(range(want * size, (want + 1) * size)):
            raise PipelinePlanError(f"stage {i} ranks {st.ranks} are not row {want} of the world "
                                    f"mesh {list(plan.mesh_shape)}")
        if st.zero_stage not in ZERO_STAGES:
            raise PipelinePlanError(f"stage {i} has zero_stage {st.zero_stage}; this runtime "
                                    f"runs 0 (as placed), 1 (sharded optimizer states), "
                                    f"2 or 3 (FSDP2)")
        problem = spec.zero_stage_problem(st.zero_stage)
        if problem:
            raise PipelinePlanError(f"stage {i}: {problem}")
        if st.zero_stage and not (isinstance(st.zero_axis, int)
                                                 and 0 <= st.zero_axis < len(shape)):
            raise PipelinePlanError(f"stage {i} has zero_stage {st.zero_stage} but zero_axis "
                                    f"{st.zero_axis!r} is not an axis of the {len(shape)}-D "
                                    f"stage mesh")
        if not st.nodes:
            raise PipelinePlanError(f"stage {i} runs no nodes")
    for a, b in zip(stages, stages[1:]):
        if list(a.outputs) != list(b.inputs):
            raise PipelinePlanError(f"stage {a.index} sends {list(a.outputs)} but stage {b.index} "
                                    f"receives {list(b.inputs)}; they must be the same, in order")
        for name, placements in a.outputs.items():
            if list(placements) != list(b.inputs[name]):
                raise PipelinePlanError(
                    f"stage {a.index} sends {name} as {placements} but stage {b.index} "
                    f"receives it as {b.inputs[name]}; the sender must reshard to the receiver's")
    if len(stages[-1].outputs) != 1:
        raise PipelinePlanError(f"the last stage must output the loss alone, it outputs "
                                f"{list(stages[-1].outputs)}")
    if pipe.num_microbatches < 1:
        raise PipelinePlanError(f"num_microbatches is {pipe.num_microbatches}")
