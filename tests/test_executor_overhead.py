"""The one-device executor's compiled program: public bindings for aten overloads.

On a mesh of one device :class:`codegen.executor.PlanExecutor` runs the captured
program as Python code after its recording forward, calling each op through the
public function that dispatches the node's own aten overload
(:func:`codegen.node_runner.public_binding`). These tests check that the
rewritten program dispatches exactly the captured program's ops, that a
function which would dispatch another overload (or draw random numbers) is not
used, and that losses and gradients are those of the interpreted forward.
"""

from __future__ import annotations

import operator

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.fx.experimental.proxy_tensor import make_fx

from codegen.capture import capture_program
from codegen.executor import PlanExecutor
from training.torchrun import REPO_ROOT
from codegen.node_runner import public_binding
from codegen.plan_model import loss_of
from models.source import build_model
from ir.torch_compat import op_overload_name
from plan.format import Plan

GPT8 = f"{REPO_ROOT}/tests/pipeline_model.py:gpt8"


def _node(op, *args):
    """A call node of ``op`` whose tensor arguments are placeholders with meta values
    (``args``: meta tensors, or Python values passed as they are)."""
    graph = torch.fx.Graph()
    values = []
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            p = graph.placeholder(f"x{i}")
            p.meta["val"] = a
            values.append(p)
        else:
            values.append(a)
    return graph.call_function(op, tuple(values))


def _meta(*shape, dtype=torch.float32):
    return torch.empty(*shape, device="meta", dtype=dtype)


def test_binding_dispatches_the_nodes_overload():
    aten = torch.ops.aten
    assert public_binding(_node(aten.mm.default, _meta(4, 3), _meta(3, 2)), {}) is torch.mm
    assert public_binding(_node(aten.view.default, _meta(4, 3), [12]), {}) is torch.Tensor.view
    assert public_binding(_node(aten.add.Tensor, _meta(4), 1e-5), {}) is torch.add


def test_binding_that_would_dispatch_another_overload_is_not_used():
    # torch.add(x, 2) dispatches add.Tensor (2 as a wrapped number), not add.Scalar
    aten = torch.ops.aten
    assert public_binding(_node(aten.add.Scalar, _meta(4), 2), {}) is None
    # Tensor.split_with_sizes returns a tuple where the overload returns a list
    assert public_binding(_node(aten.split_with_sizes.default, _meta(4, 6), [2, 4], 1), {}) is None


def test_random_factory_and_unknown_ops_keep_their_overload():
    aten = torch.ops.aten
    assert public_binding(_node(aten.bernoulli.p, _meta(4), 0.5), {}) is None  # random
    assert public_binding(_node(aten.arange.start_step, 0, 8, 1), {}) is None  # no tensor in
    unknown = _node(aten.neg.default, _meta(4))
    unknown.args[0].meta.clear()  # no value known for the argument
    assert public_binding(unknown, {}) is None
    assert public_binding(_node(torch.neg, _meta(4)), {}) is None  # not an aten overload


def test_memo_answers_repeated_ops_once():
    memo: dict = {}
    first = public_binding(_node(torch.ops.aten.mm.default, _meta(4, 3), _meta(3, 2)), memo)
    again = public_binding(_node(torch.ops.aten.mm.default, _meta(4, 3), _meta(3, 2)), memo)
    assert first is again is torch.mm and len(memo) == 1


def _one_device_plan(checkpoint: tuple[str, ...] = ()) -> Plan:
    from tests.test_codegen import skeleton_plan

    plan = skeleton_plan(GPT8, [1], lambda f: ["R"], ["R"])
    plan.checkpoint = list(checkpoint)
    return plan


@pytest.fixture
def one_rank_group():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _dispatched_ops(gm: torch.fx.GraphModule, args: list) -> list[tuple]:
    """The aten ops running ``gm`` dispatches, with their arguments (graph values
    as positions)."""
    traced = make_fx(gm)(*args).graph
    position = {n: i for i, n in enumerate(traced.nodes)}
    return [(n.target, torch.fx.node.map_arg((n.args, n.kwargs), lambda a: position[a]))
            for n in traced.nodes if n.op == "call_function"]


def test_compiled_program_dispatches_the_captured_ops(one_rank_group):
    model, inputs = build_model(GPT8, device="cpu", seed=0)
    program = capture_program(model, inputs)
    executor = PlanExecutor(_one_device_plan(), model, inputs, init_device_mesh("cpu", (1,)),
                            program=program)
    assert executor._compiled is None
    with torch.no_grad():
        executor(*inputs)  # the recording forward makes the compiled program
    compiled = executor._compiled
    calls = [n.target for n in compiled.graph.nodes if n.op == "call_function"]
    rebound = [t for t in calls if op_overload_name(t) is None and t is not operator.getitem]
    assert len(rebound) > len(calls) // 2  # most ops have a public binding
    names = executor._compiled_inputs
    user = dict(zip(executor.user_input_names, inputs))
    args = [user[n] if n in user else executor._placeholder_value(n) for n in names]
    with torch.no_grad():
        captured = _dispatched_ops(torch.fx.GraphModule(torch.nn.Module(), program.ep.graph), args)
        assert _dispatched_ops(compiled, args) == captured


@pytest.mark.parametrize("checkpoint", [(), ("transformer.h.2", "transformer.h.5")])
def test_compiled_steps_match_the_interpreted_step(one_rank_group, checkpoint):
    """The first forward is interpreted (it records), later ones run the
    compiled program, checkpointed layers included: the same loss and
    gradients for the same weights."""
    model, inputs = build_model(GPT8, device="cpu", seed=0)
    executor = PlanExecutor(_one_device_plan(checkpoint), model, inputs,
                            init_device_mesh("cpu", (1,)))
    grads = []
    for _ in range(2):
        loss = loss_of(executor(*inputs))
        loss.backward()
        grads.append((loss.detach(), {k: p.grad.clone() for k, p in executor.named_parameters()}))
        for p in executor.parameters():
            p.grad = None
    assert executor._compiled is not None  # made by the first forward, run by the second
    layers = [m for m in executor._compiled.children()
              if type(m).__name__ == "CheckpointedLayer"]
    assert len(layers) == len(checkpoint)
    (loss0, g0), (loss1, g1) = grads
    torch.testing.assert_close(loss1, loss0, rtol=0, atol=0)
    assert g0.keys() == g1.keys()
    for k in g0:
        torch.testing.assert_close(g1[k], g0[k], rtol=0, atol=0, msg=k)


def test_compiled_checkpointed_layers_save_what_the_interpreter_saves(one_rank_group):
    """Tensors saved for backward, counted by a saved-tensors hook: a
    checkpointed layer keeps only its inputs, in the compiled program as in the
    interpreted one, so both forwards save the same number of tensors."""
    model, inputs = build_model(GPT8, device="cpu", seed=0)
    layers = tuple(f"transformer.h.{i}" for i in range(8))
    executor = PlanExecutor(_one_device_plan(layers), model, inputs,
                            init_device_mesh("cpu", (1,)))
    counts = []
    for _ in range(2):
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(1) or t,
                                                      lambda t: t):
            loss = loss_of(executor(*inputs))
        loss.backward()
        counts.append(len(saved))
    assert executor._compiled is not None
    assert counts[1] == counts[0] > 0
