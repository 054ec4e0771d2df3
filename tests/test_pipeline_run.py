"""Pipeline plans run under torchrun (CPU ranks, gloo) and match one process.

Each case plans ``tests/pipeline_model.py:gpt8`` (gpt-tiny's shape with 8 blocks)
with :func:`planner.api.pipeline_plan`, runs one training step of the plan with
``training.launch.launch(..., check=True)`` and requires the step loss (mean of the
micro-batch losses) and every parameter gradient to match the one-process
reference within 1e-5.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from training.launch import launch
from training.torchrun import REPO_ROOT
from codegen.pipeline_validation import PipelinePlanError, validate_pipeline_plan
from plan.format import PipelinePlan, Plan, SolverReport, StagePlan

SOURCE = os.path.join(REPO_ROOT, "tests", "pipeline_model.py") + ":gpt8"
RTOL = 1e-5


def pipeline_test_plan(*, pp: int, stage_mesh: tuple[int, ...], schedule: str,
                       num_microbatches: int, zero_stage: int = 0,
                       megatron: tuple[int, int] | None = None,
                       cluster: str = "local-cpu:4") -> Plan:
    """The planner's fixed-configuration pipeline plan of the 8-block GPT on
    ``cluster`` (default: 4 CPU ranks); ``megatron=(tp, dp)`` fixes a Megatron layout on
    every stage (the ILP places the activations)."""
    from models.source import build_model
    from ir.trace import trace
    from planner.api import pipeline_plan
    from planner.megatron_layout import MegatronConfig, megatron_layout

    model, inputs = build_model(SOURCE, device="meta")
    fixed = None
    if megatron is not None:
        fixed = megatron_layout(trace(model, inputs), MegatronConfig(*megatron))
    return pipeline_plan(model, cluster, example_inputs=inputs, pp=pp,
                         stage_mesh=stage_mesh, schedule=schedule,
                         num_microbatches=num_microbatches, zero_stage=zero_stage,
                         model_source=SOURCE, time_limit_s=5.0, fixed=fixed)


def _run(plan: Plan, tmp_path: Any, **launch_options: Any) -> dict[str, Any]:
    path = tmp_path / "plan.json"
    plan.save(path)
    options = {"steps": 1, **launch_options}
    result = launch(path, check=True, timeout_s=240, **options)
    print(f"{plan.pipeline.schedule} pp={plan.pipeline.pp} v={plan.pipeline.stages_per_rank} "
          f"stage mesh {plan.pipeline.stage_mesh['shape']}: loss rel err "
          f"{result.get('loss_rel_err')}, max grad rel err {result.get('max_rel_grad_err')}, "
          f"step {result['step_times_s']}")
    assert result["passed"], result["output"]
    assert result["max_loss_rel_err"] <= RTOL and len(result["losses"]) == options["steps"]
    assert result["max_rel_grad_err"] <= RTOL
    assert result["num_params_checked"] == 101 and not result["missing_grads"]
    assert result["pipeline"]["schedule"] == plan.pipeline.schedule
    assert result["pipeline"]["pp"] == plan.pipeline.pp
    assert result["pipeline"]["num_microbatches"] == plan.pipeline.num_microbatches
    return result


@pytest.mark.multiprocess
def test_pp2_tensor_parallel_stages(tmp_path):
    plan = pipeline_test_plan(pp=2, stage_mesh=(2,), schedule="1f1b", num_microbatches=2,
                              megatron=(2, 1))
    assert plan.parameters["transformer.h.0.attn.c_attn.weight"] == ["S(0)"]
    assert plan.parameters["transformer.h.7.mlp.c_proj.weight"] == ["S(1)"]
    _run(plan, tmp_path)


@pytest.mark.multiprocess
def test_pp2_data_parallel_zero1_stages(tmp_path):
    """Data-parallel stages with Megatron's distributed optimizer (ZeRO-1,
    :mod:`codegen.zero1`): three AdamW steps at lr 1e-2, so that a stale
    parameter slice would show in the next step's loss."""
    plan = pipeline_test_plan(pp=2, stage_mesh=(2,), schedule="gpipe", num_microbatches=2,
                              zero_stage=1, megatron=(1, 2))
    assert set(map(tuple, plan.parameters.values())) == {("R",)}
    assert plan.pipeline.stages[0].inputs["idx"] == ["S(0)"]
    assert all(st.zero_stage == 1 and st.zero_axis == 0 for st in plan.pipeline.stages)
    result = _run(plan, tmp_path, steps=3, optimizer="adamw", lr=1e-2)
    assert result["losses"][2] < result["losses"][0]
    # every gradient is a partial sum over the data-parallel ranks, reduced in the ZeRO-1 step
    assert result["grad_reductions"] == result["num_params_checked"]


