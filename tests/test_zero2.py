"""ZeRO-2 pipeline stages: priced and searched (run: tests/test_pipeline_run.py's pp2 stages).

ZeRO-2 shards a stage's optimizer states and gradients over the stage mesh's
data-parallel axis and keeps its parameters unsharded from forward to
backward: FSDP2 ``fully_shard(reshard_after_forward=False)`` of the stage's
module. FSDP2 stores the fp32 master parameters sharded at ZeRO-2 too, and a
stage module is FSDP2's root, which ZeRO-3 (FSDP2's default resharding) does
not reshard after forward either, while torch's pipeline stage keeps the
parameters unsharded between micro-batches: both stages all-gather the
parameters once and reduce-scatter the gradients once per step (counted under
torch 2.13's 1F1B and GPipe schedules) and allocate the same bytes. So the
cost model prices ZeRO-2 as ZeRO-3: memory between ZeRO-0's and ZeRO-3's
(equal to ZeRO-3's), communication no more than ZeRO-3's (equal).
"""

from __future__ import annotations

import pytest
from torch.distributed.tensor import Replicate

from costmodel.presets import load_cluster
from costmodel.collectives import axis_links, collective_time
from costmodel.memory import training_state_bytes
from costmodel.strategy_cost import FSDP_STAGES, IntraOpCost
from ir.graph import PARAM
from models.source import build_model
from ir.strategy import Strategy
from ir.trace import trace
from planner.request import PlanningError

REPLICATED = Strategy(inputs=(), outputs=((Replicate(),),))


def _state_prices(zero_stage: int) -> tuple[dict[str, float], float, int]:
    """gpt-tiny's parameters replicated on a 4-rank stage mesh under ``zero_stage``:
    (bytes per device by kind, seconds of the step's once-per-step collectives,
    parameters)."""
    model, inputs = build_model("gpt-tiny", device="meta")
    graph = trace(model, inputs)
    cost = IntraOpCost(graph, load_cluster("local-cpu:4"), (4,), "float32", "adam",
                       zero_stage=zero_stage)
    params = [n for n in graph.nodes if n.kind == PARAM]
    memory: dict[str, float] = {}
    for n in params:
        for kind, nbytes in cost.memory_breakdown(n, REPLICATED).items():
            memory[kind] = memory.get(kind, 0.0) + nbytes
    sync = cost.zero_collectives(sum(cost.zero_bytes(n, REPLICATED) for n in params))
    return memory, sync, sum(n.output.numel for n in params)


def test_zero2_memory_lies_between_zero0_and_zero3_and_sync_is_no_more_than_zero3():
    """fp32 Adam, 4 ranks: ZeRO-0 holds 16 B per parameter (4 parameter, 4
    gradient, 8 Adam states); ZeRO-2 as FSDP2 (the stage one unit) allocates
    it 12 B: the sharded master parameters (1 B) and their gathered whole (4
    B), the sharded gradients (1 B) and the whole gradient until it is
    reduce-scattered (4 B), sharded Adam states (2 B). ZeRO-3 (each layer and
    module a unit of its own) holds the same shards but the whole copies of
    only the units gathered at once. ZeRO-2's step collectives are one
    reduce-scatter and one all-gather of the parameters; ZeRO-0's one
    all-reduce of the gradients (gloo reduce-scatters by all-reducing, so one
    all-reduce is what its ring pair would cost)."""
    (m0, s0, psi), (m2, s2, _), (m3, s3, _) = (_state_prices(z) for z in (0, 2, 3))
    quarter = psi / 4  # each parameter's shard rounds up (FSDP pads): rel=1e-4
    assert m0["params"] == m0["grads"] == pytest.approx(4 * psi)
    assert m0["optimizer"] == pytest.approx(8 * psi)
    assert m2["params"] == pytest.approx(4 * psi + 4 * quarter, rel=1e-4)
    assert m2["grads"] == pytest.approx(4 * psi + 4 * quarter, rel=1e-4)
    assert m2["optimizer"] == pytest.approx(8 * quarter, rel=1e-4)
    total = {z: sum(m.values()) for z, m in ((0, m0), (2, m2), (3, m3))}
    assert total[3] < total[2] < total[0]
    assert m3["optimizer"] == m2["optimizer"]
    assert 4 * quarter < m3["params"] < m2["params"] and m3["grads"] == m3["params"]
    link = axis_links(load_cluster("local-cpu:4"), (4,))[0]
    want = (collective_time("reduce_scatter", 4 * psi, 4, link)
            + collective_time("all_gather", 4 * psi, 4, link))
    # with the copies into and out of the flat buffers each collective moves
    # (read and written at the streaming bandwidth): FSDP2's of the whole
    # gradients and parameters and of this rank's quarter; ZeRO-0's bucket
    device = load_cluster("local-cpu:4").device
    bandwidth = device.memory_bandwidth * device.memory_efficiency
    assert 0.0 < s2 == s3
    assert s2 == pytest.approx(want + 2 * (8 * psi) * 1.25 / bandwidth, rel=1e-9)
    assert s0 == pytest.approx(collective_time("all_reduce", 4 * psi, 4, link)
                               + 2 * 4 * psi / bandwidth, rel=1e-9)


