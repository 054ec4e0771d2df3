"""The executor holds what is priced: each weight once, in the plan's dtypes.

Issue 49: on a GPU the plan's executor held, before its first step, a second
copy of every weight (the compute-dtype copy the capture traced, kept alive
by reference cycles until Python's cycle collector ran; earlier also by the
Graph keeping the traced program), 3-20 % over the prediction in bf16 and
bf16-mixed. Here, in one process on a one-rank plan of ``llama-tiny``, every
tensor storage made while the model is built and parallelized is counted
(:class:`benchmarks.live_storages.LiveStorages`) with the cycle collector
off, so that a copy only the collector would free still counts: what is
alive must be the executor's placed state (parameters in the master dtype,
buffers and constants) and the inputs, and after a step also the optimizer's
states; the parameters and the optimizer's moments are at most the bytes
the cost model prices for them (:func:`costmodel.memory.training_state_bytes`).
"""

from __future__ import annotations

import contextlib
import gc

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from benchmarks.live_storages import LiveStorages
from codegen.executor import PlanExecutor
from codegen.plan_model import loss_of
from costmodel.memory import training_state_bytes
from models.source import build_model

MODEL = "llama-tiny"


def _plan(precision: str):
    """A one-device plan of the model in ``precision`` (parameter and input
    placements only: the executor follows DTensor; no ILP, so it is fast)."""
    from codegen.capture import capture_program
    from plan.format import Plan, SolverReport

    model, inputs = build_model(MODEL, device="meta")
    graph = capture_program(model, inputs, precision).graph
    return Plan(
        model={"name": MODEL, "source": MODEL, "fingerprint": graph.fingerprint(),
               "num_parameters": graph.num_parameters},
        cluster={}, mesh={"shape": [1], "axis_names": ["dp"]},
        parameters={fqn: ["R"] for fqn in graph.parameters},
        inputs={n.name: ["R"] for n in graph.nodes if n.kind == "input"},
        nodes={}, reshards=[], predicted={}, training={"precision": precision},
        solver=SolverReport("manual", "none", 0.0, 0.0, 0.0, 0.0))


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def _no_cycle_collection():
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _bytes(tensors) -> int:
    """Bytes of the distinct storages of ``tensors``."""
    seen = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            st = t.untyped_storage()
            seen[id(st)] = st.nbytes()
    return sum(seen.values())


@pytest.mark.parametrize("precision", ["bf16", "bf16-mixed"])
def test_executor_holds_each_weight_once(one_rank_group, precision):
    plan = _plan(precision)
    priced = training_state_bytes(plan.model["num_parameters"], precision=precision,
                                  optimizer="adam")
    with _no_cycle_collection(), LiveStorages() as live:
        model, inputs = build_model(MODEL, device="cpu", seed=0)  # real fp32 weights
        param_bytes = sum(p.numel() for p in model.parameters()) * (
            2 if precision == "bf16" else 4)
        executor = PlanExecutor(plan, model, inputs, one_rank_group)
        del model  # the caller lets the model go, as planner run's runtime does
        held = live.current
        state = _bytes(executor._placeholders.values())
        params = _bytes(executor.parameters())
        # the parameters in the master dtype, each once: what the plan prices
        assert params == param_bytes <= priced["params"]
        # nothing besides the placed state and the inputs: no traced copy, no
        # fp32 original of a bf16 parameter
        assert held == state + _bytes(inputs), (
            f"{precision}: {held - state - _bytes(inputs)} bytes held beyond the placed "
            f"state ({state}) and the inputs; parameters {params}")

        opt = torch.optim.AdamW(list(executor.parameters()), lr=1e-4, foreach=True)
        for _ in range(2):  # the first forward records, the second runs the program
            loss_of(executor(*inputs)).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        held = live.current
        states = _bytes(t for s in opt.state.values() for t in s.values())
        moments = _bytes(t for s in opt.state.values() for t in s.values() if t.dim())
        assert moments <= priced["optimizer"]  # besides them a 0-d step count a parameter
        state = _bytes(executor._placeholders.values())
        assert held == state + states + _bytes(inputs), (
            f"{precision}: {held - state - states - _bytes(inputs)} bytes held after two "
            f"steps beyond the placed state, the optimizer's states and the inputs")


def test_parallelize_holds_only_the_placed_state(one_rank_group):
    """``parallelize(plan)`` (what ``planner run`` builds: the model on meta,
    each tensor materialised alone) holds the placed state and nothing else."""
    from codegen.parallel_model import parallelize

    plan = _plan("bf16")
    with _no_cycle_collection(), LiveStorages() as live:
        runtime = parallelize(plan)
        (executor,) = runtime.executors
        held = live.current
        params = _bytes(p for _, p in runtime.named_parameters())
        assert params == plan.model["num_parameters"] * 2  # bf16, each once
        # besides the placed state only the device mesh's table of ranks
        assert held == _bytes(executor._placeholders.values()) + 4 * executor.mesh.size()
