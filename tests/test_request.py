"""PlanRequest: one typed request from the command line to the search, checked up front."""

import pytest

from app.cli import _plan_request, build_parser
from costmodel.cluster import ClusterError, check_mesh_shape
from costmodel.presets import load_cluster
from models.source import build_model
from planner.api import plan
from planner.request import PlanningError, PlanRequest, check_mesh


def test_a_request_holds_tuples_and_refuses_recompute_without_a_single_stage():
    req = PlanRequest(pp=[2, 4], schedules=["1f1b"], mesh_shape=None)
    assert req.pp == (2, 4) and req.schedules == ("1f1b",) and not req.single_stage
    assert PlanRequest(mesh_shape=[2], recompute=True).single_stage
    with pytest.raises(PlanningError, match="recompute"):
        PlanRequest(recompute=True)


@pytest.mark.parametrize("shape, message", [
    ((3,), "has 3 devices but cluster 'local-cpu:4' has 4"),
    ((0, 4), "positive integer sizes"),
    ((), "positive integer sizes"),
    ((2.0, 2), "positive integer sizes"),
])
def test_one_mesh_check_for_every_caller(shape, message):
    cluster = load_cluster("local-cpu:4")
    with pytest.raises(ClusterError, match=message):
        check_mesh_shape(shape, cluster)
    with pytest.raises(PlanningError, match=message):
        check_mesh(shape, cluster)
    assert check_mesh_shape([2, 2], cluster) == (2, 2)


def test_the_command_line_builds_the_request_the_search_gets():
    args = build_parser().parse_args(
        ["plan", "--model", "gpt-tiny", "--cluster", "local-cpu:4", "--pp", "2",
         "--schedule", "Interleaved1F1B,1f1b", "--microbatches", "4,8", "--zero", "0,3",
         "--batch-size", "8", "--time-limit", "7"])
    req = _plan_request(args)
    assert req == PlanRequest(model_source="gpt-tiny", time_limit_s=7.0,
                              zoo_kwargs={"batch_size": 8}, pp=(2,),
                              schedules=("interleaved_1f1b", "1f1b"), num_microbatches=(4, 8),
                              zero_stages=(0, 3))


def test_a_request_and_its_fields_as_keywords_give_the_same_plan():
    model, inputs = build_model("gpt-tiny", device="meta")
    by_request = plan(model, "local-cpu:2", example_inputs=inputs,
                      request=PlanRequest(mesh_shape=(2,), model_source="gpt-tiny"))
    by_keywords = plan(model, "local-cpu:2", example_inputs=inputs, mesh_shape=(2,),
                       model_source="gpt-tiny")
    overridden = plan(model, "local-cpu:2", example_inputs=inputs,
                      request=PlanRequest(mesh_shape=(2,), model_source="elsewhere"),
                      model_source="gpt-tiny")
    assert by_request.to_json() == by_keywords.to_json() == overridden.to_json()


def test_an_unknown_option_is_refused_before_any_work():
    model, inputs = build_model("gpt-tiny", device="meta")
    with pytest.raises(TypeError, match="mesh_shap"):
        plan(model, "local-cpu:2", example_inputs=inputs, mesh_shap=(2,))
