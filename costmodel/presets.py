"""Cluster presets built from published hardware figures, and
:func:`load_cluster`, which turns a cluster spec (a preset, ``PRESET:NODES``
or a cluster JSON file) into a :class:`Cluster`.

Units: seconds, bytes, FLOP/s, bytes/s.

Conventions and sources (vendor datasheets):

* Peak FLOP/s are *dense* (no 2:4 sparsity).
* NVLink figures in datasheets are bidirectional totals per GPU; a link's
  ``bandwidth`` here is per direction, i.e. half of that figure.
* Inter-node bandwidth is per GPU: node NIC bandwidth / GPUs per node
  (DGX A100: 8 x 200 Gb/s HDR = 200 GB/s per node -> 25 GB/s per GPU).
* Memory uses the published decimal figure (80 GB = 80e9 bytes), slightly
  below what ``nvidia-smi`` reports, i.e. conservative; the V100 is 16 GiB.
* Latencies (alpha per message step) are assumptions consistent with NCCL's
  tuning constants and nccl-tests small-message times: NVLink/NVSwitch ~2 us,
  InfiniBand ~5 us, TCP Ethernet (p3.16xlarge has no EFA) ~25 us,
  gloo over loopback ~50 us.
* Bandwidths are link peaks; NCCL reaches ~80-90% of them for large messages.
  ``planner profile`` (later) measures real values.

``local-cpu`` describes this machine: CPU ranks (one thread each) talking
gloo over loopback. Its figures are rough defaults; ``planner profile`` will
overwrite them with measured values through :func:`local_cpu_cluster`'s
``profile`` argument.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from typing import Any, Callable, Mapping

from .cluster import Cluster, ClusterError, DeviceSpec, Link, alpha_beta_table

__all__ = [
    "PRESETS",
    "load_cluster",
    "preset",
    "local_cpu_cluster",
    "DEFAULT_LOCAL_CPU_RANKS",
    "LOCAL_CPU_TOTAL_MEMORY",
    "LOCAL_CPU_PROFILE_KEYS",
    "V100_SXM2_16GB",
    "A100_SXM4_80GB",
    "H100_SXM5_80GB",
    "H200_SXM5_141GB",
    "H800_SXM5_80GB",
]

GiB = 2**30
GB = 10**9
Gbps = 1e9 / 8  # bytes/s in one gigabit/s


def _gpu_links(nvlink_bidir: float, node_nic: float, gpus: int, net_name: str, net_latency: float) -> tuple[Link, Link]:
    """(intra, inter) links from a bidirectional NVLink total and a node's NIC total, bytes/s."""
    return (
        Link("nvlink", nvlink_bidir / 2, 2e-6),
        Link(net_name, node_nic / gpus, net_latency),
    )


# --- devices -------------------------------------------------------------

#: NVIDIA V100 SXM2 16 GB: 125 TFLOP/s fp16 tensor, 15.7 fp32, 900 GB/s HBM2.
#: No bfloat16 units (bf16 falls back to the fp32 rate).
V100_SXM2_16GB = DeviceSpec(
    name="V100-SXM2-16GB",
    peak_flops={"float32": 15.7e12, "float16": 125e12},
    memory=16 * GiB,
    memory_bandwidth=900e9,
)

#: NVIDIA A100 SXM4 80 GB: 312 TFLOP/s bf16/fp16 dense, 19.5 fp32, 156 tf32,
#: 2,039 GB/s HBM2e.
A100_SXM4_80GB = DeviceSpec(
    name="A100-SXM4-80GB",
    peak_flops={"float32": 19.5e12, "tfloat32": 156e12, "bfloat16": 312e12, "float16": 312e12},
    memory=80 * GB,
    memory_bandwidth=2.039e12,
)