@pytest.mark.multiprocess
def test_pp2_zero2_stages(tmp_path):
    """Two ZeRO-2 stages (FSDP2 without resharding after forward); ZeRO-3 stages
    run in the one-stage test below and in tests/test_precision_run.py."""
    plan = pipeline_test_plan(pp=2, stage_mesh=(2,), schedule="1f1b", num_microbatches=2,
                              zero_stage=2, megatron=(1, 2))
    assert all(st.zero_stage == 2 and st.zero_axis == 0 for st in plan.pipeline.stages)
    _run(plan, tmp_path)


@pytest.mark.multiprocess
def test_one_stage_accumulating_microbatches_with_zero3_and_tensor_parallel(tmp_path):
    """pp=1: FSDP2 over mesh axis 0, the ILP's placements on axis 1, and the
    gradients of 4 micro-batches accumulated by a one-stage 1F1B."""
    plan = pipeline_test_plan(pp=1, stage_mesh=(2, 2), schedule="1f1b", num_microbatches=4,
                              zero_stage=3)
    assert plan.pipeline.pp == 1 and len(plan.pipeline.stages) == 1
    assert plan.pipeline.stages[0].zero_stage == 3
    _run(plan, tmp_path)


@pytest.mark.multiprocess
def test_interleaved_zero3_stages_reshard_unit_by_unit_on_each_of_two_stages_per_rank(tmp_path):
    """interleaved 1F1B, pp=2 with 2 stages per rank, each a ZeRO-3 stage over
    2 ranks whose layers are FSDP2 units: every micro-batch's backward of each
    stage reshards and reduce-scatters, and the step matches one process."""
    plan = pipeline_test_plan(pp=2, stage_mesh=(2,), schedule="interleaved_1f1b",
                              num_microbatches=4, zero_stage=3)
    assert {st.zero_stage for st in plan.pipeline.stages} == {3}
    _run(plan, tmp_path)


@pytest.mark.multiprocess
def test_one_zero3_stage_of_a_gpt2_wide_model_runs_unit_by_unit(tmp_path):
    """ZeRO-3 over one stage of 4 ranks, 2 micro-batches, on a model of gpt2's
    width: each layer, embedding, final norm and head is an FSDP2 unit of its
    own (codegen.zero3_units), and the views' backward takes the attention's
    gradients as the CPU kernel lays them out. The step matches one process;
    the plan holds a quarter of every parameter and, whole, only the two
    layers gathered at once (the embeddings and head are resharded)."""
    from models.source import build_model
    from planner.api import pipeline_plan

    source = os.path.join(REPO_ROOT, "tests", "pipeline_model.py") + ":gpt_wide"
    model, inputs = build_model(source, device="meta")
    plan = pipeline_plan(model, "local-cpu:4", example_inputs=inputs, pp=1, stage_mesh=(4,),
                         schedule="1f1b", num_microbatches=2, zero_stage=3,
                         model_source=source, time_limit_s=5.0)
    sizes = {n: p.numel() * 4 for n, p in model.named_parameters()}  # fp32 bytes
    layers = sum(v for n, v in sizes.items() if n.startswith("transformer.h."))
    memory = plan.predicted["memory_bytes_per_device"]
    assert memory["params"] == pytest.approx(sum(sizes.values()) / 4 + layers, rel=1e-3)
    path = tmp_path / "plan.json"
    plan.save(path)
    result = launch(path, check=True, timeout_s=240, steps=1)
    assert result["passed"], result["output"]
    assert result["max_rel_grad_err"] <= RTOL and result["max_loss_rel_err"] <= RTOL


