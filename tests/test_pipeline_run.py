"""Pipeline plans run under torchrun (4 CPU ranks, gloo) and match one process.

Each case plans ``tests/pipeline_model.py:gpt8`` (gpt-tiny's shape with 8 blocks)
with :func:`planner.api.pipeline_plan`, runs one training step of the plan with
``codegen.launch.launch(..., check=True)`` and requires the step loss (mean of the
micro-batch losses) and every parameter gradient to match the one-process
reference within 1e-5.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from codegen.launch import REPO_ROOT, launch
from planner.plan_format import Plan

pytestmark = pytest.mark.multiprocess

SOURCE = os.path.join(REPO_ROOT, "tests", "pipeline_model.py") + ":gpt8"
RTOL = 1e-5


def pipeline_test_plan(*, pp: int, stage_mesh: tuple[int, ...], schedule: str,
                       num_microbatches: int, zero_stage: int = 0) -> Plan:
    """The planner's fixed-configuration pipeline plan of the 8-block GPT on 4 CPU ranks."""
    from ir.source import build_model
    from planner.api import pipeline_plan

    model, inputs = build_model(SOURCE, device="meta")
    return pipeline_plan(model, "local-cpu:4", example_inputs=inputs, pp=pp,
                         stage_mesh=stage_mesh, schedule=schedule,
                         num_microbatches=num_microbatches, zero_stage=zero_stage,
                         model_source=SOURCE, time_limit_s=5.0)


def as_data_parallel(plan: Plan, *, zero_stage: int = 0) -> Plan:
    """The same pipeline with every stage data parallel over its 1-D mesh.

    Parameters replicated, user inputs and every boundary value but the loss
    sharded on the batch dim, op placements left to DTensor (follow mode);
    ``zero_stage=3`` then shards parameters over that axis with FSDP2.
    """
    pipe = plan.pipeline
    if len(pipe.stage_mesh["shape"]) != 1:
        raise ValueError("as_data_parallel needs a 1-D stage mesh")
    plan.parameters = {fqn: ["R"] for fqn in plan.parameters}
    plan.inputs = {name: ["S(0)"] for name in plan.inputs}
    plan.nodes, plan.reshards, plan.checkpoint = {}, [], []
    last = pipe.stages[-1].index
    for st in pipe.stages:
        st.inputs = {name: ["S(0)"] for name in st.inputs}
        st.outputs = {name: ["R"] if st.index == last else ["S(0)"] for name in st.outputs}
        st.checkpoint = []
        st.zero_stage, st.zero_axis = zero_stage, (0 if zero_stage else None)
    return plan


def _run(plan: Plan, tmp_path: Any) -> dict[str, Any]:
    path = tmp_path / "plan.json"
    plan.save(path)
    result = launch(path, check=True, steps=1, timeout_s=240)
    print(f"{plan.pipeline.schedule} pp={plan.pipeline.pp} v={plan.pipeline.stages_per_rank} "
          f"stage mesh {plan.pipeline.stage_mesh['shape']}: loss rel err "
          f"{result.get('loss_rel_err')}, max grad rel err {result.get('max_rel_grad_err')}, "
          f"step {result['step_times_s']}")
    assert result["passed"], result["output"]
    assert result["loss_rel_err"] <= RTOL
    assert result["max_rel_grad_err"] <= RTOL
    assert result["num_params_checked"] == 101 and not result["missing_grads"]
    assert result["pipeline"]["schedule"] == plan.pipeline.schedule
    assert result["pipeline"]["pp"] == plan.pipeline.pp
    assert result["pipeline"]["num_microbatches"] == plan.pipeline.num_microbatches
    return result


def test_pp2_tensor_parallel_stages(tmp_path):
    plan = pipeline_test_plan(pp=2, stage_mesh=(2,), schedule="1f1b", num_microbatches=2)
    sharded = [f for f, p in plan.parameters.items() if p != ["R"]]
    assert sharded, "the stage plans replicate every parameter; expected tensor parallelism"
    _run(plan, tmp_path)


def test_pp2_data_parallel_stages(tmp_path):
    plan = pipeline_test_plan(pp=2, stage_mesh=(2,), schedule="gpipe", num_microbatches=2)
    result = _run(as_data_parallel(plan), tmp_path)
    assert result["grad_reductions"] > 0  # gradients all-reduced over the stage mesh


def test_pp2_zero3_stages(tmp_path):
    plan = pipeline_test_plan(pp=2, stage_mesh=(2,), schedule="1f1b", num_microbatches=2,
                              zero_stage=3)
    _run(as_data_parallel(plan, zero_stage=3), tmp_path)


@pytest.mark.parametrize("schedule,num_microbatches", [
    ("gpipe", 4), ("1f1b", 4), ("interleaved_1f1b", 4), ("interleaved_zero_bubble", 4),
    ("zbv", 4), ("dualpipev", 8),
])
def test_pp4_schedules(tmp_path, schedule, num_microbatches):
    plan = pipeline_test_plan(pp=4, stage_mesh=(1,), schedule=schedule,
                              num_microbatches=num_microbatches)
    _run(plan, tmp_path)