#: NVIDIA H100 SXM5 80 GB: 989 TFLOP/s bf16/fp16 dense, 67 fp32, 494.5 tf32,
#: 1979 fp8, 3.35 TB/s HBM3.
H100_SXM5_80GB = DeviceSpec(
    name="H100-SXM5-80GB",
    peak_flops={
        "float32": 67e12, "tfloat32": 494.5e12, "bfloat16": 989e12, "float16": 989e12,
        "float8_e4m3fn": 1979e12,
    },
    memory=80 * GB,
    memory_bandwidth=3.35e12,
)

#: NVIDIA H200 SXM 141 GB: H100 compute with 141 GB HBM3e at 4.8 TB/s.
H200_SXM5_141GB = replace(H100_SXM5_80GB, name="H200-SXM-141GB", memory=141 * GB, memory_bandwidth=4.8e12)

#: NVIDIA H800 SXM5 80 GB (the export H100): H100 compute and memory; its NVLink
#: is cut to 400 GB/s (see the preset).
H800_SXM5_80GB = replace(H100_SXM5_80GB, name="H800-SXM5-80GB")


# --- GPU presets ---------------------------------------------------------

def _gpu_cluster(name: str, device: DeviceSpec, nvlink_bidir: float, node_nic: float,
                 net_name: str, net_latency: float) -> Callable[[int], Cluster]:
    """The preset ``name``: ``nodes`` nodes of 8 ``device`` GPUs joined by NVLink
    (``nvlink_bidir``, the bidirectional total per GPU) and, across nodes, by
    ``net_name`` NICs (``node_nic``, the total per node; ``net_latency`` s)."""
    def cluster(nodes: int) -> Cluster:
        intra, inter = _gpu_links(nvlink_bidir, node_nic, 8, net_name, net_latency)
        return Cluster(f"{name}:{nodes}", nodes, 8, device, intra, inter, "nccl")
    return cluster


# 8 V100 per node, NVLink 300 GB/s aggregate per GPU; 25 Gb/s Ethernet per node.
_p3_16xlarge = _gpu_cluster("p3.16xlarge", V100_SXM2_16GB, 300 * GB, 25 * Gbps, "ethernet",
                            25e-6)
# 8 A100, NVSwitch 600 GB/s aggregate per GPU; 8 x 200 Gb/s HDR InfiniBand per node.
_dgx_a100_80g = _gpu_cluster("dgx-a100-80g", A100_SXM4_80GB, 600 * GB, 8 * 200 * Gbps,
                             "infiniband", 5e-6)
# 8 H100, NVLink4 900 GB/s aggregate per GPU; 8 x 400 Gb/s NDR InfiniBand per node.
_dgx_h100 = _gpu_cluster("dgx-h100", H100_SXM5_80GB, 900 * GB, 8 * 400 * Gbps, "infiniband",
                         5e-6)
# As DGX H100 (same NVLink and NICs) with H200 memory.
_h200 = _gpu_cluster("h200", H200_SXM5_141GB, 900 * GB, 8 * 400 * Gbps, "infiniband", 5e-6)
# 8 H800, NVLink 400 GB/s aggregate per GPU; 8 x 400 Gb/s NDR InfiniBand per node
# (the cluster DeepSeek-V3 was trained on: 2048 GPUs = h800:256).
_h800 = _gpu_cluster("h800", H800_SXM5_80GB, 400 * GB, 8 * 400 * Gbps, "infiniband", 5e-6)


# --- this machine ----------------------------------------------------------

#: Ranks ``local-cpu`` gets when no count is given.
DEFAULT_LOCAL_CPU_RANKS = 4
#: Memory the local-cpu ranks share, bytes (this machine has ~24 GiB).
LOCAL_CPU_TOTAL_MEMORY = 24 * GiB