@pytest.mark.multiprocess
@pytest.mark.parametrize("schedule,pp,num_microbatches", [
    ("zbv", 4, 4),  # split backward, V stages, ranks with neither the first nor last stage
    ("dualpipev", 2, 4),  # a V of 4 stages on 2 ranks
    # interleaving runs in the interleaved ZeRO-3 test above; the split backward in zbv
    pytest.param("interleaved_1f1b", 4, 4, marks=pytest.mark.slow),
    pytest.param("interleaved_zero_bubble", 4, 4, marks=pytest.mark.slow),
])
def test_multi_stage_schedules(tmp_path, schedule, pp, num_microbatches):
    """The schedules of several stages per rank, each stage on one rank (GPipe
    and 1F1B run in the pp=2 tests above)."""
    plan = pipeline_test_plan(pp=pp, stage_mesh=(1,), schedule=schedule,
                              num_microbatches=num_microbatches, cluster=f"local-cpu:{pp}")
    _run(plan, tmp_path)


def _synthetic_plan(schedule: str = "1f1b", pp: int = 2, v: int = 1) -> Plan:
    """A pipeline section over made-up node names (enough for the static checks)."""
    from costmodel.schedules.specs import schedule_spec

    n = pp * v
    stage_to_rank = schedule_spec(schedule).stage_to_rank(pp, v)
    stages = []
    for s in range(n):
        rank = stage_to_rank[s]
        stages.append(StagePlan(
            index=s, pp_rank=rank, layers=[f"h.{s}"], nodes=[f"op{s}"],
            ranks=[2 * rank, 2 * rank + 1],
            inputs={"idx": ["R"]} if s == 0 else {f"op{s - 1}": ["S(0)"]},
            outputs={f"op{s}": ["R"] if s == n - 1 else ["S(0)"]}))
    return Plan(model={}, cluster={}, mesh={"shape": [pp, 2], "axis_names": ["pp", "dp"]},
                parameters={}, inputs={}, nodes={}, reshards=[], predicted={},
                solver=SolverReport("none", "none", 0.0, 0.0, 0.0, 0.0),
                pipeline=PipelinePlan(schedule=schedule, num_microbatches=4, stages_per_rank=v,
                                      stage_mesh={"shape": [2], "axis_names": ["dp"]},
                                      stages=stages))


def _wrong_rank(plan: Plan) -> None:
    plan.pipeline.stages[1].pp_rank = 0


def _wrong_boundary(plan: Plan) -> None:
    plan.pipeline.stages[1].inputs = {"op0": ["R"]}


def _wrong_ranks(plan: Plan) -> None:
    plan.pipeline.stages[0].ranks = [0, 2]


def _wrong_zero_axis(plan: Plan) -> None:
    plan.pipeline.stages[0].zero_stage, plan.pipeline.stages[0].zero_axis = 3, 1


def _wrong_schedule(plan: Plan) -> None:
    plan.pipeline.schedule = "bogus"


@pytest.mark.parametrize("schedule,pp,v", [("1f1b", 2, 1), ("interleaved_1f1b", 2, 2),
                                           ("zbv", 2, 2), ("dualpipev", 4, 2)])
def test_valid_synthetic_pipeline_plans_pass_the_checks(schedule, pp, v):
    validate_pipeline_plan(_synthetic_plan(schedule, pp, v))


@pytest.mark.parametrize("spoil,message", [
    (_wrong_rank, "runs it on rank 1"),
    (_wrong_boundary, "the sender must reshard"),
    (_wrong_ranks, "are not row 0"),
    (_wrong_zero_axis, "zero_axis 1"),
    (_wrong_schedule, "unknown pipeline schedule"),
])
def test_unrunnable_pipeline_plans_are_refused_in_one_line(spoil, message):
    plan = _synthetic_plan()
    spoil(plan)
    with pytest.raises(PipelinePlanError, match=message) as err:
        validate_pipeline_plan(plan)
    assert "\n" not in str(err.value)
