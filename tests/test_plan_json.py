"""plan.json: exact round trip, byte-for-byte determinism, clear errors."""

import json

import pytest

from models.source import build_model
from planner.api import PlanningError, plan
from plan.format import FORMAT_VERSION, PlanError, load_plan


@pytest.fixture(scope="module")
def tiny_plan():
    model, inputs = build_model("gpt-tiny", device="meta")
    return plan(model, "local-cpu:4", example_inputs=inputs, mesh_shape=(4,),
                model_source="gpt-tiny")


def test_round_trip_is_exact(tiny_plan, tmp_path):
    path = tmp_path / "plan.json"
    tiny_plan.save(path)
    again = load_plan(path)
    assert again == tiny_plan
    assert again.to_json() == path.read_text()


def test_same_inputs_same_bytes(tiny_plan):
    model, inputs = build_model("gpt-tiny", device="meta")
    second = plan(model, "local-cpu:4", example_inputs=inputs, mesh_shape=(4,),
                  model_source="gpt-tiny")
    assert second.to_json() == tiny_plan.to_json()


def test_plan_json_contents(tiny_plan):
    d = json.loads(tiny_plan.to_json())
    assert d["format_version"] == FORMAT_VERSION
    assert d["mesh"]["shape"] == [4]
    assert d["cluster"]["name"].startswith("local-cpu")
    assert d["model"]["source"] == "gpt-tiny" and len(d["model"]["fingerprint"]) == 16
    # every parameter by FQN, one placement per mesh axis
    assert "transformer.h.0.mlp.c_fc.weight" in d["parameters"]
    assert all(len(p) == 1 and p[0] in ("R", "S(0)", "S(1)") for p in d["parameters"].values())
    for r in d["reshards"]:
        assert r["src"] != r["dst"] and r["time_s"] >= 0
    pred = d["predicted"]
    assert pred["step_time_s"] == pytest.approx(
        pred["compute_s"] + pred["communication_s"] + pred["resharding_s"])
    assert pred["memory_bytes_per_device"]["total"] > 0
    assert d["solver"]["status"] in ("OPTIMAL", "FEASIBLE") and d["solver"]["gap"] >= 0


def test_wrong_version_is_refused(tiny_plan, tmp_path):
    d = tiny_plan.to_dict()
    d["format_version"] = 99
    path = tmp_path / "old.json"
    path.write_text(json.dumps(d))
    with pytest.raises(PlanError, match="format_version 99"):
        load_plan(path)


def test_save_refuses_to_overwrite_a_non_plan(tiny_plan, tmp_path):
    path = tmp_path / "notes.json"
    path.write_text('{"mine": 1}')
    with pytest.raises(PlanError, match="not a plan"):
        tiny_plan.save(path)
    assert path.read_text() == '{"mine": 1}'


def test_mesh_must_match_cluster():
    model, inputs = build_model("gpt-tiny", device="meta")
    with pytest.raises(PlanningError, match="has 4"):
        plan(model, "local-cpu:4", example_inputs=inputs, mesh_shape=(3,))


def test_public_api_names():
    import planner

    assert planner.plan is plan and planner.load_plan is load_plan
    from plan.format import Plan

    assert planner.Plan is Plan


def test_a_compiled_plan_records_which_collectives_run_in_its_graphs():
    """``training.compile_collectives``: the reshard points' collectives run in
    the compiled graphs; the gradient reduction (by ZeRO stage) and a
    pipeline's sends run outside them; an eager plan records none."""
    from planner.report import format_plan

    model, inputs = build_model("gpt-tiny", device="meta")
    kw = dict(example_inputs=inputs, model_source="gpt-tiny", time_limit_s=5, compile=True)
    data_parallel = plan(model, "local-cpu:2", mesh_shape=(2,), zero_stages=(0,), **kw)
    record = data_parallel.training["compile_collectives"]
    assert record["outside_graph"] == {"gradient_reduction": {"0": ["all_reduce"]}}
    assert sum(record["in_graph"].values()) >= sum(
        r.src != r.dst for r in data_parallel.reshards if "P" in r.src)
    assert "compiled: collectives in the graphs" in format_plan(data_parallel)
    assert "compile_collectives" not in data_parallel.with_compile(False).training

    sharded = plan(model, "local-cpu:2", pp=(1,), zero_stages=(3,), **kw)
    assert sharded.training["compile_collectives"]["outside_graph"]["gradient_reduction"] == {
        "3": ["all_gather", "reduce_scatter"]}
    piped = plan(model, "local-cpu:2", pp=(2,), schedules=("1f1b",), **kw)
    assert piped.training["compile_collectives"] == {"in_graph": {},
                                                     "outside_graph": {"p2p": "send_recv"}}
