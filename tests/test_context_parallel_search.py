"""Context parallelism (cp) chosen by the automatic search (issue 39, long context).

A small Llama (one attention head, so that heads cannot split the attention)
at 65,536 tokens on 8 H100s, planned on the meta device: the search tries cp
as Megatron's pricing does (:mod:`planner.search.cp_search`), with everything
else its own choice.
"""

from __future__ import annotations

import pytest

from app.cli import main
from costmodel.presets import load_cluster
from models.zoo import build_from_config
from models.zoo.llama import LlamaConfig
from planner.api import plan
from planner.search.cp_search import CP_MIN_CHUNK, CP_MIN_SEQ, search_sizes
from planner.request import PlanningError, PlanRequest

SEQ = 65536


def _model(seq: int = SEQ, dim: int = 256):
    cfg = LlamaConfig(n_layers=2, dim=dim, n_heads=1, n_kv_heads=1, ffn_dim=256, vocab_size=256,
                      max_seq_len=seq, rope_theta=10000.0)
    return build_from_config(cfg, device="meta", batch_size=1, seq_len=seq)


def _cluster():
    return load_cluster("dgx-h100:1")


@pytest.fixture(scope="module")
def plans():
    """The automatic plan (cp searched) and the plan without cp."""
    model, inputs = _model()
    auto = plan(model, _cluster(), example_inputs=inputs, time_limit_s=5)
    without = plan(model, _cluster(), example_inputs=inputs, time_limit_s=5,
                   context_parallel=(1,))
    return inputs, auto, without


def test_search_sizes_follow_the_rule():
    # long sequences: powers of two dividing the devices, s / cp >= CP_MIN_CHUNK tokens
    assert search_sizes(None, 131072, 64, fits_without=True) == [2, 4, 8, 16]
    assert all(131072 // c >= CP_MIN_CHUNK for c in search_sizes(None, 131072, 64, True))
    # short sequences: only where nothing fits without cp, then any size whose chunks cut it
    assert search_sizes(None, CP_MIN_SEQ // 2, 8, fits_without=True) == []
    assert search_sizes(None, 64, 8, fits_without=False) == [2, 4, 8]
    assert search_sizes(None, None, 8, fits_without=False) == []  # no sequence dimension
    # explicit sizes are checked, 1 means without
    assert search_sizes([1, 4, 2], 1024, 8, fits_without=True) == [2, 4]
    for bad, why in (([3], "power of two"), ([16], "dividing the 8"), ([8], "does not divide")):
        with pytest.raises(PlanningError, match=why):
            search_sizes(bad, 24, 8, fits_without=True)
    with pytest.raises(PlanningError, match="integers >= 1"):
        PlanRequest(context_parallel=(0,))
    with pytest.raises(PlanningError, match="leave out the mesh"):
        PlanRequest(context_parallel=(2,), mesh_shape=(8,))


def test_the_search_picks_context_parallelism_at_a_long_sequence(plans):
    """cp > 1, recorded as Megatron records it, faster than the best plan without it,
    the batch rows (each sequence's cp chunks) split over stage mesh axis 0."""
    inputs, auto, without = plans
    cp = auto.training["context_parallel"]
    assert cp["size"] > 1 and cp["comm_type"] in ("p2p", "all_gather")
    assert cp["sequence_shapes"] == [[1, SEQ], [1, SEQ]]
    assert auto.training["input_shapes"][0] == [cp["size"], SEQ // cp["size"]]
    assert "context_parallel" not in without.training
    assert auto.predicted["step_time_s"] < without.predicted["step_time_s"]
    priced = auto.predicted["context_parallel"]
    assert priced["kv_buffer_bytes"] > 0 and all(s > 0 for s in
                                                 priced["exchange_s_per_microbatch"])
    assert all(p[0] == "S(0)" for p in auto.inputs.values())
    stage_axis0 = (auto.pipeline.stage_mesh["shape"] if auto.pipeline else auto.mesh_shape)[0]
    assert stage_axis0 % cp["size"] == 0
    peak = auto.predicted["memory_bytes_per_device"]["peak"]
    assert peak <= auto.training["memory_budget_bytes"]


def test_a_sequence_that_fits_only_split_is_planned_with_context_parallelism():
    """Below CP_MIN_SEQ cp is tried only where nothing fits without it: with the
    memory a cp plan needs and no more, the search without cp answers "does not
    fit" and the automatic search finds a cp plan within it."""
    model, inputs = _model(seq=CP_MIN_SEQ // 2, dim=1024)
    split = plan(model, _cluster(), example_inputs=inputs, time_limit_s=5, context_parallel=(8,))
    budget = split.predicted["memory_bytes_per_device"]["peak"]
    with pytest.raises(PlanningError, match="fits"):
        plan(model, _cluster(), example_inputs=inputs, time_limit_s=5, context_parallel=(1,),
             memory_budget=budget)
    auto = plan(model, _cluster(), example_inputs=inputs, time_limit_s=5, memory_budget=budget)
    assert auto.training["context_parallel"]["size"] > 1
    assert auto.predicted["memory_bytes_per_device"]["peak"] <= budget


def test_context_parallel_plans_are_deterministic(tmp_path):
    model, inputs = _model()
    paths = []
    for k in range(2):
        p = plan(model, _cluster(), example_inputs=inputs, time_limit_s=5, context_parallel=(4,))
        assert p.training["context_parallel"]["size"] == 4
        paths.append(tmp_path / f"plan{k}.json")
        p.save(paths[-1])
    assert paths[0].read_bytes() == paths[1].read_bytes()


@pytest.mark.parametrize("flag, message", [
    (["--context-parallel", "3"], "power of two"),
    (["--cp", "0"], "--context-parallel '0' must be integers >= 1"),
    (["--cp", "two"], "--context-parallel 'two' is not a comma-separated list"),
    (["--cp", "16"], "dividing the 8 devices"),
    (["--cp", "2", "--mesh", "8"], "leave out the mesh"),
])
def test_bad_context_parallel_flags_are_one_line_errors(flag, message, capsys, tmp_path,
                                                        monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["plan", "--model", "llama-tiny", "--cluster", "dgx-h100:1", *flag]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and err.startswith("planner: error:")


def test_the_cli_plans_with_the_sizes_given(capsys, tmp_path):
    out = tmp_path / "plan.json"
    assert main(["plan", "--model", "llama-tiny", "--cluster", "dgx-h100:1", "--cp", "2",
                 "--quiet", "--time-limit", "5", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "context parallelism: each sequence over 2 ranks" in text
    from plan.format import load_plan

    assert load_plan(out).training["context_parallel"]["size"] == 2
