"""The cost model's price of a compiled program (``--compile``): inductor's
fused memory-bound chains (:mod:`costmodel.fusion`) and no per-op dispatch."""

from dataclasses import replace

import pytest

from costmodel.fusion import fused_chains, fused_shares
from costmodel.presets import load_cluster
from costmodel.strategy_cost import IntraOpCost
from ir.graph import OP, PARAM
from ir.shard_units import shard_units
from ir.trace import trace
from models.zoo import build
from planner.ilp.intra_op import prepare_intra_op, solve_prepared
from planner.search.stage_dp import stage_times


@pytest.fixture(scope="module")
def llama_graph():
    model, inputs = build("llama-tiny", device="meta", batch_size=8)[:2]
    return trace(model, inputs)


def test_a_chain_never_spans_an_unfused_kernel(llama_graph):
    """Ops joined through a GEMM or attention cannot share a kernel: from no
    chain's op does a path through an op outside the chain lead back into it
    (a residual add after a projection is not fused with the norm before it)."""
    by_name, users = llama_graph.by_name, llama_graph.users()
    chains = fused_chains(llama_graph)
    for chain in chains:
        assert 0 < chain.bytes_moved <= chain.eager_bytes and chain.kernels >= 1
        members = set(chain.members)
        outside = [u for m in members for u in users[m] if u not in members]
        seen = set()
        while outside:
            n = outside.pop()
            if n in seen:
                continue
            seen.add(n)
            assert n not in members, (n, chain.members)
            outside += users[n]
    # each RMSNorm (pow, mean, rsqrt, mul) is fused; two per layer and the last one
    norms = [c for c in chains if any(by_name[m].target.startswith("aten.rsqrt")
                                      for m in c.members)]
    assert len(norms) == 2 * 2 + 1
    assert sum(c.bytes_moved for c in chains) < 0.5 * sum(c.eager_bytes for c in chains)


def test_compiled_prices_fuse_and_drop_dispatch(llama_graph):
    eager = load_cluster("local-cpu:2")
    compiled = eager.running_compiled()
    assert compiled.device.compiled and not eager.device.compiled
    assert compiled.to_dict() == eager.to_dict()  # the plan records training.compile instead
    cost_e = IntraOpCost(llama_graph, eager, (2,), "float32")
    cost_c = IntraOpCost(llama_graph, compiled, (2,), "float32")
    shares = fused_shares(llama_graph)
    prepared = prepare_intra_op(llama_graph, compiled, (2,))
    fused_e = fused_c = 0.0
    for ns in prepared.strategies:
        s = ns.strategies[0]
        if ns.node.name in shares:
            fused_e += cost_e.compute(ns.node, s)
            fused_c += cost_c.compute(ns.node, s)
        elif ns.node.kind == OP and ns.node.flops > 0:  # a GEMM: its kernel, no dispatch
            assert cost_c.forward_time(ns.node, s) == pytest.approx(
                cost_e.forward_time(ns.node, s) - eager.device.dispatch_overhead, rel=1e-9)
    assert fused_c < 0.5 * fused_e


def test_compiled_problem_prices_what_it_solves(llama_graph):
    """Tied copies of a block price alike, or are not tied: the solver's
    objective is the breakdown of the plan it returns (the last block's
    residual add writes nothing the next block reads)."""
    prepared = prepare_intra_op(llama_graph, load_cluster("local-cpu:2").running_compiled(), (2,))
    result = solve_prepared(prepared)  # asserts objective == breakdown
    assert result.breakdown.total_s > 0


def test_a_compiled_stage_prices_its_backward_whole(llama_graph):
    """A compiled stage's backward is one graph, which the runtime runs whole in a
    zero-bubble schedule's input pass (``codegen.pipeline._weight_pass_done``):
    priced with no weight pass, its one backward pass makes both gradients (about
    twice the forward's GEMMs)."""
    times = {}
    for compiled in (False, True):
        cluster = load_cluster("local-cpu:2").running_compiled(compiled)
        result = solve_prepared(prepare_intra_op(llama_graph, cluster, (2,)))
        times[compiled] = stage_times(result, cluster, "float32", "adam")
    assert times[False].backward_weight_s > 0 and times[True].backward_weight_s == 0
    assert times[True].backward_input_s > 1.5 * times[True].forward_s


