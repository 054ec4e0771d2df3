"""Code generation: run plans with DTensor under torchrun (CPU, gloo) and check numerics.

Plans here are made without the ILP: a plan that gives only parameter and input
placements runs in follow-DTensor mode, and the placements DTensor chose are
recorded into a complete plan (``record_plan`` in-process on a fake process group,
or ``rank_main --record`` in a real run). Feeding that plan back makes every
reshard explicit; the run must then match one process to 1e-5 (relative) in the
loss and in every gradient, and observe exactly the plan's placements.
"""

from __future__ import annotations

import json
import subprocess
import time
import warnings

import pytest

import ir
from codegen.capture import PlanMismatchError
from codegen.executor import record_plan
from training.launch import launch
from training.torchrun import LaunchError
from ir.placements import parse_placement, placement_str
from models.source import build_model
from plan.format import Plan, SolverReport, load_plan

MODEL = "gpt-tiny"
RTOL = 1e-5


def skeleton_plan(source: str, mesh_shape: list[int], param_rule, input_placements: list[str],
                  axis_names: list[str] | None = None) -> Plan:
    """A plan with parameter and input placements only, made on the meta device."""
    model, inputs = build_model(source, device="meta")
    graph = ir.trace(model, inputs)
    return Plan(
        model={"name": source, "source": source, "fingerprint": graph.fingerprint(),
               "num_parameters": graph.num_parameters},
        cluster={},
        mesh={"shape": list(mesh_shape),
              "axis_names": axis_names or [f"axis{i}" for i in range(len(mesh_shape))]},
        parameters={fqn: param_rule(fqn) for fqn in graph.parameters},
        inputs={n.name: list(input_placements) for n in graph.nodes if n.kind == "input"},
        nodes={}, reshards=[], predicted={},
        solver=SolverReport("manual", "none", 0.0, 0.0, 0.0, 0.0))


def megatron_rule(fqn: str) -> list[str]:
    """Megatron-LM tensor parallelism on the second ("tp") axis of a (dp, tp) mesh.

    Linear weights are [out, in]: column-parallel qkv/fc shard dim 0 (and their
    bias), row-parallel output projections shard dim 1; the rest is replicated.
    """
    if fqn.endswith(("attn.c_attn.weight", "attn.c_attn.bias", "mlp.c_fc.weight", "mlp.c_fc.bias")):
        return ["R", "S(0)"]
    if fqn.endswith(("attn.c_proj.weight", "mlp.c_proj.weight")):
        return ["R", "S(1)"]
    return ["R", "R"]


# A small model with the constructs that tripped DTensor: a lookup into a row-sharded
# table whose output is read twice, a no-op ``.to()`` (``_assert_tensor_metadata``),
# a mean over a sharded dim (``P(avg)``) and the usual cross entropy.
TOY_MODEL = '''
import torch
from torch import nn


class Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.fc = nn.Linear(16, 16)
        self.head = nn.Linear(16, 32, bias=False)

    def forward(self, idx, targets):
        x = self.emb(idx)
        h = self.fc(x.to(torch.float32))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) + x
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), targets.flatten())


def make():
    return Toy(), (torch.randint(0, 32, (4, 6)), torch.randint(0, 32, (4, 6)))
'''


def toy_source(tmp_path) -> str:
    path = tmp_path / "toy_model.py"
    path.write_text(TOY_MODEL)
    return f"{path}:make"


def toy_rule(fqn: str) -> list[str]:
    """Row-sharded table, column-parallel fc (its output is sharded on the hidden dim)."""
    return {"emb.weight": ["S(0)"], "fc.weight": ["S(0)"], "fc.bias": ["S(0)"]}.get(fqn, ["R"])


def _summary(result: dict) -> str:
    keys = ("passed", "loss", "reference_loss", "max_loss_rel_err", "max_rel_grad_err",
            "worst_param", "num_params_checked", "observed_match", "explicit_reshards",
            "num_mismatches", "fallback_ops", "placement_diffs", "mismatches", "output")
    return json.dumps({k: result.get(k) for k in keys}, indent=1)


# ------------------------------------------------------------------ in-process tests
@pytest.mark.parametrize("text", ["R", "S(0)", "S(2)", "P", "P(avg)", "P(max)", "S(1)[sf=2]"])
def test_placement_strings_round_trip(text):
    assert placement_str(parse_placement(text)) == text


