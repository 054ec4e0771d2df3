"""Explicit requests are honoured or refused: ``--zero``, ``--pp``,
``--schedule``, ``--microbatches``, ``--cp`` and ``--recompute`` given with a
single stage (``--mesh``, or ``--no-pipeline``) either shape the plan or are
refused in one line (exit 2) before any search; and the plan summary names
what it shows plainly (lifted constants, where context parallelism runs)."""

import dataclasses
import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from app.cli import main
from models.source import build_model
from planner.api import plan
from planner.request import PlanningError
from planner.report import _LIFTED_CONSTANT, format_plan

STEP = ["--batch-size", "8", "--seq-len", "32"]
FAST = {"time_limit_s": 10.0}


def _gpt_tiny():
    return build_model("gpt-tiny", device="meta", batch_size=8, seq_len=32)


@pytest.fixture(scope="module")
def mesh_plan():
    """gpt-tiny on ``--mesh 2`` with nothing else asked."""
    model, inputs = _gpt_tiny()
    return plan(model, "local-cpu:2", example_inputs=inputs, mesh_shape=(2,), **FAST)


@pytest.mark.parametrize("flags, message", [
    (["--mesh", "2", "--pp", "2"], "--pp 2 asks for a pipeline, but the mesh given (--mesh 2)"),
    (["--no-pipeline", "--pp", "2"], "--pp 2 asks for a pipeline, but --no-pipeline"),
    (["--mesh", "2", "--schedule", "1f1b"], "--schedule orders the stages of a pipeline"),
    (["--mesh", "2", "--microbatches", "4", "--schedule", "gpipe"], "leave out --schedule"),
    (["--mesh", "2", "--cp", "2"], "context parallelism is searched with the pipeline search"),
    (["--mesh", "1x2", "--zero", "3"], "1 rank in mesh 1x2: give the data-parallel axis first "
                                       "(--mesh 2x1)"),
    (["--mesh", "2", "--zero", "4"], "ZeRO stages must be 0"),
    (["--mesh", "2", "--recompute", "all", "--pp", "2"], "leave out --mesh to search pipelines"),
])
def test_what_one_stage_cannot_do_is_refused_in_one_line_before_any_capture(
        flags, message, capsys, tmp_path, monkeypatch):
    def no_capture(*args, **kwargs):
        raise AssertionError("the model was built: the refusal came after the capture")

    monkeypatch.setattr("models.source.build_model", no_capture)
    out = tmp_path / "p.json"
    assert main(["plan", "--model", "gpt-tiny", "--cluster", "local-cpu:2", *flags, *STEP,
                 "--quiet", "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("planner: error:") and message in err[0], err
    assert not out.exists()


def test_zero3_on_a_mesh_is_a_zero3_plan_over_its_first_axis(tmp_path, capsys):
    """The issue's command: ``--mesh 2 --zero 3`` wrote the plan of ``--mesh 2``."""
    out = tmp_path / "a.json"
    assert main(["plan", "--model", "gpt-tiny", "--cluster", "local-cpu:2", "--mesh", "2",
                 "--zero", "3", *STEP, "--time-limit", "10", "--quiet", "-o", str(out)]) == 0
    assert "ZeRO-3" in capsys.readouterr().out
    data = json.loads(out.read_text())
    pipe = data["pipeline"]
    assert data["mesh"]["shape"] == [1, 2] and pipe["stage_mesh"]["shape"] == [2]
    assert pipe["num_microbatches"] == 1 and len(pipe["stages"]) == 1
    assert [(st["zero_stage"], st["zero_axis"]) for st in pipe["stages"]] == [(3, 0)]


def test_zero_on_no_pipeline_is_honoured_on_the_searched_meshes():
    model, inputs = _gpt_tiny()
    p = plan(model, "local-cpu:2", example_inputs=inputs, pipeline=False, zero_stages=(1,),
             **FAST)
    assert [st.zero_stage for st in p.pipeline.stages] == [1] and p.pipeline.pp == 1


def test_microbatches_on_a_mesh_accumulate_gradients_on_the_one_stage():
    model, inputs = _gpt_tiny()
    p = plan(model, "local-cpu:2", example_inputs=inputs, mesh_shape=(2,),
             num_microbatches=(2,), **FAST)
    assert p.pipeline.pp == 1 and p.pipeline.num_microbatches == 2
    assert p.training["microbatch_size"] == 4 and p.pipeline.stage_mesh["shape"] == [2]
    assert [st.zero_stage for st in p.pipeline.stages] == [0]


@pytest.mark.parametrize("stage_flag, message", [
    (["--mesh", "2"], "3 micro-batches do not divide the batch of 8"),  # pinned one stage
    (["--pp", "1"], "--microbatches 3 divides the batch of 8"),  # one stage searched
])
def test_microbatches_that_do_not_divide_the_batch_are_refused_in_one_line(
        tmp_path, capsys, stage_flag, message):
    out = tmp_path / "p.json"
    assert main(["plan", "--model", "gpt-tiny", "--cluster", "local-cpu:2", *stage_flag,
                 "--microbatches", "3", *STEP, "--quiet", "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not out.exists()


def test_recompute_on_a_mesh_is_honoured_with_and_without_zero(mesh_plan):
    model, inputs = _gpt_tiny()
    every = plan(model, "local-cpu:2", example_inputs=inputs, mesh_shape=(2,), recompute=True,
                 **FAST)
    assert mesh_plan.checkpoint == [] and every.checkpoint == ["transformer.h.0",
                                                               "transformer.h.1"]
    sharded = plan(model, "local-cpu:2", example_inputs=inputs, mesh_shape=(2,),
                   recompute=True, zero_stages=(3,), **FAST)
    assert [st.checkpoint for st in sharded.pipeline.stages] == [every.checkpoint]
    assert sharded.pipeline.stages[0].zero_stage == 3


def test_flags_a_mesh_plan_already_obeys_leave_it_as_it_was(mesh_plan):
    """pp 1, ZeRO 0, one micro-batch and cp 1 are what a mesh plan is."""
    model, inputs = _gpt_tiny()
    same = plan(model, "local-cpu:2", example_inputs=inputs, mesh_shape=(2,), pp=(1,),
                zero_stages=(0,), num_microbatches=(1,), context_parallel=(1,), **FAST)
    assert same.to_json() == mesh_plan.to_json()


class _Normed(nn.Module):
    """A linear layer and BatchNorm, whose forward updates its running statistics."""

    def __init__(self):
        super().__init__()
        self.fc, self.bn = nn.Linear(8, 8), nn.BatchNorm1d(8)

    def forward(self, x, y):
        return F.cross_entropy(self.bn(self.fc(x)), y)


def test_zero_on_a_mesh_of_a_model_updating_buffers_is_refused():
    x, y = torch.randn(4, 8), torch.randint(0, 8, (4,))
    with pytest.raises(PlanningError, match="updates buffers.*leave out --pp, --microbatches "
                                            "and --zero"):
        plan(_Normed(), "local-cpu:2", example_inputs=(x, y), mesh_shape=(2,),
             zero_stages=(3,), **FAST)


class _Scaled(nn.Module):
    """Blocks that make a tensor constant in forward, which the capture lifts
    into an input of the program."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])

    def forward(self, x, y):
        for block in self.blocks:
            x = block(x) * torch.tensor(0.5)
        return F.cross_entropy(x, y)


def test_the_summary_names_lifted_constants_by_module_not_as_inputs(mesh_plan):
    from ir.graph import INPUT
    from ir.trace import trace

    graph = trace(_Scaled(), (torch.randn(4, 8), torch.randint(0, 8, (4,))))
    lifted = [n.name for n in graph.nodes if n.kind == INPUT and _LIFTED_CONSTANT.match(n.name)]
    assert len(lifted) == 2  # the capture's names are the ones the summary recognises
    inputs = {"c_transformer_h_0_attn_lifted_tensor_0": ["R"],
              "c_transformer_h_1_attn_lifted_tensor_1": ["R"],
              "c_lifted_tensor_2": ["S(0)"], **mesh_plan.inputs}
    text = format_plan(dataclasses.replace(mesh_plan, inputs=inputs))
    own = ", ".join(f"{name} [{', '.join(pl)}]" for name, pl in mesh_plan.inputs.items())
    assert f"inputs: {own}\n" in text and "lifted_tensor" not in text
    assert ("constants lifted into inputs by the capture, by the module that makes them: "
            "transformer.h.*.attn [R] x2, the model [S(0)] x1") in text


def test_the_context_parallel_line_says_where_it_runs(mesh_plan):
    training = {**mesh_plan.training, "context_parallel": {"size": 2, "comm_type": "p2p"}}
    predicted = {**mesh_plan.predicted, "context_parallel": {
        "comm_type": "p2p", "kv_buffer_bytes": 1024, "exchange_s_per_microbatch": [1e-3]}}
    cpu = dataclasses.replace(mesh_plan, training=training, predicted=predicted)
    line = next(l for l in format_plan(cpu).splitlines() if l.startswith("context parallelism"))
    assert line.endswith("runs on CPU ranks (gloo)") and "not run" not in line
    gpu = dataclasses.replace(cpu, cluster={**cpu.cluster, "backend": "nccl",
                                            "device": {**cpu.cluster["device"], "name": "h100"}})
    line = next(l for l in format_plan(gpu).splitlines() if l.startswith("context parallelism"))
    assert line.endswith("runs on h100 GPU ranks (NCCL; FlashAttention-2 or memory-efficient "
                         "attention per block), not yet run on a GPU by this project")


# --- the search (no --mesh) honours --zero and --microbatches too ---

def test_zero3_with_pp1_searched_is_a_zero3_plan(tmp_path, capsys):
    """``--pp 1 --zero 3`` wrote a plan of the whole batch without ZeRO: the
    search always added that candidate, and fell back to it."""
    out = tmp_path / "z.json"
    assert main(["plan", "--model", "gpt-tiny", "--cluster", "local-cpu:2", "--pp", "1",
                 "--zero", "3", *STEP, "--time-limit", "10", "--quiet", "-o", str(out)]) == 0
    assert "ZeRO-3" in capsys.readouterr().out
    pipe = json.loads(out.read_text())["pipeline"]
    assert pipe is not None and len(pipe["stages"]) == 1
    assert [(st["zero_stage"], st["zero_axis"]) for st in pipe["stages"]] == [(3, 0)]


def test_searching_one_stage_is_never_worse_than_pinning_its_zero_stage():
    """``--pp 1`` searches every ZeRO stage: it priced ZeRO only for
    pipelines and stages of several micro-batches, so one stage of the whole
    batch under ZeRO-1, faster here, lost to the plan without ZeRO."""
    model, inputs = _gpt_tiny()
    searched = plan(model, "local-cpu:2", example_inputs=inputs, pp=(1,), **FAST)
    pinned = plan(model, "local-cpu:2", example_inputs=inputs, pp=(1,), zero_stages=(1,), **FAST)
    assert searched.predicted["step_time_s"] <= pinned.predicted["step_time_s"] * (1 + 1e-9)


def test_microbatches_searched_are_the_counts_asked_for():
    model, inputs = _gpt_tiny()
    p = plan(model, "local-cpu:2", example_inputs=inputs, pp=(1,), num_microbatches=(4,),
             **FAST)
    assert p.pipeline is not None and p.pipeline.pp == 1 and p.pipeline.num_microbatches == 4
    assert p.training["microbatch_size"] == 2


def test_searched_zero_that_does_not_fit_in_memory_is_refused_not_replaced():
    model, inputs = _gpt_tiny()
    with pytest.raises(PlanningError, match=r"no plan with --zero 3 fits in memory on 2 "
                                            r"device\(s\): add 0 to --zero"):
        plan(model, "local-cpu:2", example_inputs=inputs, pp=(1,), zero_stages=(3,),
             memory_budget=64 * 1024, **FAST)
