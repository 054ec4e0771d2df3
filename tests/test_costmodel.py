"""Cost model tests against closed forms and published figures: memory, compute
and the cluster specs."""

from __future__ import annotations

import ast
import dataclasses
import json
import pathlib

import pytest
import torch

import costmodel
from costmodel import (
    PRESETS,
    Cluster,
    ClusterError,
    DeviceSpec,
    Link,
    axis_links,
    gpt_activation_bytes_per_layer,
    load_cluster,
    local_cpu_cluster,
    matmul_efficiency,
    op_time,
    preset,
    reserve_bytes,
    training_state_bytes,
)


# --- clusters -----------------------------------------------------------------

def test_sub_cluster():
    cl = load_cluster("dgx-a100-80g:4")
    sub = cl.sub_cluster(1, 4)
    assert sub.num_devices == 4 and axis_links(sub, (4,)) == [cl.intra_node]
    with pytest.raises(ClusterError):
        cl.sub_cluster(5, 8)


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