def test_training_state_bytes_of_fsdp2_zero2_shards_the_master_parameters():
    """The ZeRO paper's stage 2 keeps whole master parameters; FSDP2's stores them
    sharded and gathers the compute-dtype copy (bf16-mixed: 4/N + 2 B each)."""
    psi, n = 1000, 4
    paper = training_state_bytes(psi, precision="bf16-mixed", zero_stage=2, dp_size=n)
    fsdp = training_state_bytes(psi, precision="bf16-mixed", zero_stage=2, dp_size=n,
                                params_sharded=True)
    zero3 = training_state_bytes(psi, precision="bf16-mixed", zero_stage=3, dp_size=n)
    assert paper["params"] == 4 * psi + 2 * psi
    assert fsdp == zero3 and fsdp["params"] == 4 * 250 + 2 * psi
    assert fsdp["grads"] == paper["grads"] and fsdp["optimizer"] == paper["optimizer"]
    assert FSDP_STAGES == (2, 3)


def test_plan_with_zero_stages_2_records_zero2_stages_and_refuses_bad_stages():
    from planner.api import plan

    model, inputs = build_model("gpt-tiny")
    kwargs = dict(example_inputs=inputs, pp=[2], schedules=["1f1b"], num_microbatches=[4],
                  time_limit_s=10)
    p = plan(model, "local-cpu:4", zero_stages=[2], **kwargs)
    assert {(st.zero_stage, st.zero_axis) for st in p.pipeline.stages} == {(2, 0)}
    assert all(p.parameters[fqn][0] == "R" for fqn in p.parameters)  # FSDP2 shards axis 0
    for bad in ([4], [-1], []):
        with pytest.raises(PlanningError, match=r"ZeRO stages must be 0 \(none\), 1 "):
            plan(model, "local-cpu:4", zero_stages=bad, **kwargs)


def test_zero1_on_gloo_is_priced_as_the_all_reduce_it_runs():
    """ZeRO-1's step (codegen.zero1) all-reduces the gradients on gloo, which
    reduce-scatters by all-reducing each tensor whole, and each rank keeps
    its slice; on NCCL it reduce-scatters; FSDP2's ZeRO-2 reduce-scatters on
    both. The updated parameters are all-gathered on all. Each with the
    copies into and out of its flat buffers."""
    import dataclasses

    model, inputs = build_model("gpt-tiny", device="meta")
    graph = trace(model, inputs)
    gloo = load_cluster("local-cpu:4")
    link = axis_links(gloo, (4,))[0]
    nbytes = 4.0e6
    gather = collective_time("all_gather", nbytes, 4, link)
    for cluster, zero, kind in ((gloo, 1, "all_reduce"), (gloo, 2, "reduce_scatter"),
                                (dataclasses.replace(gloo, backend="nccl"), 1, "reduce_scatter")):
        cost = IntraOpCost(graph, cluster, (4,), "float32", "adam", zero_stage=zero)
        bandwidth = cluster.device.memory_bandwidth * cluster.device.memory_efficiency
        # ZeRO-1's copies: the gradients' bucket and this rank's slice of the
        # sums; the gathered parameters twice whole and its slice once
        copied = nbytes * (1.25 + 2.25) if zero == 1 else 2 * nbytes * 1.25
        assert cost.zero_collectives(nbytes) == pytest.approx(
            collective_time(kind, nbytes, 4, link) + gather + 2 * copied / bandwidth,
            rel=1e-12), (cluster.backend, zero)
