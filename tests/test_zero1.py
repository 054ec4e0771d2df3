"""ZeRO-1 pipeline stages: the search's choice of ZeRO stage and how the
optimizer's slices are cut (run against one process for three AdamW steps:
tests/test_pipeline_run.py's pp2 data-parallel stages).

ZeRO-1 (:mod:`codegen.zero1`) keeps a stage's parameters and gradients whole
and shards the optimizer states over the stage mesh's axis 0: the gradient
sums are reduce-scattered and the updated parameter slices all-gathered once
per step, Megatron's distributed optimizer.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from codegen.zero1 import slice_bounds
from costmodel.presets import load_cluster
from costmodel.strategy_cost import IntraOpCost
from ir.graph import PARAM
from models.source import build_model
from ir.strategy import Strategy
from ir.trace import trace
from planner.search.pipeline_search import zero_stages_priced
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
    """gpt-tiny, pp=2 x 2, 4 micro-batches, ZeRO asked for: with parameters
    all replicated on the ZeRO axis the stage it takes is the one holding
    least memory (on 2 ranks under bf16-mixed ZeRO-1 holds 6 + 12/2 bytes
    per parameter, FSDP2 4 + 16/2: a tie, which goes to ZeRO-1)."""
    from planner.api import plan

    model, inputs = build_model("gpt-tiny")
    kwargs = dict(example_inputs=inputs, pp=[2], schedules=["1f1b"], num_microbatches=[4],
                  time_limit_s=10)
    fp32 = plan(model, "local-cpu:4", precision="fp32", zero_stages=[1, 2, 3], **kwargs)
    fsdp = plan(model, "local-cpu:4", precision="fp32", zero_stages=[3], **kwargs)
    mixed = plan(model, "local-cpu:4", precision="bf16-mixed", zero_stages=[1, 2, 3], **kwargs)
    assert {(st.zero_stage, st.zero_axis) for st in fp32.pipeline.stages} == {(1, 0)}
    assert {st.zero_stage for st in fsdp.pipeline.stages} == {3}
    assert {st.zero_stage for st in mixed.pipeline.stages} == {1}
    one, three = (p.predicted["memory_bytes_per_device"] for p in (fp32, fsdp))
    assert one["params"] < three["params"] and one["grads"] < three["grads"]
    # ZeRO-1 reduces once per step; ZeRO-3 in every micro-batch, overlapped
    assert fp32.predicted["grad_sync_s"] > 0 and fsdp.predicted["grad_sync_s"] == 0
    with pytest.raises(PlanningError, match="ZeRO stages must be 0"):
        plan(model, "local-cpu:4", zero_stages=[4], **kwargs)


# ------------------------------------------------ bf16-mixed: Megatron's layout, run
def _mixed_zero1_plan(pp: int, stage_mesh: tuple[int, ...], megatron: tuple[int, int],
                      schedule: str = "1f1b"):
    """A bf16-mixed ZeRO-1 pipeline plan of the 8-block GPT on 4 CPU ranks, the
    Megatron layout ``megatron=(tp, dp)`` pinned on every stage."""
    from training.torchrun import REPO_ROOT
    from planner.api import pipeline_plan
    from planner.megatron_layout import MegatronConfig, megatron_layout

    source = f"{REPO_ROOT}/tests/pipeline_model.py:gpt8"
    model, inputs = build_model(source, device="meta")
    fixed = megatron_layout(trace(model, inputs), MegatronConfig(*megatron))
    plan = pipeline_plan(model, "local-cpu:4", example_inputs=inputs, pp=pp,
                         stage_mesh=stage_mesh, schedule=schedule, num_microbatches=2,
                         zero_stage=1, model_source=source, time_limit_s=5.0, fixed=fixed,
                         precision="bf16-mixed")
    assert plan.precision.name == "bf16-mixed"
    assert all((st.zero_stage, st.zero_axis) == (1, 0) for st in plan.pipeline.stages)
    return plan


def _check_mixed(plan, tmp_path) -> dict:
    """Three AdamW steps at lr 1e-2 against one bf16-mixed process: the loss of
    every step (a stale or wrongly cast parameter would show in the next one)
    and every gradient of the first, within bf16-mixed's tolerance."""
    from training.launch import launch
    from training.reference import check_tolerance

    path = tmp_path / "plan.json"
    plan.save(path)
    result = launch(path, check=True, steps=3, optimizer="adamw", lr=1e-2, timeout_s=240)
    assert result["passed"], result.get("output")
    assert result["rtol"] == check_tolerance("bf16-mixed")
    assert result["max_loss_rel_err"] <= result["rtol"] and len(result["losses"]) == 3
    assert result["max_rel_grad_err"] <= result["rtol"]
    assert result["num_params_checked"] == 101 and not result["missing_grads"]
    assert result["grad_reductions"] == result["num_params_checked"]
    assert result["losses"][2] < result["losses"][0]
    return result


@pytest.mark.multiprocess
def test_bf16_mixed_zero1_pp2_matches_one_process(tmp_path):
    """pp=2, data-parallel stages of 2: bf16 parameters, fp32 main gradients
    and master slices (:class:`codegen.zero1.StateShards`), against one process."""
    _check_mixed(_mixed_zero1_plan(2, (2,), (1, 2)), tmp_path)


@pytest.mark.multiprocess
def test_bf16_mixed_zero1_on_a_2x2_mesh_matches_one_process(tmp_path):
    """pp=1 on a 2x2 stage mesh: ZeRO-1 over the data-parallel axis 0 while
    axis 1 shards the weights (tensor parallelism), so the master slices are
    cut along a dimension the other axis leaves whole."""
    plan = _mixed_zero1_plan(1, (2, 2), (2, 2))
    assert {"S(0)", "S(1)"} <= {p[1] for p in plan.parameters.values()}
    _check_mixed(plan, tmp_path)


