"""Megatron-LM manual plans with expert parallelism (MoE models, the DeepSeek-V3
layout) and with context parallelism (the cp grid, one cp rank's program, the
K/V exchange)."""

import pytest

from training.launch import launch
from costmodel.presets import load_cluster
from ir import trace
from models.source import build_model
from planner.api import PlanningError
from planner.baselines.megatron import (MegatronConfig, megatron_configs, megatron_layout,
                                        megatron_plan)


@pytest.fixture(scope="module")
def moe_tiny():
    model, inputs = build_model("moe-tiny", device="meta")
    return model, inputs, trace(model, inputs)


def test_expert_parallel_configs_are_in_the_grid_of_moe_models_only(moe_tiny):
    from planner.baselines.megatron import num_experts

    cluster = load_cluster("local-cpu:4")
    experts = num_experts(moe_tiny[2])
    assert experts == 4  # moe-tiny: 4 experts per layer
    cfgs = megatron_configs(cluster, 8, 2, num_experts=experts)
    eps: dict[tuple, set] = {}
    for c in cfgs:
        eps.setdefault((c.tp, c.dp, c.pp), set()).add(c.ep)
    assert eps[(1, 4, 1)] == eps[(2, 2, 1)] == eps[(4, 1, 1)] == {1, 2, 4}
    assert eps[(1, 2, 2)] == eps[(2, 1, 2)] == {1, 2}  # a stage's dp x tp = 2 ranks
    for c in cfgs:
        assert (c.dp * c.tp) % c.ep == 0 and experts % c.ep == 0
    labels = [c.label() for c in cfgs]
    assert len(set(labels)) == len(labels) and "tp=1 pp=1 dp=4 ep=4 mbs=2" in labels
    assert {c.ep for c in megatron_configs(cluster, 8, 2, num_experts=experts,
                                           expert_parallel=[4])} == {4}
    gpt = trace(*build_model("gpt-tiny", device="meta"))
    assert num_experts(gpt) is None
    assert {c.ep for c in megatron_configs(cluster, 8, 2, num_experts=num_experts(gpt))} == {1}


def test_expert_parallel_mesh_factors_dp_and_tp():
    """The ep group is ep consecutive ranks (tp fastest) out of dp x tp."""
    assert MegatronConfig(2, 8, expert_model_parallel_size=8).mesh_shape == (2, 4, 2)
    assert MegatronConfig(2, 8, expert_model_parallel_size=16).mesh_shape == (8, 2)
    assert MegatronConfig(4, 2, expert_model_parallel_size=2).mesh_shape == (2, 2, 2)
    assert MegatronConfig(1, 16, expert_model_parallel_size=16).mesh_shape == (16,)
    cfg = MegatronConfig(2, 8, expert_model_parallel_size=8, micro_batch_size=1)
    assert cfg.label() == "tp=2 pp=1 dp=8 ep=8 mbs=1"
    assert cfg.expert_data_parallel_size == 2 and cfg.world_size == 16
    assert [a.expert for a in cfg.mesh_axes] == [False, True, True]
    assert MegatronConfig(2, 8).label() == "tp=2 pp=1 dp=8"  # ep=1 labels are unchanged


def test_invalid_expert_parallel_sizes_are_refused(moe_tiny):
    with pytest.raises(ValueError, match="must divide data_parallel_size x tensor_model"):
        MegatronConfig(1, 4, expert_model_parallel_size=3)
    with pytest.raises(ValueError, match="multiple or a divisor of tensor_model_parallel_size"):
        MegatronConfig(4, 3, expert_model_parallel_size=6)
    with pytest.raises(ValueError, match="integer >= 1"):
        MegatronConfig(1, 4, expert_model_parallel_size=0)
    with pytest.raises(ValueError, match="does not divide the 4 experts"):
        megatron_layout(moe_tiny[2], MegatronConfig(1, 8, expert_model_parallel_size=8))
    gpt = trace(*build_model("gpt-tiny", device="meta"))
    with pytest.raises(ValueError, match="no expert weights"):
        megatron_layout(gpt, MegatronConfig(1, 2, expert_model_parallel_size=2))


def _expert_param_bytes(graph, precision) -> float:
    from costmodel.memory import training_state_bytes
    from planner.megatron_layout import expert_weights

    fqns = expert_weights(graph)
    return sum(training_state_bytes(int(n.output.numel), precision=precision)["params"]
               for n in graph.nodes if n.fqn in fqns)


