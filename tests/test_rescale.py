"""Programs of other micro-batch sizes derived from two captures (ir.rescale)
equal real captures node for node, and the search uses them only once a third
capture has confirmed the rule."""

import functools
import warnings

import pytest

from costmodel.presets import load_cluster
from ir import trace
from ir.rescale import batch_rule
from models.source import build_model
from models.zoo import GPTConfig, build_from_config
from planner.search.context import SearchContext, microbatch_inputs
from planner.search.settings import SearchSettings


def _settings() -> SearchSettings:
    """The settings of these tests' searches: 4 CPU devices, memory unbounded."""
    return SearchSettings(load_cluster("local-cpu:4"), dtype="float32", optimizer="adam",
                          budget=1e12, time_limit_s=10)


@functools.lru_cache(maxsize=None)  # the tests only read the Graphs: capture each once
def _capture(name: str, batch: int):
    model, inputs = build_model(name, device="meta", batch_size=batch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return trace(model, inputs)


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny", "mlp-tiny"])
def test_derived_program_equals_the_capture(name):
    rule = batch_rule(_capture(name, 8), 8, _capture(name, 4), 4)
    assert rule is not None
    for batch in (2, 6):
        real = _capture(name, batch)
        assert rule.matches(real, batch)
        derived = rule.at(batch)
        assert derived.fingerprint() == real.fingerprint()
        assert [n.flops for n in derived.nodes] == [n.flops for n in real.nodes]
        assert [n.bytes_moved for n in derived.nodes] == [n.bytes_moved for n in real.nodes]
        assert derived.exported is None  # no strategy queries on a derived program


def test_programs_that_do_not_follow_the_batch_are_refused():
    # top-2 MoE dispatch rounds its capacity: not affine in the batch
    assert batch_rule(_capture("moe-tiny", 8), 8, _capture("moe-tiny", 4), 4) is None
    # different models
    assert batch_rule(_capture("gpt-tiny", 8), 8, _capture("llama-tiny", 4), 4) is None
    # the same batch twice says nothing
    g = _capture("gpt-tiny", 4)
    assert batch_rule(g, 4, g, 4) is None


def test_search_derives_programs_after_a_confirming_capture():
    model, inputs = build_model("gpt-tiny", device="meta", batch_size=16)
    traced: list[str] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ctx = SearchContext(model, inputs, _settings(),
                            whole_batch_graph=trace(model, inputs),
                            progress=lambda msg: traced.append(msg))
        assert ctx.program(2).traced and ctx.program(4).traced  # learn, then confirm
        derived = ctx.program(8)
        assert not derived.traced and len(traced) == 2
        real = ctx.program(8, traced=True)  # what strategy enumeration asks for
        assert real.traced and len(traced) == 3
        assert real.graph.fingerprint() == derived.graph.fingerprint()
        assert real.signatures == derived.signatures


def test_search_writes_out_programs_for_strategy_queries_once_the_rule_is_confirmed():
    """After the confirming capture, a program that strategy enumeration needs
    at a new micro-batch size is written out from the first two captures'
    probes (ir.block_capture.trace.rescaled_trace) instead of captured, and equals the
    capture node for node."""
    model, inputs = build_from_config(GPTConfig(8, 64, 4, vocab_size=128, block_size=32),
                                      batch_size=16, seq_len=16)
    said: list[str] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ctx = SearchContext(model, inputs, _settings(),
                            whole_batch_graph=trace(model, inputs), progress=said.append)
        assert ctx.program(2).captured and ctx.program(4).captured  # learn, then confirm
        written = ctx.program(8, traced=True)
        real = trace(model, microbatch_inputs(inputs, 8), like=ctx.program(4).graph)
        # torch specialises size-1 dimensions: a micro-batch of 1 is captured
        single = ctx.program(16, traced=True)
    assert said == ["tracing micro-batch 8", "tracing micro-batch 4",
                    "writing out micro-batch 2", "tracing micro-batch 1"]
    assert written.traced and not written.captured
    assert written.graph.nodes == real.nodes
    assert written.graph.fingerprint() == real.fingerprint()
    assert single.captured