def test_unknown_placement_is_refused():
    with pytest.raises(ValueError, match="unknown placement"):
        parse_placement("X(1)")


def test_wrong_fingerprint_is_refused_in_process():
    plan = skeleton_plan(MODEL, [2], lambda f: ["R"], ["S(0)"])
    plan.model["fingerprint"] = "0123456789abcdef"
    model, inputs = build_model(MODEL, device="cpu")
    with pytest.raises(PlanMismatchError) as err:
        record_plan(plan, model, inputs)
    msg = str(err.value)
    assert "\n" not in msg and "0123456789abcdef" in msg and "re-plan" in msg


def test_written_out_program_runs_the_models_math():
    """An 8-block GPT is captured on the fast path (two short probes, the rest
    written out); the executor runs that program with the model's own tensors
    and gets the plain model's loss and gradients."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from codegen.capture import WrittenOutProgram, capture_program
    from codegen.executor import PlanExecutor
    from training.torchrun import REPO_ROOT
    from codegen.plan_model import loss_of

    source = f"{REPO_ROOT}/tests/pipeline_model.py:gpt8"
    plan = skeleton_plan(source, [1], lambda f: ["R"], ["R"])
    model, inputs = build_model(source, device="cpu", seed=0)
    program = capture_program(model, inputs)
    assert isinstance(program.ep, WrittenOutProgram)
    want_loss = loss_of(model(*inputs))
    want_loss.backward()
    want = {fqn: p.grad.clone() for fqn, p in model.named_parameters()}
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
    try:
        executor = PlanExecutor(plan, model, inputs, init_device_mesh("cpu", (1,)),
                                program=program)
        loss = loss_of(executor(*inputs))
        loss.backward()
        # one device: the executor runs on plain tensors (no DTensor to gather)
        got = {fqn: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
               for fqn, p in executor.named_parameters()}
    finally:
        dist.destroy_process_group()
    loss = loss.full_tensor() if isinstance(loss, DTensor) else loss
    torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=0)
    assert got.keys() == want.keys()
    for fqn, grad in got.items():
        torch.testing.assert_close(grad, want[fqn], rtol=1e-5, atol=1e-7, msg=fqn)


def test_record_plan_follows_dtensor_data_parallel():
    plan = skeleton_plan(MODEL, [2], lambda f: ["R"], ["S(0)"])
    model, inputs = build_model(MODEL, device="cpu")
    with pytest.warns(UserWarning, match="sum.dim_IntList"):
        recorded = record_plan(plan, model, inputs)
    graph = ir.trace(*build_model(MODEL, device="meta"))
    assert set(recorded.nodes) == {n.name for n in graph.ops}
    # Token embedding of a batch-sharded input stays batch-sharded.
    emb = next(e for e in recorded.nodes.values() if e.module == "transformer.wte")
    assert emb.inputs == [["R"], ["S(0)"]] and emb.outputs == [["S(0)"]]
    # Data parallelism reshards only where the loss is reduced over the batch.
    assert all(r.dst == ["R"] for r in recorded.reshards)
    # Round trip through plan.json is exact.
    assert Plan.from_dict(json.loads(recorded.to_json())).to_json() == recorded.to_json()


def test_record_plan_handles_masked_lookup_and_checks(tmp_path):
    source = toy_source(tmp_path)
    plan = skeleton_plan(source, [2], toy_rule, ["R"])
    model, inputs = build_model(source, device="cpu")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        recorded = record_plan(plan, model, inputs)
    assert not [w for w in caught if "running it replicated" in str(w.message)]
    emb = next(e for e in recorded.nodes.values() if e.op == "aten.embedding.default")
    # The indices become DTensor's masked partial inside the op; the output is an
    # ordinary pending sum, read by two ops.
    assert emb.inputs == [["S(0)"], ["P(mask)"]] and emb.outputs == [["P"]]
    check = next(e for e in recorded.nodes.values() if "assert" in e.op)
    assert check.outputs == []
    mean = next(e for e in recorded.nodes.values() if e.op == "aten.mean.dim")
    assert mean.outputs == [["P(avg)"]]
    # A masked partial is made by DTensor itself, never by an explicit reshard.
    assert not [r for r in recorded.reshards if r.dst == ["P(mask)"]]


def test_launch_refuses_wrong_world_size(tmp_path, monkeypatch):
    plan = skeleton_plan(MODEL, [2, 2], megatron_rule, ["S(0)", "R"])
    path = tmp_path / "plan.json"
    plan.save(path)
    started = []
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: started.append(a))
    with pytest.raises(LaunchError, match="mesh of 4 devices") as err:
        launch(path, nproc=2)
    assert "\n" not in str(err.value)
    assert not started  # refused before starting any rank


# ---------------------------------------------------------------- multi-process tests
@pytest.mark.multiprocess
def test_data_parallel_record_then_replay(tmp_path):
    skeleton = tmp_path / "dp_skeleton.json"
    recorded = tmp_path / "dp_recorded.json"
    skeleton_plan(MODEL, [2], lambda f: ["R"], ["S(0)"]).save(skeleton)

    # 1. Follow DTensor: only parameters and inputs are placed; record what runs.
    first = launch(skeleton, check=True, record=recorded, timeout_s=120)
    assert first["passed"], _summary(first)
    plan = load_plan(recorded)
    assert len(plan.nodes) == first["nodes_executed"] > 50  # every op of the program

    # 2. Replay the recorded plan: every reshard is now explicit.
    result = launch(recorded, check=True, steps=2, timeout_s=120)
    print(_summary(result))
    assert result["passed"], _summary(result)
    assert result["observed_match"] and result["num_mismatches"] == 0
    assert result["explicit_reshards"] == len(plan.reshards)
    assert result["implicit_reshards"] == 0
    assert result["max_rel_grad_err"] <= RTOL
    assert result["max_loss_rel_err"] <= RTOL
    assert result["num_params_checked"] == len(plan.parameters)
    assert result["world_size"] == 2 and len(result["step_times_s"]) == 2


@pytest.mark.multiprocess
# the 2x2 Megatron layout runs, resharding only where planned, in
# tests/test_megatron.py; a recorded plan runs in the record-then-replay test
@pytest.mark.slow
def test_megatron_2x2_matches_one_process(tmp_path):
    skeleton = skeleton_plan(MODEL, [2, 2], megatron_rule, ["S(0)", "R"],
                             axis_names=["dp", "tp"])
    model, inputs = build_model(MODEL, device="cpu")
    with pytest.warns(UserWarning):
        plan = record_plan(skeleton, model, inputs)
    assert plan.parameters["transformer.h.0.attn.c_attn.weight"] == ["R", "S(0)"]
    assert plan.parameters["transformer.h.0.mlp.c_proj.weight"] == ["R", "S(1)"]
    # Row-parallel projections leave partial sums on the tp axis.
    proj = next(e for n, e in plan.nodes.items() if e.module == "transformer.h.0.mlp.c_proj"
                and e.op == "aten.addmm.default")
    assert proj.outputs == [["S(0)", "P"]]
    path = tmp_path / "megatron.json"
    plan.save(path)

    result = launch(path, check=True, steps=1, timeout_s=150)
    print(_summary(result))
    assert result["passed"], _summary(result)
    assert result["observed_match"] and result["num_mismatches"] == 0
    assert result["explicit_reshards"] == len(plan.reshards) > 0
    assert result["implicit_reshards"] == 0
    assert result["max_rel_grad_err"] <= RTOL
    assert result["loss_rel_err"] <= RTOL
    assert result["num_params_checked"] == len(plan.parameters)
    assert result["mesh_shape"] == [2, 2]


@pytest.mark.multiprocess
def test_sharded_lookup_partial_mean_and_checks_match_one_process(tmp_path):
    source = toy_source(tmp_path)
    model, inputs = build_model(source, device="cpu")
    plan = record_plan(skeleton_plan(source, [2], toy_rule, ["R"]), model, inputs)
    assert any(r.src == ["P(avg)"] for r in plan.reshards)
    path = tmp_path / "toy.json"
    plan.save(path)
    result = launch(path, check=True, steps=2, optimizer="adamw", timeout_s=120)
    print(_summary(result))
    assert result["passed"], _summary(result)
    assert result["observed_match"] and result["fallback_ops"] == []
    assert result["max_rel_grad_err"] <= RTOL and result["max_loss_rel_err"] <= RTOL
    assert result["num_params_checked"] == 4


@pytest.mark.multiprocess
def test_output_placement_mismatch_is_reported(tmp_path):
    source = toy_source(tmp_path)
    model, inputs = build_model(source, device="cpu")
    plan = record_plan(skeleton_plan(source, [2], toy_rule, ["R"]), model, inputs)
    mean = next(n for n, e in plan.nodes.items() if e.op == "aten.mean.dim")
    plan.nodes[mean].outputs = [["R"]]  # DTensor will make P(avg)
    path = tmp_path / "toy_mismatch.json"
    plan.save(path)
    result = launch(path, check=True, timeout_s=120)
    # The executor brings the output to the plan's placement, so numerics still hold,
    # but the run does not pass: the plan did not say what DTensor does.
    assert not result["passed"] and result["returncode"] == 1
    assert result["num_mismatches"] == 1 and mean in result["mismatches"][0]
    assert not result["observed_match"]
    assert result["max_rel_grad_err"] <= RTOL


@pytest.mark.multiprocess
def test_launch_times_out_cleanly(tmp_path):
    path = tmp_path / "plan.json"
    skeleton_plan(MODEL, [2], lambda f: ["R"], ["S(0)"]).save(path)
    start = time.perf_counter()
    with pytest.raises(LaunchError, match="did not finish within 2 s"):
        launch(path, timeout_s=2)
    assert time.perf_counter() - start < 30


@pytest.mark.multiprocess
def test_launch_refuses_plan_for_another_program(tmp_path):
    plan = skeleton_plan(MODEL, [1], lambda f: ["R"], ["R"])
    plan.model["fingerprint"] = "feedfacefeedface"
    path = tmp_path / "stale.json"
    plan.save(path)
    with pytest.raises(LaunchError) as err:
        launch(path, check=True, timeout_s=120)
    first_line = str(err.value).splitlines()[0]
    assert "feedfacefeedface" in first_line and "re-plan" in first_line
    assert err.value.user_error  # `planner run` prints it as one line and exits 2


def test_rank_device_follows_the_plans_cluster(monkeypatch):
    """A CPU plan's ranks train on the CPU even on a GPU machine (they used to take
    cuda:LOCAL_RANK and fail on a one-GPU machine); a GPU plan takes the rank's
    GPU, and more ranks than GPUs is refused in one line."""
    import torch

    from codegen.rank_process import runtime_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert runtime_device({"name": "local-cpu:4", "backend": "gloo"}, 3) == \
        ("gloo", torch.device("cpu"))
    assert runtime_device({"name": "dgx-h100:1", "backend": "nccl"}, 0) == \
        ("nccl", torch.device("cuda", 0))
    with pytest.raises(ValueError, match="1 CUDA device.*local rank 1"):
        runtime_device({"name": "dgx-h100:1", "backend": "nccl"}, 1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert runtime_device({"name": "dgx-h100:1", "backend": "nccl"}, 1) == \
        ("gloo", torch.device("cpu"))


def test_the_gradient_of_a_sharded_gather_holds_only_this_ranks_rows():
    """The loss picks the target logits with ``gather``, whose backward is
    ``grad.new_zeros(logits' shape).scatter_add(...)``: on a rank of 4 with
    the rows split, the zeros are its own quarter of the logits, not the whole
    global tensor (DTensor's own rule replicates them)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from ir.torch_compat import fake_store_type, register_zeros_like_input_sharding

    register_zeros_like_input_sharding()
    dist.init_process_group("fake", store=fake_store_type()(), rank=0, world_size=4)
    try:
        mesh = init_device_mesh("cpu", (4,))
        logits = distribute_tensor(torch.randn(64, 10), mesh, [Shard(0)]).requires_grad_()
        index = distribute_tensor(torch.randint(0, 10, (64, 1)), mesh, [Shard(0)])
        picked = logits.gather(1, index)
        zeros = picked.new_zeros((64, 10))
        assert zeros.placements == (Shard(0),) and zeros.to_local().shape == (16, 10)
        picked.sum().backward()
        assert logits.grad.to_local().shape == (16, 10)
        assert float(logits.grad.to_local().sum()) == 16.0
    finally:
        dist.destroy_process_group()