def test_expert_parallel_layout_shards_expert_weights_and_their_memory(moe_tiny):
    """ep=k splits every expert weight's experts over k ranks: its per-device
    parameter bytes are 1/k, and the dense weights are as without ep."""
    model, inputs, graph = moe_tiny
    plans = {k: megatron_plan(model, "local-cpu:4", MegatronConfig(
        1, 4, expert_model_parallel_size=k), example_inputs=inputs, graph=graph)
        for k in (1, 2, 4)}
    assert plans[1].parameters["transformer.h.0.moe.w_in"] == ["R"]
    assert plans[2].parameters["transformer.h.0.moe.w_in"] == ["R", "S(0)"]  # mesh (2, 2)
    assert plans[4].parameters["transformer.h.1.moe.w_out"] == ["S(0)"]
    assert plans[4].parameters["transformer.h.0.attn.c_attn.weight"] == ["R"]
    assert plans[4].training["manual"]["expert_model_parallel_size"] == 4
    experts = _expert_param_bytes(graph, plans[1].training["precision"])
    params = {k: p.predicted["memory_bytes_per_device"]["params"] for k, p in plans.items()}
    for k in (2, 4):
        assert params[1] - params[k] == pytest.approx(experts * (1 - 1 / k), abs=4)
    # the distributed optimizer splits each weight's states over the ranks holding
    # it: dp ranks for dense weights, dp x tp / ep for experts, the same per device
    opt = {k: p.predicted["memory_bytes_per_device"]["optimizer"] for k, p in plans.items()}
    assert opt[2] == pytest.approx(opt[1], abs=4) and opt[4] == pytest.approx(opt[1], abs=4)


def test_expert_gradients_are_reduced_over_expert_data_parallel_ranks_only(moe_tiny):
    """The cost model all-reduces a weight's gradient over a mesh axis only where
    the weight is replicated: expert weights S(0) on the expert-parallel axes
    reduce over the other axes only (none when ep = dp x tp). Axis 0's sums
    wait for the step's end, priced at the parameter node."""
    from costmodel.strategy_cost import IntraOpCost
    from planner.ilp.intra_op import solve_intra_op
    from planner.megatron_layout import expert_weights

    _, _, graph = moe_tiny
    cluster = load_cluster("local-cpu:4")
    experts = {n.name for n in graph.nodes if n.fqn in expert_weights(graph)}
    axes = {}
    for ep in (1, 2, 4):
        cfg = MegatronConfig(1, 4, expert_model_parallel_size=ep)
        r = solve_intra_op(graph, cluster, cfg.mesh_shape, fixed=megatron_layout(graph, cfg),
                           time_limit_s=10)
        cost = IntraOpCost(graph, cluster, cfg.mesh_shape, "float32")
        axes[ep] = {a for n in graph.nodes if n.target == "aten.bmm.default"
                    for arg, a, _ in cost._gradient_all_reduces(n, r.chosen[n.name])
                    if arg in experts}
        if any(cost.zero_bytes(graph[e], r.chosen[e]) > 0 for e in experts):
            axes[ep].add(0)
    assert axes == {1: {0}, 2: {0}, 4: set()}  # meshes (4,), (2, 2) with ep on axis 1, (4,)


def test_pipelined_expert_parallelism_counts_the_distributed_optimizer_exactly(moe_tiny):
    """With ep = dp (no expert-data-parallel ranks) the stage mesh's ZeRO-1 axis is
    the expert-parallel one: the expert states are not split further, so the
    optimizer bytes per device are those of ep = 1 (states split over all ranks)."""
    model, inputs, graph = moe_tiny
    plans = [megatron_plan(model, "local-cpu:2", MegatronConfig(
        1, 2, expert_model_parallel_size=ep, micro_batch_size=1), example_inputs=inputs,
        graph=graph) for ep in (1, 2)]
    assert plans[1].pipeline is not None and plans[1].pipeline.stages[0].zero_stage == 1
    opt = [p.predicted["memory_bytes_per_device"]["optimizer"] for p in plans]
    assert opt[1] == pytest.approx(opt[0], abs=4)


