"""ZeRO-1 pipeline stages: the search's choice of ZeRO stage and how the
optimizer's slices are cut (run against one process for three AdamW steps:
tests/test_pipeline_run.py's pp2 data-parallel stages).

ZeRO-1 (:mod:`codegen.zero1`) keeps a stage's parameters and gradients whole
and shards the optimizer states over the stage mesh's axis 0: the gradient
sums are reduce-scattered and the updated parameter slices all-gathered once
per step, Megatron's distributed optimizer.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from codegen.zero1 import slice_bounds
from costmodel.presets import load_cluster
from costmodel.strategy_cost import IntraOpCost
from ir.graph import PARAM
from ir.source import build_model
from ir.strategy import Strategy
from ir.trace import trace
from planner.pipeline import zero_stages_priced
from planner.request import PlanningError


@pytest.mark.parametrize("size,parts", [(8, 4), (10, 4), (3, 4), (1, 2), (0, 2), (7, 7)])
def test_slices_are_cut_as_dtensor_shards_a_dimension(size, parts):
    """The optimizer's slice of a parameter must be the rows DTensor's
    ``Shard`` gives the rank's reduce-scattered gradient."""
    whole = torch.arange(size * 3, dtype=torch.float32).reshape(size, 3)
    for rank in range(parts):
        start, length = slice_bounds(size, parts, rank)
        local, _ = Shard(0)._split_tensor(whole, parts, with_padding=False)
        assert torch.equal(whole.narrow(0, start, length), local[rank])


def test_search_prices_zero1_and_fsdp2_where_neither_dominates():
    """Under bf16-mixed on more than 2 ranks FSDP2 (ZeRO-3: 4 + 16/N bytes
    per parameter, the fp32 gradients sharded too) holds less than ZeRO-1
    (Megatron's distributed optimizer: 6 + 12/N), but ZeRO-1 takes parameters
    sharded on the ZeRO axis (experts), so both are priced, least memory
    first; on 2 ranks they hold the same and ZeRO-1 is priced alone; under
    fp32 and bf16 ZeRO-1 holds less (FSDP2 keeps the gathered parameters and
    whole gradients besides their shards) and is priced alone. Restricted
    choices are kept; ZeRO-2 and 3 tie, to 3."""
    assert zero_stages_priced((0, 1, 2, 3), "bf16-mixed", "adam", 4) == [3, 1]
    assert zero_stages_priced((0, 1, 2, 3), "bf16-mixed", "adam", 2) == [1]
    assert zero_stages_priced((0, 1, 2, 3), "fp32", "adam", 4) == [1]
    assert zero_stages_priced((0, 1, 2, 3), "bf16", "adam", 8) == [1]
    assert zero_stages_priced((1,), "bf16-mixed", "adam", 4) == [1]
    assert zero_stages_priced((0, 2), "fp32", "adam", 4) == [2]
    assert zero_stages_priced((0,), "fp32", "adam", 4) == []


def test_zero1_under_bf16_mixed_prices_the_distributed_optimizer():
    """bf16-mixed Adam, 4 ranks, ZeRO-1: a parameter replicated on axis 0
    holds its bf16 working copy (2 B) and fp32 gradient (4 B) whole and a
    quarter of the fp32 master copy and Adam's moments (12/4 B); one the
    plan shards on axis 0 (an expert weight) the same layout over its own
    shard, its master copy and moments not split again."""
    model, inputs = build_model("gpt-tiny", device="meta")
    graph = trace(model, inputs)
    cost = IntraOpCost(graph, load_cluster("local-cpu:4"), (4,), "bf16-mixed", "adam",
                       zero_stage=1)
    node = next(n for n in graph.nodes if n.kind == PARAM and len(n.output.shape) == 2
                and n.output.shape[0] % 4 == 0)
    numel = node.output.numel
    whole = cost.memory_breakdown(node, Strategy(inputs=(), outputs=((Replicate(),),)))
    assert whole == {"params": 2 * numel, "grads": 4 * numel, "optimizer": 12 * numel / 4}
    sharded = cost.memory_breakdown(node, Strategy(inputs=(), outputs=((Shard(0),),)))
    assert sharded == {"params": 2 * numel / 4, "grads": 4 * numel / 4,
                       "optimizer": 12 * numel / 4}


def test_zero1_prices_sharded_states_only_for_parameters_replicated_on_axis_0():
    """fp32 Adam, 4 ranks: a parameter replicated on axis 0 holds 4 B
    parameter, 4 B gradient and 8/4 B of Adam states per element under
    ZeRO-1; one the plan shards on axis 0 (an expert weight) holds the states
    of its own shard, not a quarter of them again."""
    model, inputs = build_model("gpt-tiny", device="meta")
    graph = trace(model, inputs)
    cost = IntraOpCost(graph, load_cluster("local-cpu:4"), (4,), "float32", "adam",
                       zero_stage=1)
    node = next(n for n in graph.nodes if n.kind == PARAM and len(n.output.shape) == 2)
    numel = node.output.numel
    whole = cost.memory_breakdown(node, Strategy(inputs=(), outputs=((Replicate(),),)))
    assert whole == {"params": 4 * numel, "grads": 4 * numel, "optimizer": 8 * numel / 4}
    sharded = cost.memory_breakdown(node, Strategy(inputs=(), outputs=((Shard(0),),)))
    assert sharded == {"params": numel, "grads": numel, "optimizer": 2 * numel}


def test_plan_picks_zero1_in_fp32_and_bf16_mixed_on_two_ranks():
    """gpt-tiny, pp=2 x 2, 4 micro-batches: ZeRO beats per-micro-batch
    all-reduces; with parameters all replicated on the ZeRO axis the stage
    it takes is the one holding least memory (on 2 ranks under bf16-mixed
    ZeRO-1 holds 6 + 12/2 bytes per parameter, FSDP2 4 + 16/2: a tie, which
    goes to ZeRO-1)."""
    from planner.api import plan

    model, inputs = build_model("gpt-tiny")
    kwargs = dict(example_inputs=inputs, pp=[2], schedules=["1f1b"], num_microbatches=[4],
                  time_limit_s=10)
    fp32 = plan(model, "local-cpu:4", precision="fp32", **kwargs)
    fsdp = plan(model, "local-cpu:4", precision="fp32", zero_stages=[0, 3], **kwargs)
    mixed = plan(model, "local-cpu:4", precision="bf16-mixed", **kwargs)
    assert {(st.zero_stage, st.zero_axis) for st in fp32.pipeline.stages} == {(1, 0)}
    assert {st.zero_stage for st in fsdp.pipeline.stages} == {3}
    assert {st.zero_stage for st in mixed.pipeline.stages} == {1}
    one, three = (p.predicted["memory_bytes_per_device"] for p in (fp32, fsdp))
    assert one["params"] < three["params"] and one["grads"] < three["grads"]
    assert fp32.predicted["step_time_s"] == pytest.approx(fsdp.predicted["step_time_s"])
    with pytest.raises(PlanningError, match="ZeRO stages must be 0"):
        plan(model, "local-cpu:4", zero_stages=[4], **kwargs)
