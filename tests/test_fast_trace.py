"""ir.block_capture.trace: the Graph written out from short probe captures equals the full capture."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ir.block_capture.trace as fast_trace_module
from models import zoo
from ir.exported_graph import graph_from_exported, module_path as _module_path
from ir.block_capture.trace import SynthesizedProgram, fast_trace, rescaled_trace
from ir.probe_rescale import RescaleError, rescale_program
from ir.program_capture import CapturedProgram, capture, capture_in_one_pass
from ir.trace import trace
from models.zoo import GPTConfig, LlamaConfig, MoEConfig
from planner.api import plan


def _full(model, inputs):
    ep = capture(model, inputs)
    return ep, graph_from_exported(ep, model_name=type(model).__name__)


@pytest.fixture(scope="module")
def full_capture():
    """``full_capture(cfg, batch)``: the full capture of the zoo model of ``cfg``
    at ``batch`` x 16 tokens, made once per module (several tests compare with it)."""
    done = {}

    def get(cfg, batch):
        key = (repr(cfg), batch)
        if key not in done:
            done[key] = _full(*zoo.build_from_config(cfg, batch_size=batch, seq_len=16))
        return done[key]
    return get


def _fx_record(n: torch.fx.Node) -> tuple:
    return (n.op, n.name, n.target,
            torch.fx.node.map_arg((n.args, n.kwargs), lambda a: ("node", a.name)))


def _assert_same(fast, ep, full):
    assert fast is not None, "fast path fell back"
    assert isinstance(fast.exported, SynthesizedProgram)
    assert [n.name for n in fast.nodes] == [n.name for n in full.nodes]
    for a, b in zip(fast.nodes, full.nodes):
        assert a == b, (a, b)
    assert fast.nodes == full.nodes
    assert fast.output_names == full.output_names
    assert fast.model_name == full.model_name
    assert fast.fingerprint() == full.fingerprint()
    # The fx program planner.ilp.strategies reads: every node, same target and wiring.
    got = list(fast.exported.graph.nodes)
    want = list(ep.graph.nodes)
    assert [_fx_record(n) for n in got] == [_fx_record(n) for n in want]
    for a, b in zip(got, want):
        va, vb = a.meta.get("val"), b.meta.get("val")
        if isinstance(vb, torch.Tensor):
            assert (va.shape, va.stride(), va.dtype) == (vb.shape, vb.stride(), vb.dtype), b.name
    assert fast.exported.graph_signature.inputs_to_parameters == \
        ep.graph_signature.inputs_to_parameters
    assert fast.exported.graph_signature.user_inputs == ep.graph_signature.user_inputs
    # what codegen.executor reads to run the program
    assert fast.exported.graph_signature.input_specs == ep.graph_signature.input_specs
    assert fast.exported.graph_signature.output_specs == ep.graph_signature.output_specs


GPT = lambda n: GPTConfig(n, 64, 4, vocab_size=128, block_size=32)  # noqa: E731
MOE4 = MoEConfig(n_layer=4, n_embd=64, n_head=4, n_expert=4, expert_hidden=128, vocab_size=128,
                 block_size=32, capacity_factor=2.0, group_size=64)


@pytest.mark.parametrize("cfg", [
    GPT(6),
    LlamaConfig(n_layers=5, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=176, vocab_size=128,
                max_seq_len=32, rope_theta=10000.0),
    MoEConfig(n_layer=4, n_embd=64, n_head=4, n_expert=4, expert_hidden=128, vocab_size=128,
              block_size=32, capacity_factor=2.0, group_size=64),
], ids=["gpt-L6", "llama-L5", "moe-L4"])
def test_fast_equals_full(cfg, full_capture):
    model, inputs = zoo.build_from_config(cfg, batch_size=2, seq_len=16)
    ep, full = full_capture(cfg, 2)
    fast = fast_trace(model, inputs, min_blocks=4)
    _assert_same(fast, ep, full)
    # The user's model is left as it was.
    blocks = model.layers if isinstance(cfg, LlamaConfig) else model.transformer.h
    assert len(blocks) == (cfg.n_layers if isinstance(cfg, LlamaConfig) else cfg.n_layer)


LLAMA5 = LlamaConfig(n_layers=5, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=176, vocab_size=128,
                     max_seq_len=32, rope_theta=10000.0)


def _counting_captures(monkeypatch) -> list:
    """Make this process's probe captures append ``(method, blocks kept)`` to
    the returned list: ``"two passes"`` (ir.program_capture.capture) or ``"one pass"``
    (ir.program_capture.capture_in_one_pass)."""
    done = []
    for name, method in (("capture", "two passes"), ("capture_in_one_pass", "one pass")):
        def counted(m, a, real=getattr(fast_trace_module, name), method=method):
            done.append((method, len(m.layers if hasattr(m, "layers") else m.transformer.h)))
            return real(m, a)
        monkeypatch.setattr(fast_trace_module, name, counted)
    return done


def test_long_probe_captured_in_another_process_gives_the_full_capture(monkeypatch,
                                                                       full_capture):
    from planner.search.two_level import two_processes as _two_processes
    from planner.search.forked_workers import can_fork

    model, inputs = zoo.build_from_config(LLAMA5, batch_size=2, seq_len=16)
    ep, full = full_capture(LLAMA5, 2)
    captured_here = _counting_captures(monkeypatch)
    _assert_same(fast_trace(model, inputs, min_blocks=4, beside=_two_processes), ep, full)
    # the probes are captured one each way, so the method's check also compares the two
    assert captured_here == ([("two passes", 2)] if can_fork() else
                             [("two passes", 2), ("one pass", 3)])


def test_a_failing_other_process_leaves_the_long_probe_to_this_one(monkeypatch, full_capture):
    model, inputs = zoo.build_from_config(LLAMA5, batch_size=2, seq_len=16)
    ep, full = full_capture(LLAMA5, 2)
    captured_here = _counting_captures(monkeypatch)

    def broken(here, there):
        raise RuntimeError("the child died")
    _assert_same(fast_trace(model, inputs, min_blocks=4, beside=broken), ep, full)
    assert captured_here == [("two passes", 2), ("one pass", 3)]


@pytest.mark.parametrize("cfg", [GPT(6), LLAMA5], ids=["gpt-L6", "llama-L5"])
def test_later_trace_at_other_shapes_takes_one_probe(cfg, monkeypatch, full_capture):
    """A trace ``like`` an earlier one at another batch size captures only the
    short probe and still equals the full capture at the new size. (MoE's
    program changes with the batch, its expert capacity, so it takes both.)"""
    model, inputs = zoo.build_from_config(cfg, batch_size=4, seq_len=16)
    first = fast_trace(model, inputs, min_blocks=4)
    model2, inputs2 = zoo.build_from_config(cfg, batch_size=2, seq_len=16)
    ep, full = full_capture(cfg, 2)
    probes = _counting_captures(monkeypatch)
    again = fast_trace(model2, inputs2, min_blocks=4, like=first.exported)
    _assert_same(again, ep, full)
    assert probes == [("one pass", 2)]


@pytest.mark.parametrize("batch", [2, 4])
def test_a_trace_like_a_different_program_checks_both_probes(batch, monkeypatch,
                                                              full_capture):
    """Another model's program, or MoE's at another batch size (its expert
    capacity changes the program), is not taken as the method."""
    model, inputs = zoo.build_from_config(MOE4, batch_size=batch, seq_len=16)
    other, other_inputs = zoo.build_from_config(LLAMA5 if batch == 2 else MOE4, batch_size=2,
                                                seq_len=16)
    first = fast_trace(other, other_inputs, min_blocks=4)
    ep, full = full_capture(MOE4, batch)
    probes = _counting_captures(monkeypatch)
    _assert_same(fast_trace(model, inputs, min_blocks=4, like=first.exported), ep, full)
    # checked anew on two probes: one captured each way where ``like`` is
    # another model's, both in one pass where it is this model's (its first
    # trace checked the one pass against torch.export)
    assert probes == ([("two passes", 2), ("one pass", 3)] if batch == 2 else
                      [("one pass", 2), ("one pass", 3)])


def test_rescaled_trace_equals_the_capture(monkeypatch, full_capture):
    """The program at a third batch size, written out from the short probes of
    two traces without capturing, equals the full capture: Graph, fx literals
    (view sizes) and values. (GPT: tests/test_rescale.py, through the search.)"""
    cfg = LLAMA5
    traces = {}
    for batch in (4, 2):
        model, inputs = zoo.build_from_config(cfg, batch_size=batch, seq_len=16)
        traces[batch] = fast_trace(model, inputs, min_blocks=4,
                                   like=traces[4].exported if traces else None)
    model, inputs = zoo.build_from_config(cfg, batch_size=6, seq_len=16)
    for name in ("capture", "capture_in_one_pass"):
        monkeypatch.setattr(fast_trace_module, name, lambda m, a: pytest.fail("captured"))
    written = rescaled_trace(model, inputs, traces[4].exported, traces[2].exported)
    _assert_same(written, *full_capture(cfg, 6))
    assert written.exported.batch == 6


class _Flatten(nn.Module):
    def forward(self, x):
        return x.reshape(x.shape[0] * x.shape[1], -1).sum(0)


class _MeanOverRows(nn.Module):
    def forward(self, x):
        return x.sum() * (1.0 / x.shape[0])  # a float literal that follows the batch


def test_rescale_program_follows_integer_literals_and_refuses_the_rest():
    caps = {b: capture(_Flatten(), (torch.randn(b, 3, 4),)) for b in (2, 4, 6)}
    out = rescale_program(caps[4], 4, caps[2], 2, 6, (torch.randn(6, 3, 4),))
    want = list(caps[6].graph.nodes)
    assert [_fx_record(n) for n in out.graph.nodes] == [_fx_record(n) for n in want]
    assert [n.meta["val"].shape for n in out.graph.nodes if n.op != "output"] == \
        [n.meta["val"].shape for n in want if n.op != "output"]
    means = {b: capture(_MeanOverRows(), (torch.randn(b, 3),)) for b in (2, 4)}
    with pytest.raises(RescaleError, match="literal"):
        rescale_program(means[4], 4, means[2], 2, 6, (torch.randn(6, 3),))
    with pytest.raises(RescaleError, match="differs|nodes"):  # two different programs
        rescale_program(caps[4], 4, means[2], 2, 6, (torch.randn(6, 3, 4),))


# ---------------------------------------------------------------- custom models


class _Block(nn.Module):
    def __init__(self, d: int, scale: float = 1.0) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)
        self.scale = scale

    def forward(self, x, bias):
        return x + torch.relu(self.fc(self.norm(x))) * self.scale + bias


class _Stack(nn.Module):
    """Blocks reading a tensor made before them; ``mode`` varies what forward does."""

    def __init__(self, n: int = 5, d: int = 16, mode: str = "plain") -> None:
        super().__init__()
        self.mode = mode
        self.inp = nn.Linear(8, d)
        self.blocks = nn.ModuleList([_Block(d) for _ in range(n)])
        self.head = nn.Linear(d, 1)

    def forward(self, x):
        h = self.inp(x)
        bias = h.mean(0, keepdim=True)
        for i, blk in enumerate(self.blocks):
            h = blk(h, bias)
            if self.mode == "alternate" and i % 2:
                h = h * 0.5
        if self.mode == "bare":  # the program ends in the last block
            return h
        out = self.head(h).sum()
        if self.mode == "depth":
            out = out / len(self.blocks)
        return out


def _stack_inputs():
    return (torch.randn(4, 8, device="meta"),)


@pytest.mark.parametrize("mode", ["plain", "bare"])
def test_custom_stack_with_shared_prefix_tensor(mode):
    with torch.device("meta"):
        model = _Stack(mode=mode)
    inputs = _stack_inputs()
    ep, full = _full(model, inputs)
    _assert_same(fast_trace(model, inputs, min_blocks=4), ep, full)


@pytest.mark.parametrize("mode", ["alternate", "depth"])
def test_forward_that_depends_on_block_index_or_count_falls_back(mode):
    with torch.device("meta"):
        model = _Stack(mode=mode)
    assert fast_trace(model, _stack_inputs(), min_blocks=4) is None


def test_no_modulelist_falls_back():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    assert fast_trace(model, (torch.randn(2, 8, device="meta"),), min_blocks=1) is None


def test_mlp_with_different_first_layer_falls_back():
    model, inputs = zoo.build("mlp-tiny")
    assert fast_trace(model, inputs, min_blocks=2) is None


def test_blocks_differing_in_attributes_or_hooks_fall_back():
    with torch.device("meta"):
        model = _Stack()
    model.blocks[3].scale = 2.0
    assert fast_trace(model, _stack_inputs(), min_blocks=4) is None
    model.blocks[3].scale = 1.0
    handle = model.blocks[1].fc.register_forward_hook(lambda m, i, o: o)
    assert fast_trace(model, _stack_inputs(), min_blocks=4) is None
    handle.remove()


def test_shared_blocks_fall_back():
    with torch.device("meta"):
        model = _Stack()
    model.blocks[4] = model.blocks[0]  # the same module twice: tied weights
    assert fast_trace(model, _stack_inputs(), min_blocks=4) is None


def test_few_blocks_use_the_full_path():
    model, inputs = zoo.build_from_config(GPT(4), batch_size=2, seq_len=8)
    assert fast_trace(model, inputs) is None  # below MIN_BLOCKS


# ------------------------------------------------------------------ via trace/plan


def test_plan_is_the_same_whichever_path(monkeypatch):
    model, inputs = zoo.build_from_config(GPT(4))
    monkeypatch.setenv("PLANNER_FULL_TRACE", "1")
    slow = plan(model, "local-cpu:4", example_inputs=inputs, mesh_shape=(4,),
                model_source="gpt-tiny-L4")
    monkeypatch.setenv("PLANNER_FULL_TRACE", "0")
    monkeypatch.setattr(fast_trace_module, "MIN_BLOCKS", 4)
    graph = trace(model, inputs)
    assert isinstance(graph.exported, SynthesizedProgram)
    fast = plan(model, "local-cpu:4", example_inputs=inputs, mesh_shape=(4,),
                model_source="gpt-tiny-L4")
    assert fast.to_json() == slow.to_json()
    assert fast.model["fingerprint"] == graph.fingerprint()



@pytest.mark.parametrize("fails", [False, True])
def test_capture_leaves_torch_fx_recording_stack_traces_as_it_was(fails):
    """A capture skips torch.fx's per-node stack traces (the planner never
    reads them) and hands the setting back, also when the capture fails."""
    import torch.fx.config as fx_config

    class Bad(nn.Module):
        def forward(self, x):
            return x * 2 if x.sum() > 0 else x  # data-dependent: cannot be captured

    model = Bad() if fails else nn.Linear(4, 4)
    for before in (False, True):
        fx_config.do_not_emit_stack_traces = before
        try:
            if fails:
                with pytest.raises(Exception):
                    capture(model, (torch.randn(2, 4),))
            else:
                ep = capture(model, (torch.randn(2, 4),))
                assert not any(n.meta.get("stack_trace") for n in ep.graph.nodes)
            assert fx_config.do_not_emit_stack_traces is before
        finally:
            fx_config.do_not_emit_stack_traces = False


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny", "moe-tiny", "mlp-tiny"])
@pytest.mark.parametrize("batch", [1, 3])
def test_one_pass_capture_is_the_two_pass_capture(name, batch):
    """capture_in_one_pass gives capture's program: every node (name, target,
    wiring, module path, value layout) and the signature codegen reads; at
    batch 1 too, where torch specialises size-1 dimensions."""
    model, inputs = zoo.build(name, batch_size=batch)
    one, two = capture_in_one_pass(model, inputs), capture(model, inputs)
    assert isinstance(one, CapturedProgram)
    got, want = list(one.graph.nodes), list(two.graph.nodes)
    assert [_fx_record(n) for n in got] == [_fx_record(n) for n in want]
    for a, b in zip(got, want):
        assert _module_path(a) == _module_path(b), b.name
        va, vb = a.meta.get("val"), b.meta.get("val")
        if isinstance(vb, torch.Tensor):
            assert (va.shape, va.stride(), va.dtype) == (vb.shape, vb.stride(), vb.dtype), b.name
    assert one.graph_signature.input_specs == two.graph_signature.input_specs
    assert one.graph_signature.output_specs == two.graph_signature.output_specs
    assert graph_from_exported(one).fingerprint() == graph_from_exported(two).fingerprint()


def test_one_pass_decompositions_are_made_again_when_an_op_is_registered():
    """The one pass keeps export's materialised decomposition table while no
    op with a CompositeImplicitAutograd kernel is registered; a new one (a
    custom op the model may call) makes a table that decomposes it too."""
    from torch.export import default_decompositions

    from ir.program_capture import _export_decompositions

    first = _export_decompositions()
    assert _export_decompositions() == first
    from ir.torch_compat import KEPT_FUSED_OPS, KEPT_NATIVE_OPS

    assert set(first) == (set(default_decompositions().materialize()) - set(KEPT_FUSED_OPS)
                          - set(KEPT_NATIVE_OPS))
    lib = torch.library.Library("plannertest", "FRAGMENT")
    lib.define("scaled(Tensor x) -> Tensor")
    lib.impl("scaled", lambda x: x * 2.0, "CompositeImplicitAutograd")
    try:
        again = _export_decompositions()
        assert torch.ops.plannertest.scaled.default in again
        assert torch.ops.plannertest.scaled.default not in first
    finally:
        lib._destroy()


def test_one_pass_capture_falls_back_to_two_passes_for_other_outputs():
    """A model whose output the one pass cannot take (a dict) is captured by
    torch.export and run_decompositions, as capture does."""
    class DictOut(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            return {"y": self.fc(x).sum()}

    got = capture_in_one_pass(DictOut(), (torch.randn(2, 4),))
    assert isinstance(got, torch.export.ExportedProgram)