def test_deepseek_layout_on_a_small_moe():
    """DeepSeek-V3's layout (DualPipeV, expert parallel, ZeRO-1, no tp) with
    small pp and ep, priced like a Megatron configuration."""
    from models.zoo import MoEConfig, build_from_config
    from planner.baselines.deepseek_layout import balanced_layer_split, deepseek_config, deepseek_plan

    assert balanced_layer_split(61, 32) == (1,) + (2,) * 29 + (1, 1)
    assert balanced_layer_split(8, 4) == (2, 2, 2, 2)
    cluster = load_cluster("local-cpu:4")
    cfg = deepseek_config(cluster, 61, pp=2, ep=2)
    assert cfg.schedule == "dualpipev" and cfg.stages_per_rank == 2
    assert (cfg.tp, cfg.dp, cfg.ep, cfg.use_distributed_optimizer) == (1, 2, 2, True)
    assert cfg.layer_split(61) == [15, 16, 15, 15]
    with pytest.raises(ValueError, match="must divide"):
        deepseek_config(cluster, 4, pp=2, ep=4)
    model, inputs = build_from_config(MoEConfig(
        n_layer=4, n_embd=64, n_head=4, n_expert=4, expert_hidden=128, vocab_size=128,
        block_size=32, capacity_factor=2.0, group_size=64), batch_size=8, seq_len=32)
    p = deepseek_plan(model, cluster, example_inputs=inputs, pp=2, ep=2)
    assert p.pipeline.schedule == "dualpipev" and len(p.pipeline.stages) == 4
    assert [s.pp_rank for s in p.pipeline.stages] == [0, 1, 1, 0]
    assert p.parameters["transformer.h.0.moe.w_in"] == ["S(0)"]  # mesh (2,): ep = dp
    assert p.training["manual"]["pipeline_schedule"] == "dualpipev"
    assert p.predicted["step_time_s"] > 0


# --- context parallelism (issue 39: pricing in the Megatron baseline) ---

def test_context_parallel_config_counts_cp_in_the_world_and_the_weights_dp_group():
    """cp ranks multiply the world; the dense weights are replicated over dp x cp
    (Megatron's data-parallel group with cp), the stage mesh's axis 0."""
    cfg = MegatronConfig(2, 2, context_parallel_size=4)
    assert cfg.world_size == 16 and cfg.mesh_shape == (8, 2)
    assert cfg.weight_data_parallel_size == 8
    assert cfg.label() == "tp=2 pp=1 dp=2 cp=4"
    assert MegatronConfig(2, 2, context_parallel_size=2, cp_comm_type="all_gather").label() == \
        "tp=2 pp=1 dp=2 cp=2 cp-comm=all_gather"
    with pytest.raises(ValueError, match="cp_comm_type"):
        MegatronConfig(2, 2, context_parallel_size=2, cp_comm_type="a2a")


def test_context_parallel_inputs_cut_each_sequence_into_cp_rows():
    import torch
    from planner.baselines.megatron import context_parallel_inputs
    idx = torch.empty(4, 32, dtype=torch.long, device="meta")
    cut = context_parallel_inputs((idx, idx), 4)
    assert [tuple(t.shape) for t in cut] == [(16, 8), (16, 8)]
    with pytest.raises(PlanningError, match="2 x cp"):
        context_parallel_inputs((idx,), 32)  # 64 chunks of a 32-token sequence


def test_megatron_grid_tries_context_parallel_sizes_that_cut_the_sequence():
    cluster = load_cluster("dgx-h100:1")
    cfgs = megatron_configs(cluster, 8, 4, micro_batch_sizes=(1,), virtual_stages=(None,),
                            sequence_parallel=(False,), context_parallel=(1, 2, 4), seq_len=8)
    assert {c.cp for c in cfgs} == {1, 2, 4}
    assert all(c.world_size == 8 for c in cfgs)
    # 2 x cp chunks must cut the sequence: cp = 8 on 8 tokens does not
    assert 8 not in {c.cp for c in megatron_configs(cluster, 8, context_parallel=(8,),
                                                    seq_len=8)}
    assert {c.cp for c in megatron_configs(cluster, 8, 4)} == {1}  # off by default


@pytest.fixture(scope="module")
def llama_cp_plans():
    """llama-tiny (GQA) on 4 H100s: tp=2 dp=2, and tp=2 cp=2 in both exchanges."""
    model, inputs = build_model("llama-tiny", device="meta")
    cluster = load_cluster("dgx-h100:1").sub_cluster(1, 4)
    cfgs = [MegatronConfig(2, 2), MegatronConfig(2, 1, context_parallel_size=2),
            MegatronConfig(2, 1, context_parallel_size=2, cp_comm_type="all_gather")]
    return inputs, [megatron_plan(model, cluster, c, example_inputs=inputs) for c in cfgs]


