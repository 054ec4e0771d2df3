"""Checks that a pipeline Plan can run, before any rank builds a stage.

:func:`validate_pipeline_plan` refuses, with a :class:`PipelinePlanError` that
says what is wrong, a plan whose pipeline section does not fit the schedule
torch runs (stages per rank, stage-to-rank placement from
:mod:`costmodel.schedules.specs`), the world mesh, the ZeRO stages this runtime
runs or the chain of boundary values between stages.
"""

from __future__ import annotations

import math

from costmodel.schedules.specs import ScheduleSpec, schedule_spec
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
    for i, st in enumerate(stages):
        problem = _stage_problem(plan, spec, i, stage_to_rank[i], math.prod(shape), len(shape))
        if problem:
            raise PipelinePlanError(problem)
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


def _stage_problem(plan: Plan, spec: ScheduleSpec, i: int, pp_rank: int, size: int,
                   stage_axes: int) -> str | None:
    """Why stage ``i`` of ``plan`` cannot run as torch's schedule ``spec``
    places it (on pipeline rank ``pp_rank``, over ``size`` ranks of a stage
    mesh of ``stage_axes`` axes), or None when it can."""
    st = plan.pipeline.stages[i]
    if st.index != i:
        return f"stage at position {i} has index {st.index}; list stages in index order"
    if st.pp_rank != pp_rank:
        return (f"stage {i} is on pipeline rank {st.pp_rank} but torch's "
                f"{spec.torch_class} runs it on rank {pp_rank}")
    if list(st.ranks) != list(range(pp_rank * size, (pp_rank + 1) * size)):
        return (f"stage {i} ranks {st.ranks} are not row {pp_rank} of the world "
                f"mesh {list(plan.mesh_shape)}")
    if st.zero_stage not in ZERO_STAGES:
        return (f"stage {i} has zero_stage {st.zero_stage}; this runtime runs 0 (as placed), "
                f"1 (sharded optimizer states), 2 or 3 (FSDP2)")
    problem = spec.zero_stage_problem(st.zero_stage)
    if problem:
        return f"stage {i}: {problem}"
    if st.zero_stage and not (isinstance(st.zero_axis, int) and 0 <= st.zero_axis < stage_axes):
        return (f"stage {i} has zero_stage {st.zero_stage} but zero_axis {st.zero_axis!r} "
                f"is not an axis of the {stage_axes}-D stage mesh")
    if not st.nodes:
        return f"stage {i} runs no nodes"
    return None
