"""Weight gradients priced as the runtime reduces them.

The runtime lets a data-parallel weight gradient's sum accumulate over the
step's micro-batches and all-reduces it once, in buckets
(``codegen.grad_reduction``); a weight stored sharded and gathered for its
use gets its gradient reduce-scattered by DTensor's backward of the gather,
in every micro-batch; a fixed (Megatron) layout computes with its split
weights and never gathers them.
"""

from __future__ import annotations

import pytest
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from costmodel.collectives import axis_links, collective_time
from costmodel.presets import load_cluster
from costmodel.resharding import weight_gradient_placements
from costmodel.strategy_cost import IntraOpCost
from ir.graph import PARAM
from ir.trace import trace
from models.source import build_model
from planner.baselines.megatron import MegatronConfig, megatron_plan
from planner.api import pipeline_plan


def test_a_gathered_weight_gets_its_gradient_reduce_scattered():
    r, s0 = Replicate(), Shard(0)
    assert weight_gradient_placements((s0,), (r,)) == (Partial(),)
    assert weight_gradient_placements((s0, s0), (r, s0)) == (Partial(), s0)
    assert weight_gradient_placements((r,), (r,)) == (r,)  # the sum waits for the step's end
    assert weight_gradient_placements((r, s0), (r, r)) == (r, r)  # gathered on axis 1 only
    model, inputs = build_model("gpt-tiny", device="meta")
    cluster = load_cluster("local-cpu:2")
    cost = IntraOpCost(trace(model, inputs), cluster, (2,), "float32")
    info = next(n.output for n in cost.graph.nodes if n.kind == PARAM
                and len(n.output.shape) == 2)
    link = axis_links(cluster, (2,))[0]
    nbytes = info.numel * info.itemsize
    assert cost.gradient_reshard((s0,), (r,), info, weight=True) == pytest.approx(
        collective_time("reduce_scatter", nbytes, 2, link), rel=1e-9)
    assert cost.gradient_reshard((s0,), (r,), info) == 0.0  # an activation: a local slice


def test_a_plain_stage_reduces_its_weight_gradients_once_per_step():
    """Micro-batches of gpt-tiny on 2 ranks without ZeRO: the weights'
    all-reduce is in the step's gradient sync, once: as long for 8 of them
    as for 2."""
    model, inputs = build_model("gpt-tiny", device="meta")
    plans = {m: pipeline_plan(model, "local-cpu:2", example_inputs=inputs, pp=1, stage_mesh=(2,),
                              schedule="1f1b", num_microbatches=m, zero_stage=0, time_limit_s=10)
             for m in (2, 8)}
    sync = {m: p.pipeline.stages[0].predicted["grad_sync_s"] for m, p in plans.items()}
    assert sync[2] > 0 and sync[8] == pytest.approx(sync[2], rel=1e-9)


def test_megatron_tensor_parallel_weights_are_used_where_they_lie():
    """tp=2 on a one-axis mesh: the column- and row-parallel weights of every
    block compute split; none is gathered for its op."""
    model, inputs = build_model("gpt-tiny", device="meta")
    p = megatron_plan(model, "local-cpu:2", MegatronConfig(2, 1), example_inputs=inputs,
                      time_limit_s=10)
    split = {f"p_{fqn.replace('.', '_')}" for fqn, pl in p.parameters.items()
             if ".h." in fqn and pl != ["R"]}
    assert split
    assert not [r for r in p.reshards if r.arg in split]


def test_zero3_units_pay_their_calls():
    """gpt-tiny under ZeRO-3 on 2 ranks: every FSDP2 unit's collective call
    beyond the one each kind is priced as adds the profiled call cost: the
    forward's all-gathers, the backward's all-gathers and reduce-scatters."""
    from dataclasses import replace

    from ir.shard_units import shard_units

    model, inputs = build_model("gpt-tiny", device="meta")
    graph = trace(model, inputs)
    plain = load_cluster("local-cpu:2")
    measured = replace(plain, device=replace(plain.device, fsdp_call_overhead=1e-3))
    costs = [IntraOpCost(graph, c, (2,), "float32", zero_stage=3) for c in (plain, measured)]
    units = len(shard_units(graph))
    own = int(bool(costs[0].pass_params))
    assert units >= 2 and costs[1].zero3_calls == (units + own, 2 * units + own)
    (f0, b0), (f1, b1) = (c.zero3_layer_collectives(4e6, 3e6) for c in costs)
    assert f1 - f0 == pytest.approx((units + own - 1) * 1e-3)
    assert b1 - b0 == pytest.approx((2 * units + own - 2) * 1e-3)


def test_a_whole_batch_plan_predicts_the_step_the_search_ranked_it_by(monkeypatch):
    """gpt-tiny on 2 ranks, one stage of the whole batch: the plan written
    predicts the step its search candidate was ranked by (the gradients'
    all-reduce paying its latency once), and so does the same mesh asked for
    directly."""
    from planner.api import plan
    from planner.search import two_level

    ranked = []
    assembled = two_level._assembled

    def spy(winner, ctx, build):
        if winner.candidate.schedule == two_level.NO_PIPELINE:
            ranked.append(winner.step_time_s)
        return assembled(winner, ctx, build)

    monkeypatch.setattr(two_level, "_assembled", spy)
    model, inputs = build_model("gpt-tiny", device="meta", batch_size=8)
    searched = plan(model, "local-cpu:2", example_inputs=inputs, pp=[1], time_limit_s=10)
    assert searched.pipeline is None and searched.mesh_shape == (2,) and len(ranked) == 1
    assert searched.predicted["step_time_s"] == pytest.approx(ranked[0], rel=1e-5)
    direct = plan(model, "local-cpu:2", example_inputs=inputs, mesh_shape=(2,), time_limit_s=10)
    assert direct.predicted["step_time_s"] == pytest.approx(ranked[0], rel=1e-5)