@pytest.mark.parametrize("zero_stage", [0, 3])
def test_a_compiled_stage_pays_its_measured_call(llama_graph, zero_stage):
    """Each micro-batch's call of a compiled stage costs the host what ``planner
    profile`` measured: per call in the forward (under ZeRO-3 one call per
    FSDP2 unit, each compiled apart), per parameter in the backward; an eager
    stage pays neither."""
    base = load_cluster("local-cpu:2")
    measured = replace(base, device=replace(base.device, compiled_call_overhead=1e-3,
                                            compiled_param_overhead=1e-4))
    params = sum(1 for n in llama_graph.nodes if n.kind == PARAM)
    calls = len(shard_units(llama_graph)) if zero_stage == 3 else 1
    assert calls > 2 or zero_stage == 0  # llama-tiny: its layers, embedding and head
    for compiled in (False, True):
        times = []
        for cluster in (base, measured):
            cluster = cluster.running_compiled(compiled)
            result = solve_prepared(prepare_intra_op(llama_graph, cluster, (2,),
                                                     zero_stage=zero_stage))
            times.append(stage_times(result, cluster, "float32", "adam", zero_stage=zero_stage))
        added_f = times[1].forward_s - times[0].forward_s
        added_b = times[1].backward_input_s - times[0].backward_input_s
        assert (added_f, added_b) == ((pytest.approx(calls * 1e-3), pytest.approx(params * 1e-4))
                                      if compiled else (0.0, 0.0))


def test_ops_between_zero3_units_are_priced_eager(llama_graph):
    """A compiled ZeRO-3 stage compiles each FSDP2 unit apart and runs the ops
    between them (the loss) eagerly: those pay the per-op dispatch and their
    own memory passes, the units' ops the fused price."""
    compiled = load_cluster("local-cpu:2").running_compiled()
    inside = {op for unit in shard_units(llama_graph) for op in unit.ops}
    between = [n for n in llama_graph.nodes if n.kind == OP and n.name not in inside]
    assert any(n.bytes_moved > 0 for n in between)  # the loss's ops
    cost_3 = IntraOpCost(llama_graph, compiled, (2,), "float32", zero_stage=3)
    cost_0 = IntraOpCost(llama_graph, compiled, (2,), "float32")
    assert cost_3.eager_ops == frozenset(n.name for n in between) and not cost_0.eager_ops
    eager = IntraOpCost(llama_graph, load_cluster("local-cpu:2"), (2,), "float32", zero_stage=3)
    prepared = prepare_intra_op(llama_graph, compiled, (2,), zero_stage=3)
    for ns in prepared.strategies:
        s = ns.strategies[0]
        if ns.node.name in cost_3.eager_ops:
            assert cost_3.compute(ns.node, s) == pytest.approx(eager.compute(ns.node, s), rel=1e-9)
        elif ns.node.name in cost_0.fused_shares:  # still fused (a chain the loss cut: its part)
            assert ns.node.name in cost_3.fused_shares
            assert cost_3.compute(ns.node, s) < eager.compute(ns.node, s)


def test_a_fused_share_takes_its_bytes_or_its_elements_whichever_is_slower():
    """On a CPU rank a fused kernel's work per element (exp, divides), not its
    bytes, bounds it; where the device states no rate (GPUs), the bytes do."""
    from costmodel.fusion import fused_seconds

    device = replace(load_cluster("local-cpu:2").device, memory_bandwidth=1e10,
                     memory_efficiency=1.0, kernel_overhead=1e-6)
    share = (1e8, 2.0, 1e8)  # bytes, kernels, elements
    assert fused_seconds(share, 2, device) == pytest.approx(1e8 / 1e10 / 2 + 2e-6)
    slow = replace(device, fused_element_rate=1e9)
    assert fused_seconds(share, 2, slow) == pytest.approx(1e8 / 1e9 / 2 + 2e-6)
    fast = replace(device, fused_element_rate=1e12)
    assert fused_seconds(share, 2, fast) == fused_seconds(share, 2, device)
    chains = fused_chains(trace(*build("llama-tiny", device="meta", batch_size=8)[:2]))
    assert all(c.elements > 0 for c in chains)


