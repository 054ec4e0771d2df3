"""Megatron-LM manual plans in the Plan format, and `planner compare`."""

import json

import pytest

from codegen.launch import launch
from costmodel.cluster import load_cluster
from ir import trace
from ir.source import build_model
from planner.compare import compare
from planner.megatron import MegatronConfig, _classify_linears, megatron_configs, megatron_plan


@pytest.mark.parametrize("name, column, row", [
    ("gpt-tiny", ["attn.c_attn", "mlp.c_fc"], ["attn.c_proj", "mlp.c_proj"]),
    ("llama-tiny", ["attention.wq", "attention.wk", "attention.wv", "feed_forward.w1",
                    "feed_forward.w3"], ["attention.wo", "feed_forward.w2"]),
])
def test_linears_are_classified_as_megatron_would(name, column, row):
    model, inputs = build_model(name, device="meta")
    kinds = _classify_linears(trace(model, inputs))
    for fqn, kind in kinds.items():
        if any(f".{c}.weight" in fqn for c in column):
            assert kind == "column", fqn
        elif any(f".{r}.weight" in fqn for r in row):
            assert kind == "row", fqn
    assert sum(k == "row" for k in kinds.values()) == 2 * len(row)


def test_megatron_grid_is_powers_of_two_inside_a_node():
    cfgs = megatron_configs(load_cluster("dgx-a100-80g:2"))
    assert [(c.tensor_model_parallel_size, c.data_parallel_size) for c in cfgs] == [
        (1, 16), (2, 8), (4, 4), (8, 2)]


@pytest.fixture(scope="module")
def megatron_2x2():
    model, inputs = build_model("gpt-tiny", device="meta")
    return megatron_plan(model, "local-cpu:4", MegatronConfig(2, 2), example_inputs=inputs,
                         model_source="gpt-tiny")


def test_megatron_plan_has_the_megatron_layout(megatron_2x2):
    p = megatron_2x2
    assert p.mesh_shape == (2, 2)
    assert p.parameters["transformer.h.0.attn.c_attn.weight"] == ["R", "S(0)"]
    assert p.parameters["transformer.h.0.mlp.c_proj.weight"] == ["R", "S(1)"]
    assert p.parameters["transformer.wte.weight"] == ["R", "S(0)"]
    assert p.inputs["idx"] == ["S(0)", "R"]
    assert p.training["manual"]["tensor_model_parallel_size"] == 2


@pytest.mark.multiprocess
def test_megatron_plan_runs_and_matches_one_process(megatron_2x2, tmp_path):
    path = tmp_path / "plan.json"
    megatron_2x2.save(path)
    result = launch(path, steps=2, check=True)
    assert result["passed"], result.get("output")
    assert result["max_rel_grad_err"] < 1e-5 and result["observed_match"]


def test_auto_plan_is_never_slower_than_the_best_megatron_plan(tmp_path):
    result = compare("gpt-tiny", "local-cpu:4")
    rows = [r for r in result["plans"] if "step_time_s" in r]
    auto = next(r for r in rows if r["name"] == "auto")
    best_manual = min(r["step_time_s"] for r in rows if r["name"] == "megatron")
    assert auto["step_time_s"] <= best_manual * (1 + 1e-9)
    assert result["auto_speedup_over_best_megatron"] >= 1.0
    assert len(rows) == 4 and all(0 < r["mfu"] <= 1 for r in rows)


def test_compare_command_writes_table_json_and_chart(tmp_path, capsys):
    from planner.cli import main

    prefix = tmp_path / "out" / "cmp"
    assert main(["compare", "--model", "gpt-tiny", "--cluster", "local-cpu:2", "-o",
                 str(prefix)]) == 0
    text = capsys.readouterr().out
    assert "megatron tp=2 dp=1" in text and "auto plan is" in text
    data = json.loads((tmp_path / "out" / "cmp.json").read_text())
    assert data["devices"] == 2
    assert (tmp_path / "out" / "cmp.png").read_bytes()[:4] == b"\x89PNG"
