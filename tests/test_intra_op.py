"""The intra-op pass: real graphs, real DTensor strategies, the expected answers."""

import itertools

import pytest
import torch
from torch import nn

from costmodel.presets import load_cluster
from costmodel.strategy_cost import IntraOpCost
from ir import trace
from models.zoo import GPTConfig, build_from_config
from planner.api import plan
from planner.ilp.solve import brute_force, solve
from planner.ilp.intra_op import build_problem
from planner.ilp.strategies import build_strategies, fake_mesh


class _Linear(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(x).sum()


def test_ilp_on_a_real_graph_equals_enumeration():
    with torch.device("meta"):
        model, x = _Linear(), torch.empty(4, 8)
    graph = trace(model, (x,))
    cluster = load_cluster("local-cpu:2")
    with fake_mesh((2,)) as mesh:
        strategies = build_strategies(graph, mesh)
    problem = build_problem(IntraOpCost(graph, cluster, (2,), "float32"), strategies).problem
    assert 1 < len(list(itertools.product(*problem.node_costs))) < 200_000
    _, best = brute_force(problem)
    assert solve(problem).objective_s == pytest.approx(best, rel=1e-9)


def _a100(n):
    return load_cluster("dgx-a100-80g").sub_cluster(1, n)


def test_small_batch_gpt_block_is_no_slower_than_megatron():
    """One sequence on 4 devices: data parallelism cannot split it, so the
    weights are sharded. The solver's plan is never slower than Megatron's
    layout (column-parallel qkv and fc, row-parallel projections) priced by
    the same model; with fused attention, replicating the cheap attention
    core and gathering once can beat Megatron's all-reduce."""
    from torch.distributed.tensor import Shard

    from planner.ilp.intra_op import solve_intra_op

    model, inputs = build_from_config(GPTConfig(1, 1024, 16, vocab_size=50304, block_size=1024),
                                      batch_size=1)
    p = plan(model, _a100(4), example_inputs=inputs, mesh_shape=(4,))
    block = "transformer.h.0."
    # the big weights sharded, on either dim (nn.Linear's [out, in]: S(0) column
    # parallel, S(1) row parallel; near-ties apart)
    for name in ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight",
                 "mlp.c_proj.weight"):
        assert p.parameters[block + name] in (["S(0)"], ["S(1)"])
    assert p.solver.status == "OPTIMAL"
    megatron = {block + "attn.c_attn.weight": (Shard(0),), block + "attn.c_proj.weight": (Shard(1),),
                block + "mlp.c_fc.weight": (Shard(0),), block + "mlp.c_proj.weight": (Shard(1),)}
    pinned = solve_intra_op(trace(model, inputs), _a100(4), (4,), fixed=megatron)
    assert p.predicted["step_time_s"] <= pinned.solution.objective_s * (1 + 1e-9)


def test_large_batch_small_model_comes_out_data_parallel():
    """Every GEMM runs data-parallel: its batch rows split, its weight whole at
    the op. A weight may be stored sharded and gathered before use, as ZeRO-3
    does, where the gather costs less than updating the whole weight on every
    device (torch's foreach AdamW passes over it 20 times)."""
    model, inputs = build_from_config(GPTConfig(1, 256, 4, vocab_size=1024, block_size=128),
                                      batch_size=256)
    p = plan(model, _a100(4), example_inputs=inputs, mesh_shape=(4,))
    assert p.inputs["idx"] == ["S(0)"]
    gemms = [op for op in p.nodes.values() if op.op in ("aten.addmm.default", "aten.mm.default")]
    assert len(gemms) == 5
    for op in gemms:
        assert op.outputs == [["S(0)"]]
        assert sorted(op.inputs) == sorted([["S(0)"]] + [["R"]] * (len(op.inputs) - 1))
    gathered = {r.arg for r in p.reshards if r.dst == ["R"] and r.arg.startswith("p_")}
    assert all(pl == ["R"] or f"p_{fqn.replace('.', '_')}" in gathered
               for fqn, pl in p.parameters.items())
    # gradient synchronisation of the replicated parameters is in the prediction
    assert p.predicted["communication_s"] > 0