def test_a_checkpointed_layer_recomputes_compiled(llama_graph):
    """A compiled program re-runs a checkpointed layer compiled (traced into
    the program's graph on one device, its own region on a mesh): the re-run
    is the compiled forward; on a mesh each such layer enters three frames in
    the forward (its module's, its region's, the program's resumed after it)
    and its region again in the backward, on one device nothing more."""
    from costmodel.compute import compiled_call_seconds

    eager = load_cluster("local-cpu:2")
    compiled = replace(eager, device=replace(eager.device, compiled_call_overhead=1e-3,
                                             compiled_param_overhead=0.0)).running_compiled()
    cost_e = IntraOpCost(llama_graph, eager, (2,), "float32")
    cost_c = IntraOpCost(llama_graph, compiled, (2,), "float32")
    shares = fused_shares(llama_graph)
    prepared = prepare_intra_op(llama_graph, eager, (2,))
    fused = next(ns for ns in prepared.strategies if ns.node.name in shares
                 and ns.node.name in cost_c.requires_grad)
    node, s = fused.node, fused.strategies[0]
    assert cost_e.recompute_each(node, [s]) == [pytest.approx(cost_e.forward_time(node, s))]
    assert cost_c.recompute_each(node, [s]) == [pytest.approx(cost_c.forward_time(node, s))]
    assert cost_c.forward_time(node, s) < cost_e.forward_time(node, s)  # fused, undispatched
    layers = ["layers.0", "layers.1"]
    assert cost_c.region_calls(layers) == (7, 2)  # each layer: 3 frames, and its re-run
    assert compiled_call_seconds(llama_graph, compiled.device,
                                 cost_c.region_calls(layers)) == pytest.approx((7e-3, 2e-3))
    one = load_cluster("local-cpu:1")
    one_device = IntraOpCost(llama_graph, replace(one, device=compiled.device), (1,), "float32")
    assert one_device.region_calls(layers) == (1, 0)
    assert compiled_call_seconds(llama_graph, eager.device, (3, 2)) == (0.0, 0.0)


def test_a_compiled_pipeline_pays_its_own_measured_action():
    """A compiled plan's stages pay the action measured with compiled stages,
    an eager plan's the eager one; where only the eager one was measured
    (a profile from before), both pay it."""
    from planner.search.pipeline_search import schedule_action_s

    cluster = load_cluster("local-cpu:2")
    both = replace(cluster, device=replace(cluster.device, pipeline_action_overhead=3e-4,
                                           compiled_pipeline_action_overhead=5e-4))
    assert schedule_action_s("1f1b", both) == 3e-4
    assert schedule_action_s("1f1b", both.running_compiled()) == 5e-4
    assert schedule_action_s("none", both.running_compiled()) == 0.0
    eager_only = replace(both, device=replace(both.device, compiled_pipeline_action_overhead=0.0))
    assert schedule_action_s("1f1b", eager_only.running_compiled()) == 3e-4


def test_the_pipeline_probe_runs_both_stages_compiled():
    """``planner profile``'s pipeline probe, compiled: two stages of gpt-tiny
    on two ranks, each region compiled (none fell back to eager), timed alone
    and under the 1F1B schedule; the fit gives a figure."""
    from codegen.pipeline_probe import measure_pipeline
    from costmodel.profiling.runtime_costs import runtime_pipeline_action

    raw = measure_pipeline(2, "cpu", "gloo", True, False, runtimes=("compiled",))
    timed = raw["runtime_pipeline"]["compiled"]
    assert timed["eager_regions"] == [] and "eager" not in raw["runtime_pipeline"]
    assert timed["pipelined"]["seconds"] > timed["forward"]["seconds"] > 0
    assert runtime_pipeline_action(raw, load_cluster("local-cpu:2").intra_node, "compiled") >= 0


