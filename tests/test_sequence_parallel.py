"""Megatron-LM sequence parallelism (``MegatronConfig.sequence_parallel``)."""

import pytest
from torch.distributed.tensor.placement_types import Shard

from training.launch import launch
from ir import trace
from ir.repeated_blocks import find_layers
from models.source import build_model
from planner.api import PlanningError
from planner.baselines.megatron import MegatronConfig, megatron_layout, megatron_plan


def _pinned(graph, cfg):
    """Op nodes the sequence-parallel layout adds to the plain Megatron layout."""
    plain = MegatronConfig(cfg.tp, cfg.dp)
    return {k: v for k, v in megatron_layout(graph, cfg).items()
            if k not in megatron_layout(graph, plain)}


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny", "moe-tiny"])
def test_layout_splits_residual_adds_and_norm_outputs_on_the_sequence(name):
    model, inputs = build_model(name, device="meta")
    graph = trace(model, inputs)
    pinned = _pinned(graph, MegatronConfig(2, 2, sequence_parallel=True))
    layers = find_layers(graph)
    # per layer: two residual adds and two norm outputs (attention and MLP / MoE)
    assert len(pinned) == 4 * len(layers)
    assert sum(graph[n].target == "aten.add.Tensor" for n in pinned) == 2 * len(layers)
    batch, seq = inputs[0].shape
    for name_, placements in pinned.items():
        assert graph[name_].outputs[0].shape[:2] == (batch, seq)
        assert placements == (Shard(0), Shard(1))  # batch over dp, sequence over tp
    assert set(_pinned(graph, MegatronConfig(2, 1, sequence_parallel=True)).values()) == {
        (Shard(1),)}


def _plan(cluster, cfg, cache=None, **zoo_kwargs):
    model, inputs = build_model("gpt-tiny", device="meta", **zoo_kwargs)
    return megatron_plan(model, cluster, cfg, example_inputs=inputs, model_source="gpt-tiny",
                         zoo_kwargs=zoo_kwargs, cache=cache)


@pytest.mark.parametrize("cluster, tp, dp", [("local-cpu:2", 2, 1), ("local-cpu:4", 2, 2)])
def test_sequence_parallel_plan_reduce_scatters_and_saves_activations(cluster, tp, dp):
    cfg = MegatronConfig(tp, dp, sequence_parallel=True)
    plain, sp = _plan(cluster, MegatronConfig(tp, dp)), _plan(cluster, cfg)
    model, inputs = build_model("gpt-tiny", device="meta")
    pinned = _pinned(trace(model, inputs), cfg)
    want = (["S(0)"] if dp > 1 else []) + ["S(1)"]
    assert all(sp.nodes[n].outputs[0] == want for n in pinned)
    assert sp.training["manual"]["sequence_parallel"] is True

    def on_tp(src, dst):
        return [r for r in sp.reshards if r.src[-1] == src and r.dst[-1] == dst]

    # the row-parallel outputs reach the residual adds by reduce-scatter, not all-reduce
    adds = {n for n in pinned if sp.nodes[n].op == "aten.add.Tensor"}
    assert {r.node for r in on_tp("P", "S(1)")} == adds
    assert not on_tp("P", "R")
    # the norm outputs are all-gathered before the column-parallel linears
    assert len(on_tp("S(1)", "R")) >= len(pinned) - len(adds)
    act = "activations"
    assert (sp.predicted["memory_bytes_per_device"][act]
            < plain.predicted["memory_bytes_per_device"][act])


def test_sequence_parallel_pipeline_plan_keeps_its_own_stage_context():
    cache: dict = {}  # shared, as planner compare shares it over the grid
    kw = dict(pipeline_model_parallel_size=2, micro_batch_size=2)
    _plan("local-cpu:4", MegatronConfig(2, 1, **kw), cache)
    p = _plan("local-cpu:4", MegatronConfig(2, 1, sequence_parallel=True, **kw), cache)
    assert [s.layers for s in p.pipeline.stages] == [
        ["transformer.wte+transformer.wpe", "transformer.h.0"],
        ["transformer.h.1", "transformer.ln_f+lm_head"]]
    # each block's output (its last residual add) stays sequence-sharded: layer 0's is
    # sent to stage 1
    for block in ("transformer.h.0", "transformer.h.1"):
        adds = [name for name, n in p.nodes.items()
                if n.op == "aten.add.Tensor" and n.module.startswith(block)]
        assert p.nodes[adds[-1]].outputs[0] == ["S(1)"], block


def test_sequence_parallel_needs_tp_and_a_divisible_sequence():
    with pytest.raises(PlanningError, match="tensor_model_parallel_size > 1"):
        MegatronConfig(1, 2, sequence_parallel=True)
    with pytest.raises(PlanningError, match=r"sequence length \(31\) to be a multiple of tp=2"
                       ) as err:
        _plan("local-cpu:2", MegatronConfig(2, 1, sequence_parallel=True), seq_len=31)
    assert "\n" not in str(err.value)
    model, inputs = build_model("mlp-tiny", device="meta")
    with pytest.raises(PlanningError, match="no \\[batch, seq, hidden\\] activations"):
        megatron_plan(model, "local-cpu:2", MegatronConfig(2, 1, sequence_parallel=True),
                      example_inputs=inputs)


@pytest.mark.multiprocess
def test_sequence_parallel_plan_runs_and_matches_one_process(tmp_path):
    path = tmp_path / "plan.json"
    _plan("local-cpu:2", MegatronConfig(2, 1, sequence_parallel=True)).save(path)
    result = launch(path, steps=2, check=True)
    assert result["passed"], result.get("output")
    assert result["max_rel_grad_err"] < 1e-5 and result["observed_match"]