def test_context_parallel_plan_prices_one_cp_ranks_program(llama_cp_plans):
    """A cp plan prices s / cp tokens per sequence on a dp x cp axis, records the
    whole sequences, and adds the K/V exchange and its buffers."""
    inputs, (_, ring, gather) = llama_cp_plans
    b, s = inputs[0].shape
    for plan in (ring, gather):
        assert plan.training["input_shapes"][0] == [2 * b, s // 2]
        assert plan.training["context_parallel"]["sequence_shapes"][0] == [b, s]
        assert plan.pipeline.stage_mesh["shape"] == [2, 2]
        cp = plan.predicted["context_parallel"]
        assert cp["kv_buffer_bytes"] > 0 and all(x > 0 for x in cp["exchange_s_per_microbatch"])
    # all-gather holds every rank's K/V block (2 cp blocks), the ring 4 blocks
    assert gather.predicted["context_parallel"]["kv_buffer_bytes"] == \
        ring.predicted["context_parallel"]["kv_buffer_bytes"]  # cp = 2: 2 cp = 4


@pytest.mark.multiprocess
@pytest.mark.slow  # cp plans run in tests/test_context_parallel_run.py
def test_a_megatron_context_parallel_plan_trains_as_one_process_does(tmp_path):
    """Megatron's cp layout (rows over dp x cp, heads over tp) runs with the ring
    (:mod:`codegen.context_parallel`) and matches one process on the whole
    sequences."""
    model, inputs = build_model("llama-tiny", device="meta")
    plan = megatron_plan(model, load_cluster("local-cpu:4"),
                         MegatronConfig(2, 1, context_parallel_size=2),
                         example_inputs=inputs, model_source="llama-tiny")
    path = tmp_path / "cp.json"
    plan.save(path)
    result = launch(path, check=True, steps=1, timeout_s=240)
    assert result["passed"], result["output"]
    assert result["max_loss_rel_err"] <= 1e-5 and result["max_rel_grad_err"] <= 1e-5


def test_ring_exchange_is_the_overlapped_max_of_compute_and_transfer():
    """p2p: (cp-1) max(t_f, p2p) forward; all-gather: exposed gather + (cp-1) t_f."""
    import math as _m
    from costmodel.collectives import collective_time
    from costmodel.strategy_cost import IntraOpCost
    from planner.search.cp_search import context_parallel_seconds, kv_block_bytes
    from planner.baselines.megatron_pipeline import cp_rank_link as _cp_link
    from planner.ilp.intra_op import solve_intra_op
    from planner.baselines.megatron import context_parallel_inputs
    from ir import trace as _trace
    model, inputs = build_model("llama-tiny", device="meta")
    cut = context_parallel_inputs(inputs, 4)
    graph = _trace(model, cut)
    cluster = load_cluster("dgx-h100:2")
    cfg = MegatronConfig(4, 1, context_parallel_size=4)  # tp x cp = 16 > 8: cp spans nodes
    stage = cluster.sub_cluster(2, 8)
    r = solve_intra_op(graph, stage, cfg.mesh_shape, fixed=megatron_layout(graph, cfg))
    cost = IntraOpCost(r.graph, stage, r.mesh_shape, "float32", "adam")
    link = _cp_link(stage, cfg)
    assert link.name == stage.inter_node.name
    f, b, held = context_parallel_seconds(r, cost, cfg.cp, cfg.cp_comm_type, link)
    want_f = want_b = 0.0
    for n in r.graph.nodes:
        if n.target == "aten.scaled_dot_product_attention.default":
            p = cost.prices(n, r.chosen[n.name])
            kv = kv_block_bytes(r.graph, n, r.chosen[n.name].inputs, r.mesh_shape)
            hop = collective_time("p2p", kv, 2, link)
            want_f += 3 * max(p.forward_s, hop)
            want_b += 3 * max(sum(p.backward_s), 2 * hop) + hop
    assert f == pytest.approx(want_f) and b >= want_b * (1 - 1e-12) and held > 0
    # GQA: llama-tiny repeats its 2 K/V heads to 4; the block counts 2
    n = next(n for n in r.graph.nodes if n.target == "aten.scaled_dot_product_attention.default")
    k = r.graph[n.args[1]].outputs[0]
    assert kv_block_bytes(r.graph, n, None, (1,)) == pytest.approx(
        2 * _m.prod(k.shape) * k.itemsize / 2)
