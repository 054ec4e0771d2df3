"""The spine end to end: plan with the ILP, write plan.json, run it on CPU ranks, check it."""

import pytest

from training.launch import launch
from models.source import build_model
from planner.api import plan

pytestmark = pytest.mark.multiprocess


# gpt-tiny on a 2x2 mesh of 4 ranks is the README's quick start, which
# tests/test_readme.py runs with --check
@pytest.mark.parametrize("cluster, mesh", [("local-cpu:2", (2,))])
def test_planned_gpt_tiny_matches_one_process(cluster, mesh, tmp_path):
    model, inputs = build_model("gpt-tiny", device="meta")
    p = plan(model, cluster, example_inputs=inputs, mesh_shape=mesh, model_source="gpt-tiny")
    path = tmp_path / "plan.json"
    p.save(path)
    result = launch(path, steps=2, check=True)
    assert result["passed"], result.get("output")
    assert result["loss_rel_err"] < 1e-5
    assert result["max_rel_grad_err"] < 1e-5
    assert result["num_params_checked"] == len(p.parameters)
    # the placements observed at run time are the ones in plan.json
    assert result["observed_match"] and result["num_mismatches"] == 0
    assert result["explicit_reshards"] >= 0