# Defaults for one single-threaded CPU rank (replaced by `planner profile`):
_LOCAL_CPU_DEFAULTS: dict[str, Any] = {
    "peak_flops": {"float32": 30e9},  # FLOP/s: one core, AVX2 FMA sgemm, realistic
    "memory_bandwidth": 10e9,         # bytes/s: one core's share of DRAM bandwidth
    "kernel_overhead": 2e-6,          # seconds: eager ATen op dispatch on CPU
    "flop_efficiency": 1.0,           # peak_flops is already an achieved figure
    "memory_efficiency": 1.0,
    "link_bandwidth": 2e9,            # bytes/s: gloo over loopback TCP, per direction
    "link_latency": 50e-6,            # seconds: gloo message round on loopback
    "dispatch_overhead": 150e-6,      # seconds: DTensor dispatch per op (fwd, and again in bwd)
}

#: Keys ``local_cpu_cluster(profile=...)`` accepts (all optional).
LOCAL_CPU_PROFILE_KEYS = (
    "peak_flops", "memory", "memory_bandwidth", "kernel_overhead",
    "flop_efficiency", "memory_efficiency", "link_bandwidth", "link_latency",
    "collective_links", "redistribute_links", "half_saturation_flops", "dispatch_overhead", "attention_efficiency",
    "attention_half_saturation_flops", "compiled_call_overhead", "compiled_param_overhead",
    "fsdp_call_overhead", "fused_element_rate",
)