def test_repeated_blocks_share_one_solution():
    from ir.repeated_blocks import find_layers

    model, inputs = build_from_config(GPTConfig(4, 64, 4, vocab_size=128, block_size=32),
                                      batch_size=8)
    graph = trace(model, inputs)
    layers = find_layers(graph)
    assert [l.name for l in layers] == [f"transformer.h.{i}" for i in range(4)]
    assert len({l.signature for l in layers}) == 1
    cluster = load_cluster("local-cpu:4")
    with fake_mesh((4,)) as mesh:
        strategies = build_strategies(graph, mesh)
    cost = IntraOpCost(graph, cluster, (4,), "float32")
    tied = build_problem(cost, strategies)
    untied = build_problem(cost, strategies, tie=False)
    block = len(layers[0].nodes)
    assert len(tied.problem.node_costs) <= len(untied.problem.node_costs) - 2 * block
    # tying restricts the search: never better than the untied optimum, and here as good
    t, u = solve(tied.problem), solve(untied.problem)
    assert t.objective_s >= u.objective_s * (1 - 1e-9)
    assert t.objective_s == pytest.approx(u.objective_s, rel=0.05)
    p = plan(model, cluster, example_inputs=inputs, mesh_shape=(4,))
    for i in range(1, 4):
        for name in ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight"):
            assert p.parameters[f"transformer.h.{i}.{name}"] == p.parameters[
                f"transformer.h.1.{name}"]


def test_two_nodes_data_parallel_across_megatron_inside():
    """(dp, tp) on 2 nodes x 4 GPUs: the network axis carries the weights'
    collectives (a whole weight's all-reduced gradient, or a sharded one
    gathered for its use and its gradient reduce-scattered: the same bytes in
    one micro-batch, for a quarter of the optimizer's update) and no
    activations to speak of; the NVLink axis shards the MLP Megatron-style."""
    cluster = load_cluster("dgx-a100-80g:2").sub_cluster(2, 4)
    model, inputs = build_from_config(GPTConfig(1, 2048, 16, vocab_size=32768, block_size=1024),
                                      batch_size=32)
    p = plan(model, cluster, example_inputs=inputs, mesh_shape=(2, 4))
    assert p.inputs["idx"] == ["S(0)", "R"]  # data parallel across nodes
    across = [r for r in p.reshards if r.src[0] not in ("R", r.dst[0])]
    assert sum(r.time_s for r in across if not r.arg.startswith("p_")) < (
        0.01 * p.predicted["step_time_s"])
    blk = "transformer.h.0."
    assert p.parameters[blk + "mlp.c_fc.weight"][1] == "S(0)"
    assert p.parameters[blk + "mlp.c_proj.weight"][1] == "S(1)"
    assert p.parameters[blk + "attn.c_attn.weight"][1] != "R"
    assert p.nodes["addmm_2"].inputs[1][0] == "S(0)"  # activations batch-sharded over nodes


def test_megatron_warm_start_and_time_limited_solve():
    """The Megatron-style warm start pins the Megatron parameter layout, is far
    cheaper than replicating everything on a small-batch model, and a solve cut off
    by a tiny time limit is never worse than it."""
    from planner.ilp.intra_op import prepare_intra_op, solve_prepared
    from planner.ilp.warm_starts import best_warm_start, warm_starts

    model, inputs = build_from_config(GPTConfig(1, 1024, 16, vocab_size=50304, block_size=1024),
                                      batch_size=1)
    graph = trace(model, inputs)
    prepared = prepare_intra_op(graph, _a100(4), (4,))
    hints = warm_starts(prepared.graph, prepared.mesh_shape, prepared.strategies,
                        prepared.built.members, prepared.built.problem)
    problem, built = prepared.built.problem, prepared.built
    meg = {prepared.strategies[g[0]].node.fqn: prepared.strategies[g[0]].strategies[i].outputs[0]
           for g, i in zip(built.members, hints["megatron"])
           if prepared.strategies[g[0]].node.kind == "param"}
    block = "transformer.h.0."
    from torch.distributed.tensor.placement_types import Shard
    assert meg[block + "attn.c_attn.weight"] == (Shard(0),)
    assert meg[block + "attn.c_proj.weight"] == (Shard(1),)
    assert meg[block + "mlp.c_fc.weight"] == (Shard(0),)
    assert meg[block + "mlp.c_proj.weight"] == (Shard(1),)
    megatron, replicate = (problem.evaluate(hints[k]) for k in ("megatron", "replicate"))
    assert megatron < 0.7 * replicate
    assert best_warm_start(problem, hints) == "megatron"
    optimum = solve_prepared(prepared, time_limit_s=30).solution.objective_s
    assert optimum <= megatron * (1 + 1e-9)
    quick = solve_prepared(prepared, time_limit_s=0.001).solution
    assert quick.objective_s <= megatron * (1 + 1e-9)
    assert problem.evaluate(quick.choice, quick.checkpoint) == pytest.approx(quick.objective_s)


