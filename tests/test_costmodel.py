"""Cost model tests against closed forms, published figures and DTensor itself."""

from __future__ import annotations

import ast
import dataclasses
import itertools
import json
import math
import pathlib

import pytest
import torch
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

import costmodel
from costmodel import (
    PRESETS,
    Cluster,
    ClusterError,
    DeviceSpec,
    Link,
    axis_links,
    collective_time,
    gpt_activation_bytes_per_layer,
    load_cluster,
    local_cpu_cluster,
    matmul_efficiency,
    op_time,
    preset,
    reserve_bytes,
    reshard_steps,
    reshard_time,
    training_state_bytes,
)
from ir.placements import parse_placement, placement_str

LINK = Link("test", bandwidth=100e9, latency=5e-6)


# --- collectives: closed forms ---------------------------------------------

def test_ring_all_reduce_closed_form():
    n, B = 8, 1e9
    expected = 2 * (n - 1) / n * B / LINK.bandwidth + 2 * (n - 1) * LINK.latency
    assert collective_time("all_reduce", B, n, LINK) == pytest.approx(expected, rel=1e-12)


def test_tree_all_reduce_wins_for_small_messages():
    n, B = 64, 8.0
    ring = 2 * (n - 1) / n * B / LINK.bandwidth + 2 * (n - 1) * LINK.latency
    tree = 2 * math.log2(n) * (LINK.latency + B / LINK.bandwidth)
    assert tree < ring
    assert collective_time("all_reduce", B, n, LINK) == pytest.approx(tree, rel=1e-12)


@pytest.mark.parametrize("kind", ["all_gather", "reduce_scatter", "all_to_all"])
def test_gather_scatter_alltoall_closed_form(kind):
    n, B = 4, 3e8
    expected = (n - 1) / n * B / LINK.bandwidth + (n - 1) * LINK.latency
    assert collective_time(kind, B, n, LINK) == pytest.approx(expected, rel=1e-12)


def test_broadcast_and_p2p():
    B = 1e9
    # large message: pipelined ring B/bw + (n-1)a beats the tree's log2(n) B/bw
    assert collective_time("broadcast", B, 8, LINK) == pytest.approx(B / LINK.bandwidth + 7 * LINK.latency)
    # tiny message on a big group: binomial tree's log2(n) steps win
    assert collective_time("broadcast", 4.0, 64, LINK) == pytest.approx(6 * (LINK.latency + 4.0 / LINK.bandwidth))
    assert collective_time("p2p", B, 2, LINK) == pytest.approx(B / LINK.bandwidth + LINK.latency)


def test_collective_edge_cases():
    for kind in costmodel.COLLECTIVES:
        assert collective_time(kind, 1e9, 1, LINK) == 0.0
        assert collective_time(kind, 0, 8, LINK) == 0.0
    with pytest.raises(ValueError, match="unknown collective"):
        collective_time("allreduce", 1.0, 2, LINK)
    with pytest.raises(ValueError):
        collective_time("all_reduce", -1.0, 2, LINK)
    with pytest.raises(ValueError):
        collective_time("all_reduce", 1.0, 0, LINK)


def test_collective_time_grows_with_bytes_and_group():
    for kind in costmodel.COLLECTIVES:
        assert collective_time(kind, 2e9, 8, LINK) > collective_time(kind, 1e9, 8, LINK)


# --- mesh axis -> physical link ----------------------------------------------

def test_axis_links_dgx_two_nodes():
    cl = load_cluster("dgx-a100-80g:2")
    assert cl.num_devices == 16
    assert axis_links(cl, (2, 8)) == [cl.inter_node, cl.intra_node]
    # groups spanning nodes with several devices per node may go hierarchically
    hier = lambda g: dataclasses.replace(cl.inter_node, local=(cl.intra_node, g))  # noqa: E731
    assert axis_links(cl, (16,)) == [hier(8)]
    assert axis_links(cl, (8, 2)) == [hier(4), cl.intra_node]  # axis 0 stride 2 spans nodes
    assert axis_links(cl, (4, 4)) == [hier(2), cl.intra_node]
    assert axis_links(cl, (2, 1, 8)) == [cl.inter_node, cl.intra_node, cl.intra_node]
    assert cl.inter_node.name == "infiniband" and cl.intra_node.name == "nvlink"


def test_axis_links_single_node_and_local_cpu():
    cl = load_cluster("dgx-h100")
    assert axis_links(cl, (2, 4)) == [cl.intra_node, cl.intra_node]
    cpu = load_cluster("local-cpu:4")
    links = axis_links(cpu, (2, 2))
    assert [l.name for l in links] == ["loopback", "loopback"]