def test_a_compiled_gemm_runs_at_the_aligned_rate():
    """Inductor pads a compiled program's matmuls to the tensor cores'
    alignment: the head of a 1001-token vocabulary (rows not a multiple of 8
    bf16 elements) costs the eager runtime the profiled unaligned rate, and the
    compiled program the aligned one."""
    from costmodel.compute import gemm_aligned
    from models.zoo import GPTConfig, build_from_config

    config = GPTConfig(n_layer=1, n_embd=64, n_head=4, vocab_size=1001, block_size=32)
    graph = trace(*build_from_config(config, device="meta", batch_size=8, seq_len=32))
    base = load_cluster("dgx-h100").sub_cluster(1, 1)
    # GEMMs bound by their FLOPs alone, at one efficiency whatever their size
    gpu = replace(base, device=replace(base.device, unaligned_gemm_efficiency=0.25,
                                       half_saturation_flops=0.0, memory_bandwidth=1e18))
    prices = {}
    for compiled in (False, True):
        cluster = gpu.running_compiled(compiled)
        cost = IntraOpCost(graph, cluster, (1,), "bfloat16")
        prepared = prepare_intra_op(graph, cluster, (1,))
        head = [ns for ns in prepared.strategies if ns.node.flops > 0
                and ns.node.kind == OP and not gemm_aligned(ns.node)]
        assert head, "the vocabulary's GEMMs are unaligned"
        prices[compiled] = [cost.forward_time(ns.node, ns.strategies[0]) for ns in head]
    overhead = gpu.device.kernel_overhead
    for eager, compiled in zip(prices[False], prices[True]):
        assert eager - overhead == pytest.approx(4 * (compiled - overhead), rel=1e-6)


def test_a_gpu_host_runs_a_compiled_call_beside_the_kernels():
    """Where the host queues kernels ahead of the device (a GPU profile:
    host_overhead measured), a compiled region's call costs the host time
    that overlaps the pass's kernels: the pass takes the longer of the two.
    On CPU ranks host and device are one, and the call adds to the kernels."""
    from costmodel.compute import pass_seconds

    gpu = replace(load_cluster("dgx-h100").device, host_overhead=2e-5)
    cpu = load_cluster("local-cpu:2").device
    assert pass_seconds(10e-3, 0.0, 3e-3, gpu) == pytest.approx(10e-3)
    assert pass_seconds(10e-3, 4e-3, 8e-3, gpu) == pytest.approx(12e-3)
    assert pass_seconds(10e-3, 0.0, 3e-3, cpu) == pytest.approx(13e-3)


def test_a_fused_chain_reads_through_a_tuple_projection():
    """A layer norm's output reaches GELU through a tuple projection (getitem),
    which has no tensor input of its own: the compiled chain after it is
    priced, and moves fewer bytes than the same ops run eagerly."""
    from costmodel.profiling.memory_probe import chain_graph

    graph = chain_graph(64, 256, "float32")
    assert any(n.target == "getitem" and not n.inputs for n in graph.nodes)
    assert fused_shares(graph)
    totals = {}
    for compiled in (False, True):
        cluster = load_cluster("local-cpu:1").running_compiled(compiled)
        prepared = prepare_intra_op(graph, cluster, (1,))
        cost = IntraOpCost(graph, cluster, (1,), "float32")
        totals[compiled] = sum(cost.forward_time(ns.node, ns.strategies[0])
                               for ns in prepared.strategies if ns.node.kind == OP)
    assert 0 < totals[True] < totals[False]


def test_each_cp_attention_breaks_the_compiled_program_once(llama_graph):
    """Context parallelism's attention exchange runs eager between a compiled
    program's graphs (``codegen.lowered_program``): each attention op adds one
    compiled call to the forward it prices, and nothing to the backward."""
    from planner.search.cp_search import context_parallel_seconds

    compiled = load_cluster("local-cpu:2").running_compiled()
    free = replace(compiled, device=replace(compiled.device, compiled_call_overhead=0.0))
    result = solve_prepared(prepare_intra_op(llama_graph, compiled, (2,)))
    priced = [context_parallel_seconds(result, IntraOpCost(result.graph, c, (2,), "float32"), 2,
                                       "p2p", c.intra_node) for c in (compiled, free)]
    attentions = sum(n.target == "aten.scaled_dot_product_attention.default"
                     for n in result.graph.nodes)
    assert attentions == 2
    assert priced[0][0] - priced[1][0] == pytest.approx(
        attentions * compiled.device.compiled_call_overhead)
    assert priced[0][1] == pytest.approx(priced[1][1])