def local_cpu_cluster(ranks: int = DEFAULT_LOCAL_CPU_RANKS, profile: Mapping[str, Any] | None = None) -> Cluster:
    """``ranks`` CPU ranks on this machine, one node, gloo over loopback.

    Args:
        ranks: number of processes (devices), >= 1.
        profile: measured values overriding the defaults, keys from
            ``LOCAL_CPU_PROFILE_KEYS``: ``peak_flops`` (dtype -> FLOP/s, merged
            into the defaults), ``memory`` (bytes per rank; default
            ``LOCAL_CPU_TOTAL_MEMORY // ranks``), ``memory_bandwidth`` (bytes/s),
            ``kernel_overhead`` and ``dispatch_overhead`` (s), ``flop_efficiency`` and
            ``memory_efficiency`` (fractions), ``link_bandwidth`` (bytes/s per
            direction), ``link_latency`` (s) and ``collective_links`` (collective
            kind -> {"latency": s, "bandwidth": bytes/s}, measured exceptions to the
            single link), ``redistribute_links`` (the same, through DTensor's
            redistribute: :attr:`Link.per_redistribute`), ``compiled_call_overhead``,
            ``compiled_param_overhead`` and ``fsdp_call_overhead`` (s,
            :class:`DeviceSpec`), ``fused_element_rate`` (elements/s).
            ``planner profile`` fills it.
    """
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise ClusterError(f"local-cpu ranks must be an integer >= 1, got {ranks!r}")
    profile = dict(profile or {})
    unknown = sorted(set(profile) - set(LOCAL_CPU_PROFILE_KEYS))
    if unknown:
        raise ClusterError(
            f"local-cpu profile key '{unknown[0]}' is not known; allowed: {', '.join(LOCAL_CPU_PROFILE_KEYS)}"
        )
    values = {**_LOCAL_CPU_DEFAULTS, "memory": LOCAL_CPU_TOTAL_MEMORY // ranks, **profile}
    peak = dict(_LOCAL_CPU_DEFAULTS["peak_flops"])
    if "peak_flops" in profile:
        if not isinstance(profile["peak_flops"], Mapping):
            raise ClusterError("local-cpu profile key 'peak_flops' must map dtype names to FLOP/s")
        peak.update(profile["peak_flops"])
    device = DeviceSpec(
        name="cpu",
        peak_flops=peak,
        memory=values["memory"],
        memory_bandwidth=values["memory_bandwidth"],
        kernel_overhead=values["kernel_overhead"],
        flop_efficiency=values["flop_efficiency"],
        memory_efficiency=values["memory_efficiency"],
        half_saturation_flops=values.get("half_saturation_flops", 0.0),
        dispatch_overhead=values["dispatch_overhead"],
        attention_efficiency=values.get("attention_efficiency", 0.0),
        attention_half_saturation_flops=values.get("attention_half_saturation_flops", 0.0),
        compiled_call_overhead=values.get("compiled_call_overhead", 0.0),
        compiled_param_overhead=values.get("compiled_param_overhead", 0.0),
        fsdp_call_overhead=values.get("fsdp_call_overhead", 0.0),
        fused_element_rate=values.get("fused_element_rate", 0.0),
    )
    loopback = Link("loopback", values["link_bandwidth"], values["link_latency"],
                    alpha_beta_table(values.get("collective_links", {}), "collective_links"),
                    alpha_beta_table(values.get("redistribute_links", {}), "redistribute_links"))
    return Cluster(f"local-cpu:{ranks}", 1, ranks, device, loopback, loopback, "gloo")


#: Preset name -> builder taking the count after ':' (nodes; ranks for local-cpu).
PRESETS: dict[str, Callable[[int], Cluster]] = {
    "p3.16xlarge": _p3_16xlarge,
    "dgx-a100-80g": _dgx_a100_80g,
    "dgx-h100": _dgx_h100,
    "h200": _h200,
    "h800": _h800,
    "local-cpu": local_cpu_cluster,
}


def preset(name: str, count: int | None = None) -> Cluster:
    """Preset ``name`` with ``count`` nodes (ranks for ``local-cpu``).

    ``count`` defaults to 1 node, or ``DEFAULT_LOCAL_CPU_RANKS`` for local-cpu.
    """
    if name not in PRESETS:
        raise ClusterError(f"unknown cluster preset '{name}'; presets: {', '.join(PRESETS)}")
    if count is None:
        count = DEFAULT_LOCAL_CPU_RANKS if name == "local-cpu" else 1
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ClusterError(f"cluster preset '{name}' needs a positive integer count, got {count!r}")
    return PRESETS[name](count)


def _parse_count(spec: str, text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1 or str(n) != text.strip():
        raise ClusterError(f"cluster spec '{spec}': '{text}' after ':' must be a positive integer (nodes, or ranks for local-cpu)")
    return n


def load_cluster(spec: str) -> Cluster:
    """A cluster from ``PRESET``, ``PRESET:N`` or a JSON cluster file path.

    ``PRESET:N`` means N nodes (``dgx-a100-80g:2`` = 16 GPUs), except for
    ``local-cpu:N``, which is N CPU ranks on this machine. A path (anything
    that exists, ends in ``.json`` or contains a path separator) is read as
    :meth:`Cluster.to_dict` JSON. Every failure is a :class:`ClusterError`.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ClusterError(f"cluster spec must be a preset name or a JSON file path, got {spec!r}; presets: {', '.join(PRESETS)}")
    spec = spec.strip()
    looks_like_path = spec.endswith(".json") or os.sep in spec or (os.altsep is not None and os.altsep in spec)
    if os.path.isfile(spec) or looks_like_path:
        if not os.path.isfile(spec):
            raise ClusterError(f"cluster file '{spec}' does not exist; give an existing JSON file or a preset ({', '.join(PRESETS)})")
        try:
            with open(spec, encoding="utf-8") as f:
                data = json.load(f)
        except json.JSONDecodeError as e:
            raise ClusterError(f"cluster file '{spec}' is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
        except OSError as e:
            raise ClusterError(f"cluster file '{spec}' cannot be read: {e.strerror}") from None
        try:
            return Cluster.from_dict(data)
        except ClusterError as e:
            raise ClusterError(f"cluster file '{spec}': {e}") from None
    name, sep, count = spec.partition(":")
    if name not in PRESETS:
        raise ClusterError(f"unknown cluster preset '{name}'; presets: {', '.join(PRESETS)} (or give a JSON cluster file)")
    if sep:
        return preset(name, _parse_count(spec, count))
    return preset(name)