def test_axis_links_wrong_size():
    with pytest.raises(ClusterError, match="16"):
        axis_links(load_cluster("dgx-a100-80g:2"), (2, 4))
    with pytest.raises(ClusterError):
        axis_links(load_cluster("local-cpu:4"), (0, 4))


def test_sub_cluster():
    cl = load_cluster("dgx-a100-80g:4")
    sub = cl.sub_cluster(1, 4)
    assert sub.num_devices == 4 and axis_links(sub, (4,)) == [cl.intra_node]
    with pytest.raises(ClusterError):
        cl.sub_cluster(5, 8)


# --- resharding ---------------------------------------------------------------

SHAPE = (64, 32)  # float32: 8192 bytes
NBYTES = 64 * 32 * 4


def test_reshard_1d_matches_collectives():
    mesh, links = (4,), [LINK]
    def t(a, b):
        return reshard_time([a], [b], SHAPE, 4, mesh, links)
    assert t(Shard(0), Replicate()) == pytest.approx(collective_time("all_gather", NBYTES, 4, LINK))
    assert t(Partial(), Replicate()) == pytest.approx(collective_time("all_reduce", NBYTES, 4, LINK))
    assert t(Partial(), Shard(1)) == pytest.approx(collective_time("reduce_scatter", NBYTES, 4, LINK))
    assert t(Shard(0), Shard(1)) == pytest.approx(collective_time("all_to_all", NBYTES / 4, 4, LINK))
    assert t(Shard(1), Partial()) == pytest.approx(collective_time("all_gather", NBYTES, 4, LINK))
    assert t(Replicate(), Shard(0)) == 0.0
    assert t(Replicate(), Partial()) == 0.0
    assert t(Shard(0), Shard(0)) == 0.0
    assert t(Partial(), Partial()) == 0.0
    assert t(Partial("sum"), Partial("avg")) == pytest.approx(collective_time("all_reduce", NBYTES, 4, LINK))
    # JSON strings are accepted as well
    assert reshard_time(["S(0)"], ["R"], SHAPE, 4, mesh, links) == t(Shard(0), Replicate())


def test_edge_prices_are_each_pairs_reshard_and_its_gradients_way_back():
    """ReshardPricer.edge_seconds, what the intra-op problem's edges cost: per
    (producer placements, consumer placements) the forward reshard plus, for a
    tensor that needs a gradient, the gradient's reshard from consumer to
    producer, where a partial sum's gradient is replicated."""
    from costmodel.resharding import ReshardPricer, gradient_placements

    cl = load_cluster("dgx-a100-80g:2")
    mesh = (2, 8)
    links = axis_links(cl, mesh)
    pricer = ReshardPricer(mesh, links)
    outs = [(Partial(), Shard(1)), (Shard(0), Replicate()), (Replicate(), Replicate())]
    ins = [(Replicate(), Shard(1)), (Shard(0), Shard(1))]
    srcs = tuple(pricer.spec_id(p) for p in outs)
    # equal placements get one id, whether the same tuple object or not
    assert pricer.spec_id(tuple(list(outs[0]))) == srcs[0]
    assert gradient_placements(outs[0]) == (Replicate(), Shard(1))
    dsts = tuple(pricer.spec_id(p) for p in ins)
    for with_gradient in (False, True):
        got = pricer.edge_seconds(srcs, dsts, SHAPE, 4, with_gradient)
        for a, row in zip(outs, got):
            for b, seconds in zip(ins, row):
                want = reshard_time(a, b, SHAPE, 4, mesh, links)
                if with_gradient:
                    want += reshard_time(gradient_placements(b), gradient_placements(a), SHAPE, 4,
                                         mesh, links)
                assert seconds == want
        assert pricer.edge_seconds(srcs, dsts, SHAPE, 4, with_gradient) is got  # memoised