@pytest.fixture
def one_rank_mesh(tmp_path):
    """A 1-D mesh of this process alone (gloo)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1),
                            rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def test_bf16_mixed_shards_hold_bf16_parameters_and_accumulate_in_fp32(one_rank_mesh):
    """Under bf16-mixed the parameter forward reads is bf16 and the fp32 values
    live only in the master slice; micro-batch gradients add up in fp32 whether
    autograd accumulates them (the post-accumulate-grad hook) or a schedule's
    weight backward sets ``grad`` (:meth:`StateShards.collect_grads`): 1 + 2^-9
    is exact in fp32 and rounds to 1 in bf16. The step writes bf16(master) back."""
    from torch import nn
    from torch.distributed.tensor import DTensor, distribute_tensor

    from codegen.zero1 import ShardedStateOptimizer, StateShards

    master = torch.tensor([[1.0 + 2 ** -10, 3.0], [0.5, -2.0]])
    fp32 = nn.Parameter(distribute_tensor(master.clone(), one_rank_mesh, [Replicate()]))
    shards = StateShards([fp32], one_rank_mesh, 0, compute_dtype=torch.bfloat16,
                         grad_dtype=torch.float32)
    (param,) = shards.parameters()
    assert shards.mixed and shards.replaced() == {id(fp32): param}
    assert param.dtype == torch.bfloat16 and isinstance(param, DTensor)
    (stepped,) = shards.tensors()
    assert stepped.dtype == torch.float32 and torch.equal(stepped, master)
    assert stepped.data_ptr() != fp32.to_local().data_ptr()  # a copy: the fp32 one is let go
    held = shards.master_of(param)
    assert held.dtype == torch.float32 and torch.equal(held.full_tensor(), master)

    (param * torch.ones_like(param)).sum().backward()  # gradient 1 through autograd
    assert param.grad is None  # moved into the fp32 main gradient by the hook
    param.grad = distribute_tensor(torch.full((2, 2), 2 ** -9, dtype=torch.bfloat16),
                                   one_rank_mesh, [Replicate()])  # a split weight backward
    shards.collect_grads()
    pending = shards.pending_grad(param)
    assert pending.dtype == torch.float32
    assert torch.equal(pending.full_tensor(), torch.full((2, 2), 1.0 + 2 ** -9))
    shards.scale_grads(2)  # the schedule's mean over 2 micro-batches

    opt = ShardedStateOptimizer(shards, lambda ts: torch.optim.SGD(ts, lr=1.0))
    assert opt.step() == 1
    want = master - (1.0 + 2 ** -9) / 2
    assert torch.equal(stepped, want)
    assert torch.equal(param.to_local(), want.to(torch.bfloat16))
    assert torch.equal(shards.master_of(param).full_tensor(), want)


@pytest.mark.multiprocess
def test_bf16_mixed_zero1_resume_is_exact_and_saves_fp32_masters(tmp_path):
    """``planner train`` of a pp=2 bf16-mixed ZeRO-1 plan for 4 steps, saving
    every 2; then resumed from the save of step 2 to step 4. The resumed losses
    and exported weights equal the uninterrupted run's bit for bit: the save
    holds the fp32 master values and Adam's moments (not the bf16 parameters
    forward reads), and the resume gathers bf16 parameters from them."""
    from app.cli import build_parser
    from app.cli import main as planner
    from safetensors.torch import load_file
    from training.config import TrainConfig
    from training.launch import train

    from training.data import bytes_to_tokens

    text = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                             "README.md"), "rb").read()
    (tmp_path / "text.txt").write_bytes(bytes(b for b in text if b < 128))  # gpt-tiny's vocabulary
    tokens = str(tmp_path / "text.bin")
    bytes_to_tokens(str(tmp_path / "text.txt"), tokens)
    plan = str(tmp_path / "plan.json")
    assert planner(["plan", "--model", "gpt-tiny", "--cluster", "local-cpu:4", "--pp", "2",
                    "--schedule", "1f1b", "--zero", "1", "--precision", "bf16-mixed",
                    "-o", plan, "--quiet"]) == 0

    def run(*args: str) -> tuple[dict, dict[str, torch.Tensor]]:
        name = f"r{len(list(tmp_path.glob('r*.json')))}"
        result, export = str(tmp_path / f"{name}.json"), str(tmp_path / f"{name}-export")
        config = TrainConfig.from_args(build_parser().parse_args([
            "train", plan, "--data", tokens, "--steps", "4", "--lr", "1e-2", "--warmup", "1",
            "--log-every", "4",
            "--checkpoint-dir", str(tmp_path / "ck"), "--export", export,
            "--result-json", result, *args]))
        outcome = train(config)
        assert outcome.returncode == 0, open(outcome.log_path).read()[-3000:]
        import json

        with open(result) as f:
            return json.load(f), load_file(f"{export}/model.safetensors")

    whole, weights = run("--save-every", "2")
    os.remove(tmp_path / "ck" / "step_00000004" / "meta.json")  # resume from step 2
    resumed, again = run("--resume")
    assert resumed["start_step"] == 2
    assert [e["loss"] for e in resumed["losses"]] == [e["loss"] for e in whole["losses"][2:]]
    assert set(again) == set(weights)
    assert all(w.dtype == torch.float32 and torch.equal(again[k], w) for k, w in weights.items())
    # fp32 masters: the exported values are not all bf16-representable
    assert any(not torch.equal(w, w.bfloat16().float()) for w in weights.values())