def test_restricted_problem_prices_a_known_assignment_without_repricing():
    """restrict() keeps the priced costs: solving a problem narrowed to one strategy
    per variable gives exactly that assignment's seconds on the full problem, and
    with a weight on memory it decides checkpointing by the weighted objective."""
    from planner.ilp.intra_op import prepare_intra_op, restrict, solve_prepared

    model, inputs = build_from_config(GPTConfig(2, 256, 4, vocab_size=512, block_size=64),
                                      batch_size=8)
    graph = trace(model, inputs)
    prepared = prepare_intra_op(graph, _a100(4), (2, 2))
    full = prepared.built.problem
    best = solve_prepared(prepared, time_limit_s=30)
    choice = best.solution.choice
    narrowed = restrict(prepared, [[i] for i in choice])
    assert all(len(c) == 1 for c in narrowed.built.problem.node_costs)
    again = solve_prepared(narrowed, time_limit_s=30)
    assert again.chosen == best.chosen
    assert again.solution.objective_s == pytest.approx(full.evaluate(choice, again.solution.checkpoint),
                                                       rel=1e-12)
    # memory priced high enough: the cheaper-in-memory checkpoint decision wins
    heavy = solve_prepared(narrowed, time_limit_s=30, memory_weight=1.0)
    light = full.memory(choice, heavy.solution.checkpoint)
    assert light <= full.memory(choice, [False] * len(full.checkpoint_groups))
    assert light == min(full.memory(choice, list(c)) for c in
                        itertools.product((False, True), repeat=len(full.checkpoint_groups)))


def test_a_shared_resharding_pricer_gives_the_same_problem_and_checks_its_mesh(monkeypatch):
    """Problems priced one after another on one mesh may share a ReshardPricer
    (the search does): the prices are the same as with a pricer of their own,
    and an edge between strategy lists priced before is not priced again."""
    from planner.ilp import intra_op
    from costmodel.collectives import axis_links
    from costmodel.resharding import ReshardPricer

    model, inputs = build_from_config(GPTConfig(2, 32, 4, vocab_size=64, block_size=16),
                                      batch_size=4)
    graph = trace(model, inputs)
    cluster = load_cluster("local-cpu:4")
    with fake_mesh((2, 2)) as mesh:
        strategies = build_strategies(graph, mesh)
    alone = build_problem(IntraOpCost(graph, cluster, (2, 2), "float32"), strategies).problem
    shared = ReshardPricer((2, 2), axis_links(cluster, (2, 2)))
    build_problem(IntraOpCost(graph, cluster, (2, 2), "float32", pricer=shared), strategies)
    priced = []
    real = intra_op._priced_matrix
    monkeypatch.setattr(intra_op, "_priced_matrix", lambda *a: priced.append(a) or real(*a))
    again = build_problem(IntraOpCost(graph, cluster, (2, 2), "float32", pricer=shared),
                          strategies).problem
    assert not priced
    assert again.node_costs == alone.node_costs
    assert [(u, v, m) for u, v, m in again.edges] == [(u, v, m) for u, v, m in alone.edges]
    with pytest.raises(ValueError, match="shared pricer is for mesh"):
        IntraOpCost(graph, cluster, (4,), "float32", pricer=shared)


def test_checkpointed_layers_keep_their_inputs_per_device():
    """A checkpointed layer keeps its input as this device holds it: on a
    data-parallel mesh of 4, a quarter of the one-device bytes (batch split)."""
    from planner.ilp.intra_op import solve_intra_op
    from planner.megatron_layout import MegatronConfig, megatron_layout

    model, inputs = build_from_config(GPTConfig(4, 1024, 8, vocab_size=512, block_size=512),
                                      batch_size=64, seq_len=512)
    graph = trace(model, inputs)
    cluster = load_cluster("dgx-a100-80g:1")
    one = solve_intra_op(graph, cluster.sub_cluster(1, 1), (1,), dtype="bf16-mixed",
                         recompute=True)
    four = solve_intra_op(graph, cluster.sub_cluster(1, 4), (4,), dtype="bf16-mixed", recompute=True,
                          fixed=megatron_layout(graph, MegatronConfig(1, 4)))
    assert one.checkpointed and four.checkpointed
    # (the scalar loss is not split)
    assert four.memory["activations"] == pytest.approx(one.memory["activations"] / 4, rel=1e-4)


class _ScaledLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(32, 32)

    def forward(self, x):
        return self.fc(x) * torch.tensor(0.5)


class _TwoBlocks(nn.Module):
    """Two copies of one block; the first reads the user's input, which needs
    no gradient, so its linear runs no input-gradient kernel and the second's does."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([_ScaledLinear(), _ScaledLinear()])
        self.head = nn.Linear(32, 4)

    def forward(self, x, y):
        for b in self.blocks:
            x = b(x)
        return nn.functional.cross_entropy(self.head(x), y)


def test_block_copies_priced_unlike_are_not_tied():
    """The solver's objective is the price of the plan it returns: copies of a
    block tie only where they price alike (the plan of this model used to stop
    on the solver's check that the two agree)."""
    x, y = torch.randn(4, 32), torch.randint(0, 4, (4,))
    p = plan(_TwoBlocks(), "local-cpu:2", example_inputs=(x, y), mesh_shape=(2,),
             time_limit_s=5)
    assert p.predicted["step_time_s"] > 0