def test_reshard_2d_accounts_for_other_axis_sharding():
    cl = load_cluster("dgx-a100-80g:2")
    mesh = (2, 8)
    links = axis_links(cl, mesh)
    inter, intra = links
    # axis 1 all-gather while axis 0 keeps the tensor split in 2
    got = reshard_time([Shard(0), Shard(1)], [Shard(0), Replicate()], SHAPE, 4, mesh, links)
    assert got == pytest.approx(collective_time("all_gather", NBYTES / 2, 8, intra))
    # axis 0 all-reduce while axis 1 keeps it split in 8, priced on InfiniBand
    got = reshard_time([Partial(), Shard(1)], [Replicate(), Shard(1)], SHAPE, 4, mesh, links)
    assert got == pytest.approx(collective_time("all_reduce", NBYTES / 8, 2, inter))
    # P -> S on axis 1 with axis 0 replicated: reduce-scatter of the whole tensor
    got = reshard_time([Replicate(), Partial()], [Replicate(), Shard(0)], SHAPE, 4, mesh, links)
    assert got == pytest.approx(collective_time("reduce_scatter", NBYTES, 8, intra))
    # both axes gathered: DTensor goes inner axis first (still split on axis 0), then outer
    got = reshard_time([Shard(0), Shard(1)], [Replicate(), Replicate()], SHAPE, 4, mesh, links)
    expected = collective_time("all_gather", NBYTES / 2, 8, intra) + collective_time("all_gather", NBYTES, 2, inter)
    assert got == pytest.approx(expected)


