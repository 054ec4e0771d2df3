"""bf16-mixed plans run under torchrun and match a one-process bf16-mixed run.

The multi-process cases make a plan with ``precision="bf16-mixed"`` the way
``benchmarks/precision_check.py`` does (the layout pinned: Megatron, or
ZeRO-3 through ``pipeline_plan``), run two steps of it with
``training.launch.launch(..., check=True)`` and require the loss and every
gradient of step 1 (and the loss of step 2) to be within
``training.reference.check_tolerance("bf16-mixed")`` (5e-2) of the reference,
with the plan's placements observed. The whole grid (3 models x 2 and 4 ranks
x dp, tp, 2-D, pp=2, ZeRO-3) is the benchmark.
"""

from __future__ import annotations

import json

import pytest

from benchmarks.precision_check import make_plan
from training.launch import launch
from training.reference import check_tolerance
from plan.format import load_plan


def _run(model_name: str, world: int, config: str, tmp_path) -> dict:
    plan, how = make_plan(model_name, world, config, time_limit_s=5.0)
    assert plan.precision.name == "bf16-mixed"
    assert plan.training["precision"] == "bf16-mixed" and plan.training["dtype"] == "bfloat16"
    path = tmp_path / "plan.json"
    plan.save(path)
    result = launch(path, nproc=world, steps=2, check=True, timeout_s=120)
    print(f"{model_name} N={world} {config} ({how}): loss rel err {result.get('max_loss_rel_err')}, "
          f"max grad rel err {result.get('max_rel_grad_err')} ({result.get('worst_param')}), "
          f"steps {result['step_times_s']}")
    assert result["rtol"] == check_tolerance("bf16-mixed") == 5e-2
    assert result["passed"], result.get("output")
    assert result["max_loss_rel_err"] <= 5e-2 and result["max_rel_grad_err"] <= 5e-2
    assert result["observed_match"] and not result["missing_grads"]
    return result


@pytest.mark.multiprocess
def test_bf16_mixed_tensor_parallel_gpt_on_2_ranks(tmp_path):
    _run("gpt-tiny", 2, "tp", tmp_path)


@pytest.mark.multiprocess
def test_bf16_mixed_pipeline_llama_on_2_ranks(tmp_path):
    result = _run("llama-tiny", 2, "pp2", tmp_path)
    assert result["pipeline"]["pp"] == 2


@pytest.mark.multiprocess
def test_bf16_mixed_zero3_moe_on_4_ranks(tmp_path):
    """FSDP2 with its MixedPrecisionPolicy (bf16 all-gathers, fp32
    reduce-scatters) over one stage of 4 ranks, accumulating 2 micro-batches."""
    result = _run("moe-tiny", 4, "zero3", tmp_path)
    assert result["pipeline"]["pp"] == 1


def test_format_2_plan_loads_as_fp32(tmp_path):
    """A plan written before training precisions existed (format 2: the
    ``training`` section names only the dtype) still loads, and trains in that
    dtype throughout: fp32 for float32, bf16 for bfloat16."""
    from models.source import build_model
    from planner.api import plan

    model, inputs = build_model("mlp-tiny", device="meta")
    fresh = plan(model, "local-cpu:2", example_inputs=inputs, mesh_shape=(2,),
                 model_source="mlp-tiny", time_limit_s=5.0)
    d = json.loads(fresh.to_json())
    d["format_version"] = 2
    for key in ("precision", "reduce_dtype"):
        d["training"].pop(key, None)
    for dtype, want in (("float32", "fp32"), ("bfloat16", "bf16")):
        d["training"]["dtype"] = dtype
        path = tmp_path / f"plan-{dtype}.json"
        path.write_text(json.dumps(d))
        old = load_plan(path)
        assert old.precision.name == want
        assert old.parameters == fresh.parameters and old.nodes == fresh.nodes
    del d["training"]["dtype"]  # no dtype at all: fp32
    path = tmp_path / "plan-nodtype.json"
    path.write_text(json.dumps(d))
    assert load_plan(path).precision.name == "fp32"


def test_resharding_keeps_the_fused_attention_layout():
    """The fused attention's output is [batch, heads, seq, dim] over
    [batch, seq, heads, dim] memory, and the captured program merges the heads
    with a ``view`` right after transposing back (no copy). An explicit
    reshard (here all-gathering a batch-sharded output, as a data-parallel
    plan of gpt-tiny on 2 ranks does) must hand that layout on, not the
    collective's contiguous one, or the view fails."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from codegen.redistribution import keep_layout, redistribute

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        local = torch.randn(4, 32, 4, 16).transpose(1, 2).requires_grad_()  # 4 of 8 sequences
        src = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
        gathered = redistribute(src, mesh, [Replicate()])
        assert gathered.to_local().is_contiguous()  # what the collective returns
        out = keep_layout(src, gathered)
        assert out.placements == (Replicate(),) and out.shape == (8, 4, 32, 16)
        assert out.to_local().stride() == (2048, 16, 64, 1)
        assert out.stride() == (2048, 16, 64, 1)  # the global strides say so too
        merged = out.transpose(1, 2).view(8, 32, 64)  # the program's view, on the DTensor
        assert merged.to_local().data_ptr() == out.to_local().data_ptr()  # a view, no copy
        merged.to_local().sum().backward()
        assert local.grad is not None and local.grad.shape == local.shape
        # contiguous sources and partial sums are left alone
        plain = DTensor.from_local(torch.randn(4, 8), mesh, [Shard(0)], run_check=False)
        again = redistribute(plain, mesh, [Replicate()])
        assert keep_layout(plain, again) is again
    finally:
        dist.destroy_process_group()


def test_the_captured_attention_layout_is_read_without_running_an_op():
    """Whether attention's output was captured in the fused kernels' layout is
    read from the fake value's shape and strides: an op on it would run under
    the step's dispatch modes (torch's MemTracker then counts the fake value's
    bytes as allocated, 16 MiB per attention op of cp_memory's model)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    from codegen.node_runner import has_fused_attention_layout

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(str(func))
            return func(*args, **(kwargs or {}))

    graph = torch.fx.Graph()
    fused, contiguous, other = (graph.placeholder(n) for n in ("fused", "contiguous", "other"))
    with FakeTensorMode():
        fused.meta["val"] = torch.empty(2, 16, 4, 8).transpose(1, 2)  # [b, s, h, d] memory
        contiguous.meta["val"] = torch.empty(2, 4, 16, 8)
        other.meta["val"] = torch.empty(2, 8, 4, 16).permute(0, 2, 3, 1)
    with Ops() as ops:
        found = [has_fused_attention_layout(n) for n in (fused, contiguous, other)]
    assert found == [True, False, False] and ops.seen == []