def test_reshard_nested_sharding_goes_through_replicate():
    # (S(0), S(0)) -> (R, S(0)): DTensor un-nests axis 1 first, then axis 0, then re-slices.
    steps = reshard_steps(["S(0)", "S(0)"], ["R", "S(0)"], SHAPE, 4, (2, 4))
    assert [(s.mesh_axis, s.src, s.dst, s.collective) for s in steps] == [
        (1, "S(0)", "R", "all_gather"),
        (0, "S(0)", "R", "all_gather"),
        (1, "R", "S(0)", None),
    ]
    assert [s.nbytes for s in steps] == [NBYTES // 2, NBYTES, 0]


def test_reshard_uneven_is_conservative():
    # 10 rows over 4 devices: DTensor pads to ceil(10/4) = 3 rows per shard
    steps = reshard_steps(["S(0)"], ["S(1)"], (10, 8), 2, (4,))
    assert steps[0].collective == "all_to_all" and steps[0].nbytes == 3 * 8 * 2


def test_reshard_bad_input():
    with pytest.raises(ValueError, match="one placement per mesh axis"):
        reshard_time(["R"], ["R", "R"], SHAPE, 4, (2, 2), [LINK, LINK])
    with pytest.raises(ValueError, match="dim 2"):
        reshard_time(["S(2)"], ["R"], SHAPE, 4, (2,), [LINK])
    with pytest.raises(ValueError, match="one link per mesh axis"):
        reshard_time(["R"], ["R"], SHAPE, 4, (2,), [])


def test_reshard_steps_match_dtensor_planner():
    """Our step list equals DTensor's own greedy planner on a fake 2x4 mesh."""
    dist = pytest.importorskip("torch.distributed")
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
        from torch.distributed.tensor._redistribute import _gen_transform_infos_non_cached
        from torch.testing._internal.distributed.fake_pg import FakeStore
    except ImportError as e:  # private API moved: the closed-form tests still hold
        pytest.skip(f"DTensor internals not available: {e}")
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    try:
        mesh = init_device_mesh("cpu", (2, 4))
        shape = (8, 16, 4)
        meta = TensorMeta(torch.Size(shape), (64, 4, 1), torch.float32)
        choices = [Replicate(), Shard(0), Shard(1), Partial()]
        checked = 0
        for src in itertools.product(choices, repeat=2):
            for dst in itertools.product(choices, repeat=2):
                if any(isinstance(d, Partial) and isinstance(s, Shard) for s, d in zip(src, dst)):
                    continue  # DTensor refuses S -> P
                infos = _gen_transform_infos_non_cached(DTensorSpec(mesh, src, meta), DTensorSpec(mesh, dst, meta))
                theirs = [(i.mesh_dim, placement_str(i.src_dst_placements[0]), placement_str(i.src_dst_placements[1])) for i in infos]
                ours = [(s.mesh_axis, s.src, s.dst) for s in reshard_steps(src, dst, shape, 4, (2, 4))]
                assert ours == theirs, (src, dst)
                checked += 1
        assert checked > 150
    finally:
        dist.destroy_process_group()


def test_placement_strings():
    for p, s in [(Replicate(), "R"), (Shard(0), "S(0)"), (Shard(3), "S(3)"), (Partial(), "P"), (Partial("avg"), "P(avg)")]:
        assert placement_str(p) == s
        assert parse_placement(s) == p
    assert parse_placement("P(sum)") == Partial()
    assert parse_placement(" S( 1 ) ") == Shard(1)
    for bad in ["", "X", "S", "S(a)", "S(-1)", "P(foo)", "RR", "Shard(0)"]:
        with pytest.raises(ValueError, match="placement"):
            parse_placement(bad)


# --- memory ---------------------------------------------------------------------

def test_zero_memory_of_mixed_precision_adam():
    """bf16-mixed Adam as Megatron and torchtitan keep it: fp32 params, grads and
    2 states (16 B) plus the bf16 working copy (2 B); ZeRO shards each part
    (stage 1, the distributed optimizer, shards the fp32 master copy with the
    states and keeps the bf16 parameters whole)."""
    psi, n = 7_500_000_000, 64
    exact = {0: 18 * psi, 1: 6 * psi + 12 * psi / n, 2: 6 * psi + 2 * psi + 12 * psi / n,
             3: 2 * psi + 2 * psi + 16 * psi / n}
    for stage in range(4):
        got = training_state_bytes(psi, precision="bf16-mixed", zero_stage=stage, dp_size=n)
        assert got["total"] == pytest.approx(exact[stage], rel=1e-9)
        assert got["total"] == got["params"] + got["grads"] + got["optimizer"]
    s0 = training_state_bytes(psi, precision="bf16-mixed")
    assert (s0["params"], s0["grads"], s0["optimizer"]) == (6 * psi, 4 * psi, 8 * psi)
    bf16 = training_state_bytes(psi, precision="bf16")
    assert (bf16["params"], bf16["grads"], bf16["optimizer"]) == (2 * psi, 2 * psi, 4 * psi)


@pytest.mark.parametrize("d", [1, 2, 8, 64, 3072])
@pytest.mark.parametrize("precision,reduce,whole,sharded", [
    ("bf16-mixed", None, 6, 12),     # bf16 params, fp32 grads: Megatron-LM's 6 + 12/d
    ("fp16-mixed", None, 6, 12),
    ("bf16-mixed", "bf16", 4, 16),   # 16-bit params and grads: 4 + 16/d
    ("fp16-mixed", "fp16", 4, 16),
    ("fp32", None, 8, 8),            # fp32 params and grads: 8 + 8/d
    ("bf16", None, 4, 4),            # everything bf16 (no master copy): 4 + 4/d
])
def test_zero1_is_megatrons_distributed_optimizer(precision, reduce, whole, sharded, d):
    """ZeRO stage 1 holds what Megatron-LM's distributed optimizer holds, per
    parameter with Adam on d data-parallel ranks (Megatron-LM's table; d = 1
    is its optimizer without the distributed one: 18, 20 and 16 bytes): the
    working parameters and gradients whole, the fp32 master slice and Adam's
    moments per rank ('optimizer') and, with 16-bit gradients, an fp32
    main-gradient slice (counted with the gradients)."""
    from ir.precision import get_precision

    psi = 1000 * 3072  # divides by every d: no rounding
    p = get_precision(precision, reduce)
    got = training_state_bytes(psi, precision=p, zero_stage=1, dp_size=d)
    assert got["total"] == whole * psi + sharded * psi // d
    assert got["params"] == p.compute_dtype.itemsize * psi  # whole, as the forward reads them
    master_and_states = {"fp32": 8, "bf16": 4}.get(precision, 12)
    assert got["optimizer"] == master_and_states * psi // d
    assert got["grads"] == p.reduce_dtype.itemsize * psi + (sharded - master_and_states) * psi // d
    # fewer bytes than the model keeps without ZeRO from two ranks on
    assert (got["total"] < training_state_bytes(psi, precision=p)["total"]) == (d > 1)


def test_training_state_fp32_and_options():
    psi = 1000
    fp32 = training_state_bytes(psi)
    assert (fp32["params"], fp32["grads"], fp32["optimizer"]) == (4 * psi, 4 * psi, 8 * psi)
    assert training_state_bytes(psi, optimizer="sgd")["total"] == 8 * psi
    # ZeRO on one rank changes nothing; uneven shards round up (plus the gathered whole)
    assert training_state_bytes(psi, zero_stage=3, dp_size=1) == fp32
    assert training_state_bytes(1001, zero_stage=3, dp_size=4)["params"] == 4 * 251 + 4 * 1001
    with pytest.raises(ValueError, match="optimizer"):
        training_state_bytes(psi, optimizer="lion")
    with pytest.raises(ValueError, match="zero_stage"):
        training_state_bytes(psi, zero_stage=4)


def test_gpt_activation_bytes():
    b, s, h, a = 1, 2048, 12288, 96
    assert gpt_activation_bytes_per_layer(b, s, h, a) == pytest.approx(s * b * h * (34 + 5 * a * s / h))
    assert gpt_activation_bytes_per_layer(b, s, h, a) == pytest.approx(34 * b * s * h + 5 * a * s * s * b)
    assert gpt_activation_bytes_per_layer(b, s, h, a, recompute=True) == 2 * s * b * h
    t = 8
    assert gpt_activation_bytes_per_layer(b, s, h, a, tp=t) == pytest.approx(s * b * h * (10 + 24 / t + 5 * a * s / (h * t)))
    full_sp = gpt_activation_bytes_per_layer(b, s, h, a, tp=t, sequence_parallel=True)
    assert full_sp == pytest.approx(gpt_activation_bytes_per_layer(b, s, h, a) / t)
    assert gpt_activation_bytes_per_layer(b, s, h, a, "selective", tp=t, sequence_parallel=True) == pytest.approx(34 * s * b * h / t)
    with pytest.raises(ValueError):
        gpt_activation_bytes_per_layer(b, s, h, a, recompute="some")


def test_reserve_bytes():
    assert reserve_bytes(80 * 10**9, 0.1) == 8 * 10**9
    assert reserve_bytes(10, 0.25) == 3
    with pytest.raises(ValueError):
        reserve_bytes(10, 1.0)


# --- compute ---------------------------------------------------------------------

def test_op_time_roofline():
    dev = load_cluster("dgx-a100-80g").device
    # compute bound: 1 TFLOP of bf16
    t = op_time(1e12, 1e6, dev, "bfloat16", efficiency=0.5)
    assert t == pytest.approx(1e12 / (312e12 * 0.5) + dev.kernel_overhead)
    # memory bound: 1 GB streamed, few FLOPs
    t = op_time(1e6, 1e9, dev, torch.float32, memory_efficiency=1.0)
    assert t == pytest.approx(1e9 / dev.memory_bandwidth + dev.kernel_overhead)
    # defaults come from the device
    assert op_time(1e12, 0, dev, "bf16") == pytest.approx(1e12 / (312e12 * dev.flop_efficiency) + dev.kernel_overhead)
    assert op_time(0, 0, dev, "float32") == 0.0


def test_unaligned_gemm_is_priced_at_the_profiled_fraction():
    """A GEMM with a row not a multiple of 16 bytes (a 50257-token vocabulary)
    runs at the device's unaligned_gemm_efficiency of the aligned rate; the
    alignment is read off the node's matrices (bf16: multiples of 8)."""
    from costmodel.compute import gemm_aligned
    from ir.graph import Node, TensorInfo

    dev = dataclasses.replace(load_cluster("dgx-h100").device, unaligned_gemm_efficiency=0.25)
    aligned = op_time(1e12, 0, dev, "bf16")
    unaligned = op_time(1e12, 0, dev, "bf16", aligned=False)
    assert unaligned - dev.kernel_overhead == pytest.approx(4 * (aligned - dev.kernel_overhead))

    def mm(n: int) -> Node:
        x, w = TensorInfo((16384, 768), torch.bfloat16), TensorInfo((768, n), torch.bfloat16)
        return Node(name="mm", kind="op", target="aten.mm.default", args=("x", "w"),
                    inputs=(x, w), outputs=(TensorInfo((16384, n), torch.bfloat16),),
                    flops=2 * 16384 * 768 * n)

    assert gemm_aligned(mm(50304)) and not gemm_aligned(mm(50257))
    assert DeviceSpec.from_dict(dev.to_dict()) == dev


def test_unaligned_efficiency_from_profile_timings():
    """planner profile's figure: the fitted aligned curve's time over the
    unaligned GEMMs' measured times (overhead removed), median; 1 if unmeasured."""
    from costmodel.profiling.build import unaligned_gemm_efficiency

    curve = {"peak_flops": 1e15, "max_efficiency": 1.0, "half_saturation_flops": 0.0}
    flops = 2 * 8192 * 1024 * 8191
    records = [{"flops": flops, "seconds": 1e-5 + k * flops / 1e15} for k in (4, 5, 8)]
    assert unaligned_gemm_efficiency(records, curve, 1e-5) == pytest.approx(1 / 5)
    assert unaligned_gemm_efficiency([], curve, 1e-5) == 1.0


def test_host_bounds_the_step_not_each_op():
    """The host queues kernels ahead of a busy GPU: no op is charged the host's
    time per op; the host's sum is a separate lower bound on the step."""
    from costmodel.compute import host_pass_counts, host_passes, host_seconds
    from models import zoo
    from ir.trace import trace

    dev = dataclasses.replace(load_cluster("dgx-h100").device, host_overhead=20e-6)
    assert op_time(0, 1e3, dev, "bf16") == pytest.approx(1e3 / dev.memory_bandwidth
                                                         / dev.memory_efficiency
                                                         + dev.kernel_overhead)
    model, inputs = zoo.build("gpt-tiny", device="meta")
    graph = trace(model, inputs)
    forward, backward = host_pass_counts(graph)
    assert forward > 0 and backward > 0 and forward + backward == host_passes(graph)
    assert host_seconds(graph, dev) == pytest.approx((forward * 20e-6, backward * 20e-6))


def test_matmul_efficiency_saturates():
    assert matmul_efficiency(1e9, 0.8, 1e9) == pytest.approx(0.4)
    effs = [matmul_efficiency(f) for f in (1e6, 1e8, 1e10, 1e12, 1e14)]
    assert effs == sorted(effs)
    assert effs[-1] == pytest.approx(costmodel.DEFAULT_FLOP_EFFICIENCY, rel=1e-4)


# --- presets --------------------------------------------------------------------

def test_preset_figures():
    h100 = load_cluster("dgx-h100")
    assert h100.device.flops("bfloat16") == 989e12
    assert h100.intra_node.bandwidth == 450e9
    assert h100.inter_node.bandwidth == 50e9
    a100 = load_cluster("dgx-a100-80g:2")
    assert (a100.num_nodes, a100.devices_per_node) == (2, 8)
    assert a100.device.flops("float16") == 312e12 and a100.device.flops("float32") == 19.5e12
    assert a100.intra_node.bandwidth == 300e9
    assert a100.inter_node.bandwidth == 25e9  # 8 x 200 Gb/s per node over 8 GPUs
    assert a100.device.memory == 80 * 10**9
    p3 = load_cluster("p3.16xlarge")
    assert p3.device.flops("float16") == 125e12 and p3.device.memory == 16 * 2**30
    assert p3.intra_node.bandwidth == 150e9
    assert p3.inter_node.bandwidth == pytest.approx(25e9 / 8 / 8)
    assert p3.device.flops("bfloat16") == 15.7e12  # no bf16 units: float32 fallback
    h200 = load_cluster("h200:3")
    assert h200.device.memory == 141 * 10**9 and h200.device.memory_bandwidth == 4.8e12
    assert h200.num_devices == 24 and h200.device.flops("bf16") == 989e12
    h800 = load_cluster("h800:256")  # DeepSeek-V3's 2048 GPUs
    assert h800.num_devices == 2048 and h800.device.flops("bf16") == 989e12
    assert h800.intra_node.bandwidth == 200e9 and h800.inter_node.bandwidth == 50e9
    for name in PRESETS:
        cl = preset(name)
        assert cl.intra_node.latency < 1e-3 and cl.backend in ("nccl", "gloo")


def test_local_cpu():
    cpu = load_cluster("local-cpu:4")
    assert (cpu.num_nodes, cpu.devices_per_node, cpu.num_devices, cpu.backend) == (1, 4, 4, "gloo")
    assert cpu.device.memory == 24 * 2**30 // 4
    assert 1e9 <= cpu.intra_node.bandwidth <= 3e9 and 30e-6 <= cpu.intra_node.latency <= 100e-6
    measured = local_cpu_cluster(2, {"peak_flops": {"float32": 12e9}, "link_bandwidth": 1.5e9, "link_latency": 70e-6})
    assert measured.device.flops("float32") == 12e9
    assert measured.intra_node == Link("loopback", 1.5e9, 70e-6)
    with pytest.raises(ClusterError, match="profile key 'flops'"):
        local_cpu_cluster(2, {"flops": 1})


def test_device_flops_fallback_and_error():
    dev = DeviceSpec("x", {"bfloat16": 1e12}, 10, 1e9)
    assert dev.flops(torch.bfloat16) == 1e12
    with pytest.raises(ClusterError, match="float32"):
        dev.flops("float16")


# --- JSON and loading --------------------------------------------------------------

def test_cluster_json_round_trip(tmp_path):
    for name in PRESETS:
        cl = preset(name, 2)
        d = cl.to_dict()
        text = json.dumps(d)
        again = Cluster.from_dict(json.loads(text))
        assert again == cl and hash(again) == hash(cl)
        assert again.to_dict() == d and json.dumps(again.to_dict()) == text  # same key order
        path = tmp_path / f"{name}.json"
        path.write_text(cl.to_json())
        assert load_cluster(str(path)) == cl
    assert list(d) == ["name", "num_nodes", "devices_per_node", "backend", "device", "intra_node", "inter_node"]


def test_cluster_is_frozen():
    cl = load_cluster("dgx-h100")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cl.num_nodes = 3  # type: ignore[misc]
    assert {cl: 1}[load_cluster("dgx-h100")] == 1


def _one_line(err: pytest.ExceptionInfo) -> str:
    msg = str(err.value)
    assert isinstance(err.value, ValueError) and "\n" not in msg and msg
    return msg


def test_load_cluster_errors(tmp_path):
    with pytest.raises(ClusterError) as e:
        load_cluster("dgx-z100")
    msg = _one_line(e)
    assert "dgx-z100" in msg and all(name in msg for name in PRESETS)
    for bad in ["dgx-h100:0", "dgx-h100:x", "dgx-h100:-2", "local-cpu:"]:
        with pytest.raises(ClusterError) as e:
            load_cluster(bad)
        assert "positive integer" in _one_line(e)
    with pytest.raises(ClusterError) as e:
        load_cluster(str(tmp_path / "nope.json"))
    assert "does not exist" in _one_line(e)
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(ClusterError) as e:
        load_cluster(str(broken))
    assert "not valid JSON" in _one_line(e)


@pytest.mark.parametrize(
    "mutate, field",
    [
        (lambda d: d.pop("backend"), "'backend' is missing"),
        (lambda d: d.__setitem__("backend", "mpi"), "'backend' must be one of"),
        (lambda d: d.__setitem__("num_nodes", 0), "'num_nodes'"),
        (lambda d: d.__setitem__("num_nodes", "2"), "'num_nodes'"),
        (lambda d: d["device"].pop("memory"), "'device.memory' is missing"),
        (lambda d: d["device"].__setitem__("memory", -5), "'device.memory'"),
        (lambda d: d["device"]["peak_flops"].__setitem__("bfloat16", "fast"), "'device.peak_flops.bfloat16'"),
        (lambda d: d["intra_node"].__setitem__("bandwidth", 0), "'intra_node.bandwidth'"),
        (lambda d: d["inter_node"].__setitem__("latency", -1e-6), "'inter_node.latency'"),
        (lambda d: d.__setitem__("intra_node", [1, 2]), "'intra_node' must be a JSON object"),
        (lambda d: d.__setitem__("gpus", 8), "'gpus' is not known"),
    ],
)
def test_cluster_from_dict_validation(tmp_path, mutate, field):
    d = json.loads(json.dumps(preset("dgx-a100-80g", 2).to_dict()))
    mutate(d)
    with pytest.raises(ClusterError) as e:
        Cluster.from_dict(d)
    assert field in _one_line(e)
    path = tmp_path / "c.json"
    path.write_text(json.dumps(d))
    with pytest.raises(ClusterError) as e:
        load_cluster(str(path))
    assert field in _one_line(e) and str(path) in str(e.value)


def test_whole_float_memory_is_accepted():
    d = preset("dgx-h100").to_dict()
    d["device"]["memory"] = 8e10
    assert Cluster.from_dict(d).device.memory == 80 * 10**9


# --- package boundaries ------------------------------------------------------------

def test_costmodel_does_not_import_planner_or_codegen():
    root = pathlib.Path(costmodel.__file__).parent
    for path in root.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for name in names:
                assert name.split(".")[0] not in ("planner", "codegen"), f"{path.name} imports {name}"


def test_link_per_collective_override_is_used_and_round_trips():
    from costmodel.cluster import Link
    from costmodel.collectives import collective_time
    from costmodel.presets import local_cpu_cluster

    link = Link("loopback", 1e9, 1e-4, (("reduce_scatter", 2e-4, 5e8),))
    n, nbytes = 4, 8e6
    assert collective_time("reduce_scatter", nbytes, n, link) == pytest.approx(
        (n - 1) / n * nbytes / 5e8 + (n - 1) * 2e-4)
    assert collective_time("all_gather", nbytes, n, link) == pytest.approx(
        (n - 1) / n * nbytes / 1e9 + (n - 1) * 1e-4)
    assert Link.from_dict(link.to_dict()) == link
    cluster = local_cpu_cluster(4, {"collective_links": {"broadcast": {"latency": 1e-5,
                                                                      "bandwidth": 3e9}}})
    assert Cluster.from_dict(cluster.to_dict()) == cluster
    assert cluster.intra_node.alpha_beta("broadcast") == (1e-5, 3e9)
    with pytest.raises(ClusterError, match="bandwidth"):
        Link.from_dict({"name": "x", "bandwidth": 1.0, "latency": 0.0,
                        "collectives": {"all_reduce": {"latency": 0.0, "bandwidth": -1}}})


def test_backward_splits_into_input_and_weight_gradients():
    from costmodel.compute import backward_op_times, op_time
    from costmodel.presets import preset

    dev = preset("dgx-a100-80g").device
    f, nbytes = 2 * 4096 ** 3, 3 * 4096 ** 2 * 2
    fwd = op_time(f, nbytes, dev, "bfloat16")
    assert backward_op_times(f, nbytes, dev, "bfloat16", input_grad=True, weight_grad=True) == (
        pytest.approx(fwd), pytest.approx(fwd))
    # the first layer's input (token embeddings' indices) needs no gradient
    assert backward_op_times(f, nbytes, dev, "bfloat16", input_grad=False, weight_grad=True)[0] == 0
    assert backward_op_times(f, nbytes, dev, "bfloat16", input_grad=True, weight_grad=False)[1] == 0


def test_axis_spanning_nodes_goes_hierarchical_where_cheaper():
    from costmodel.collectives import axis_links, collective_time
    from costmodel.presets import preset

    cluster = preset("p3.16xlarge", 2)
    (link,) = axis_links(cluster, (16,))
    intra, inter = cluster.intra_node, cluster.inter_node
    assert link.local == (intra, 8)
    nbytes = 1e9
    hier = (collective_time("reduce_scatter", nbytes, 8, intra)
            + collective_time("all_reduce", nbytes / 8, 2, inter)
            + collective_time("all_gather", nbytes, 8, intra))
    flat = collective_time("all_reduce", nbytes, 16, inter)
    assert collective_time("all_reduce", nbytes, 16, link) == pytest.approx(min(hier, flat))
    assert hier < flat / 4  # one NIC per node: the network share per GPU is tiny
    # an axis whose groups hold one device per node stays flat
    links = axis_links(cluster, (2, 8))
    assert links[0] == inter and links[1] == intra


def test_all_to_all_across_nodes_sends_node_peers_shares_over_nvlink():
    """Expert parallelism over 2 nodes of 8: 7 of a device's 15 shares stay in
    its node; its network share carries the other 8 meanwhile."""
    from costmodel.collectives import axis_links, collective_time
    from costmodel.presets import preset

    cluster = preset("h800", 2)
    (link,) = axis_links(cluster, (16,))
    intra, inter = cluster.intra_node, cluster.inter_node
    nbytes = 64e6
    in_node = collective_time("all_to_all", nbytes * 8 / 16, 8, intra)
    across = 8 / 16 * nbytes / inter.bandwidth + 8 * inter.latency
    flat = collective_time("all_to_all", nbytes, 16, inter)
    assert collective_time("all_to_all", nbytes, 16, link) == pytest.approx(max(in_node, across))
    assert across > in_node and max(in_node, across) < flat
    # all in one node: the in-node link only
    assert collective_time("all_to_all", nbytes, 8, intra) == pytest.approx(
        7 / 8 * nbytes / intra.bandwidth + 7 * intra.latency)


def test_efficiency_curve_by_problem_size():
    from costmodel.cluster import DeviceSpec
    from costmodel.compute import matmul_efficiency, op_time

    dev = DeviceSpec("x", {"float32": 1e12}, 2**30, 1e11, kernel_overhead=0.0,
                     flop_efficiency=0.8, half_saturation_flops=1e9)
    for flops in (1e7, 1e9, 1e12):
        assert op_time(flops, 0, dev, "float32") == pytest.approx(
            flops / (1e12 * matmul_efficiency(flops, 0.8, 1e9)))
    # small GEMMs are relatively slower than large ones
    assert op_time(1e7, 0, dev, "float32") / 1e7 > 50 * op_time(1e12, 0, dev, "float32") / 1e12
    assert DeviceSpec.from_dict(dev.to_dict()) == dev


def test_backward_runs_one_kernel_per_operand_of_a_contraction():
    """Unfused attention's two batched matmuls have two activation operands
    each, so two gradient kernels; a linear has one for x and one for W."""
    from costmodel.compute import backward_kernels
    from ir.trace import trace
    from models.zoo import GPTConfig, build_from_config

    model, inputs = build_from_config(GPTConfig(1, 32, 2, vocab_size=64, block_size=16,
                                                attention="unfused"), batch_size=2, seq_len=16)
    graph = trace(model, inputs)
    grad, weights = graph.gradient_path, graph.parameter_views
    kernels = {n.target: backward_kernels(n, grad, weights) for n in graph.nodes
               if n.kind == "op" and n.name in grad and not n.is_view}
    assert kernels["aten.bmm.default"] == (2, 0)
    assert kernels["aten.addmm.default"] == (1, 1)
    assert kernels["aten._softmax.default"] == (1, 0)
