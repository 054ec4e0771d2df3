"""From ``planner profile``'s raw measurements to a cluster and a profile dict.

Units: seconds, bytes, FLOPs, bytes/s, FLOP/s. No I/O and no processes: the
raw measurements come from :func:`costmodel.profiling.run.measure`, the dict
goes to :func:`costmodel.profiling.file.write_profile`.

The cluster gets one link fitted to all collectives together (a
:class:`Cluster` has one link per level) and, on CPU, a link per collective as
its exceptions; the device gets the GEMM fit's asymptotic rate as
``peak_flops`` with ``flop_efficiency = 1.0`` (an achieved figure) and its
half-saturation FLOPs.
"""

from __future__ import annotations

import os
import statistics
import time
import dataclasses
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from costmodel.cluster import Cluster, DeviceSpec, Link, alpha_beta_table, canonical_dtype
from costmodel.compute import matmul_efficiency
from costmodel.presets import local_cpu_cluster
from costmodel.profiling.compiled_call import fit_call_overheads
from costmodel.profiling.file import PROFILE_FORMAT_VERSION
from costmodel.profiling.fit import attention_fit, fit_alpha_beta, fit_gemm
from costmodel.profiling.machine import device_memory_per_rank, machine_info
from costmodel.profiling.memory_probe import chain_efficiency, fused_element_rate
from costmodel.profiling.runtime_costs import (pipeline_action_overhead, runtime_pipeline_action,
                                               split_backward_group_overhead, timed_pair)
from costmodel.profiling.worker import COLLECTIVE_KINDS

__all__ = ["build_profile", "compiled_call_overheads", "dispatch_overhead", "fsdp_call_overhead",
           "host_overhead", "pipeline_actions", "unaligned_gemm_efficiency"]


@dataclass(frozen=True)
class _DeviceFits:
    """What the compute measurements give one rank's device."""

    dtype: str                      # the dtype the GEMM curve was fitted in
    overhead: float                 # seconds per eager op (kernel_overhead)
    memory_bandwidth: float         # bytes/s, copy (read + write)
    gemm: dict[str, Any]            # fit_gemm's result, plus "dtype"
    peak_flops: dict[str, float]    # dtype -> FLOP/s
    attention: dict[str, float]     # attention_fit's result, {} when not measured
    compiled_calls: dict[str, float]  # compiled_call_overheads' result, {} when not measured
    memory_efficiency: float | None  # the memory-bound chain's share of the copy's bandwidth
    fused_element_rate: float | None  # elements/s of the compiled chain's kernels (CPU ranks)


@dataclass(frozen=True)
class _LinkFits:
    """What the collective measurements give the cluster's link."""

    link: dict[str, Any] | None               # fit_alpha_beta over every collective; None under 2 timings
    per_kind: dict[str, dict[str, Any]]       # collective kind -> its own fit_alpha_beta
    redistribute: dict[str, dict[str, Any]]   # the same through DTensor's redistribute


def host_overhead(raw: Mapping[str, Any]) -> float | None:
    """Host seconds eager PyTorch spends on one op and pass (module calls,
    dispatch, autograd bookkeeping, the launch), from the ``host``
    measurement: a training step of a zoo model too small for the device to
    matter, over the op passes the cost model charges in it
    (``costmodel.compute.host_passes``); None when it was not measured."""
    h = raw.get("host")
    if not h or "seconds" not in h or not h.get("passes"):
        return None
    return h["seconds"] / h["passes"]


def unaligned_gemm_efficiency(records: Sequence[Mapping[str, Any]], gemm: Mapping[str, Any],
                              overhead: float) -> float:
    """Median, over GEMMs with a row not aligned to 16 bytes, of the time the
    fitted (aligned) curve gives their FLOPs over the time they took, kernel
    overhead removed from both: ``DeviceSpec.unaligned_gemm_efficiency``,
    within (0, 1]; 1 when none was measured."""
    ratios = []
    for g in records:
        eff = matmul_efficiency(g["flops"], gemm["max_efficiency"], gemm["half_saturation_flops"]) \
            if gemm["half_saturation_flops"] > 0 else gemm["max_efficiency"]
        curve = g["flops"] / (gemm["peak_flops"] * eff)
        ratios.append(curve / max(g["seconds"] - overhead, 1e-12))
    if not ratios:
        return 1.0
    return min(1.0, max(1e-3, statistics.median(ratios)))


def dispatch_overhead(raw: Mapping[str, Any]) -> float | None:
    """Seconds the distributed runtime adds per op and pass (forward or
    backward): from the ``runtime`` measurement where it was made (the
    planner's own runtime against the plain step of the same model, over the
    step's :func:`costmodel.compute.dispatch_passes`:
    :mod:`codegen.runtime_probe`), else from ``dispatch`` (DTensor alone, on a
    chain of tiny ops); None when neither was measured."""
    run = timed_pair(raw, "runtime", "plain", "runtime")
    if run is not None:
        record, plain_s, runtime_s = run
        return max(0.0, (runtime_s - plain_s) / record["passes"])
    d = timed_pair(raw, "dispatch", "plain", "dtensor")
    if d is None:
        return None
    record, plain_s, dtensor_s = d
    return max(0.0, (dtensor_s - plain_s) / (2 * record["ops"]))


def fsdp_call_overhead(raw: Mapping[str, Any]) -> float | None:
    """Seconds one FSDP2 unit's collective call costs beyond its bytes, from
    the ``fsdp_unit`` measurement (:mod:`costmodel.profiling.runtime_costs`):
    the sharded step's extra seconds over its units' calls; None when it was
    not measured."""
    f = timed_pair(raw, "fsdp_unit", "plain", "sharded")
    if f is None:
        return None
    record, plain_s, sharded_s = f
    return max(0.0, (sharded_s - plain_s) / (record["units"] * record["calls_per_unit"]))


def pipeline_actions(raw: Mapping[str, Any], link: Link) -> dict[str, float | None]:
    """``DeviceSpec.pipeline_action_overhead`` and
    ``compiled_pipeline_action_overhead``: fitted on the planner's own pipeline
    where it was timed (:mod:`codegen.pipeline_probe`), the eager one else on
    torch's schedule around a linear layer; ``split_backward_group_overhead``
    (:func:`split_backward_group_overhead`); None where not measured."""
    eager = runtime_pipeline_action(raw, link, "eager")
    return {"pipeline_action_overhead": pipeline_action_overhead(raw, link) if eager is None else eager,
            "compiled_pipeline_action_overhead": runtime_pipeline_action(raw, link, "compiled"),
            "split_backward_group_overhead": split_backward_group_overhead(raw)}


def compiled_call_overheads(raw: Mapping[str, Any]) -> dict[str, float]:
    """``DeviceSpec.compiled_call_overhead`` and ``compiled_param_overhead``
    fitted to the ``compiled_call`` measurement; empty when it was not made."""
    fit = fit_call_overheads(raw.get("compiled_call") or ())
    if fit is None:
        return {}
    return {"compiled_call_overhead": fit[0], "compiled_param_overhead": fit[1]}


def _fit_device(raw: Mapping[str, Any], device: str) -> _DeviceFits:
    """Kernel overhead, memory bandwidth (of the largest copy), the GEMM curve in
    the device's main dtype (fp32 on CPU, bf16 on GPU), the achieved rate of
    any other GEMM dtype, the attention curve and a compiled region's call."""
    overhead = float(raw["overhead"]["seconds"])
    mem = max(raw["memory"], key=lambda r: r["bytes"])
    main_dtype = "bfloat16" if device == "cuda" else "float32"
    aligned = [g for g in raw["gemms"] if not g.get("unaligned")]
    gemm = fit_gemm([(g["flops"], g["seconds"]) for g in aligned if g["dtype"] == main_dtype], overhead)
    gemm["dtype"] = main_dtype
    peak = {main_dtype: gemm["peak_flops"]}
    for g in aligned:
        if g["dtype"] != main_dtype:  # single extra sizes: achieved rate, overhead removed
            peak[canonical_dtype(g["dtype"])] = g["flops"] / max(g["seconds"] - overhead, 1e-12)
    gemm["unaligned_efficiency"] = unaligned_gemm_efficiency(
        [g for g in raw["gemms"] if g.get("unaligned") and g["dtype"] == main_dtype], gemm, overhead)
    attention = attention_fit(raw.get("attention", ()), overhead, peak[main_dtype]) or {}
    bandwidth = mem["bytes"] / mem["seconds"]
    return _DeviceFits(main_dtype, overhead, bandwidth, gemm, peak, attention,
                       compiled_call_overheads(raw),
                       chain_efficiency(raw.get("memory_chain") or {}, bandwidth, overhead),
                       fused_element_rate(raw.get("fused_chain") or {}, overhead))


def _collective_samples(records: Iterable[Mapping[str, Any]]) -> list[tuple[str, float, int, float]]:
    """``(kind, nbytes, group_size, seconds)`` of measured collectives, as
    :func:`costmodel.profiling.fit.fit_alpha_beta` takes them."""
    return [(c["kind"], c["nbytes"], c["group_size"], c["seconds"]) for c in records]


def _fit_per_kind(records: list[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Collective kind -> its fit_alpha_beta, for each kind with >= 2 timings."""
    per_kind: dict[str, dict[str, Any]] = {}
    for kind in COLLECTIVE_KINDS:
        samples = _collective_samples(c for c in records if c["kind"] == kind)
        if len(samples) >= 2:
            per_kind[kind] = fit_alpha_beta(samples)
    return per_kind


def redistribute_records(raw: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The redistribute timings, each less the compute burst it followed
    (``redistribute_burst``; none when measured alone), at least a microsecond."""
    burst = (raw.get("redistribute_burst") or {}).get("seconds", 0.0)
    return [{**rec, "seconds": max(1e-6, rec["seconds"] - burst)}
            for rec in raw.get("redistribute", ()) if "seconds" in rec]


def _fit_links(collectives: list[Mapping[str, Any]],
               redistribute: list[Mapping[str, Any]]) -> _LinkFits:
    """One link over every collective timing, one per collective kind, and
    one per kind of the redistribute timings."""
    link = fit_alpha_beta(_collective_samples(collectives)) if len(collectives) >= 2 else None
    return _LinkFits(link, _fit_per_kind(collectives), _fit_per_kind(redistribute))


def _alpha_beta_fits(per_kind: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, float]]:
    """A cluster file's ``{kind: {"latency", "bandwidth"}}`` of per-kind fits."""
    return {k: {"latency": f["latency"], "bandwidth": f["bandwidth"]} for k, f in per_kind.items()}


def _cpu_cluster(ranks: int, device: _DeviceFits, links: _LinkFits, raw: Mapping[str, Any],
                 memory_per_rank: int | None) -> Cluster:
    """``local-cpu:<ranks>`` with the measured figures overriding the preset's."""
    values: dict[str, Any] = {
        "peak_flops": device.peak_flops, "memory_bandwidth": device.memory_bandwidth,
        "kernel_overhead": device.overhead,
        "flop_efficiency": 1.0, "memory_efficiency": device.memory_efficiency or 1.0,
        "half_saturation_flops": device.gemm["half_saturation_flops"],
        **device.attention,
    }
    if memory_per_rank:
        values["memory"] = memory_per_rank
    dispatch = dispatch_overhead(raw)
    if dispatch is not None:
        values["dispatch_overhead"] = dispatch
    values.update(device.compiled_calls)
    values["fsdp_call_overhead"] = fsdp_call_overhead(raw) or 0.0
    if device.fused_element_rate:
        values["fused_element_rate"] = device.fused_element_rate
    if links.link is not None:
        values["link_bandwidth"] = links.link["bandwidth"]
        values["link_latency"] = links.link["latency"]
    if links.per_kind:
        values["collective_links"] = _alpha_beta_fits(links.per_kind)
    if links.redistribute:
        values["redistribute_links"] = _alpha_beta_fits(links.redistribute)
    return local_cpu_cluster(ranks, profile=values)


def _gpu_cluster(ranks: int, device: _DeviceFits, links: _LinkFits, raw: Mapping[str, Any],
                 memory_per_rank: int | None) -> Cluster:
    """``local-gpu:<ranks>``: one node of GPU 0's kind, NCCL over the fitted link."""
    import torch

    dev = DeviceSpec(name=torch.cuda.get_device_name(0), peak_flops=device.peak_flops,
                     memory=memory_per_rank or 1,
                     memory_bandwidth=device.memory_bandwidth, kernel_overhead=device.overhead,
                     flop_efficiency=1.0, memory_efficiency=device.memory_efficiency or 1.0,
                     half_saturation_flops=device.gemm["half_saturation_flops"],
                     attention_efficiency=device.attention.get("attention_efficiency", 0.0),
                     attention_half_saturation_flops=device.attention.get(
                         "attention_half_saturation_flops", 0.0),
                     host_overhead=host_overhead(raw) or 0.0,
                     unaligned_gemm_efficiency=device.gemm["unaligned_efficiency"],
                     fsdp_call_overhead=fsdp_call_overhead(raw) or 0.0,
                     **device.compiled_calls)
    # With one GPU no collective runs: keep an NVLink-like placeholder (noted in the profile).
    fit = links.link
    redistribute = alpha_beta_table(_alpha_beta_fits(links.redistribute))
    link = (Link("nvlink", fit["bandwidth"], fit["latency"], per_redistribute=redistribute) if fit
            else Link("nvlink", 150e9, 2e-6))
    return Cluster(f"local-gpu:{ranks}", 1, ranks, dev, link, link, "nccl")


def _notes(raw: Mapping[str, Any], spec: Mapping[str, Any], ranks: int, device: _DeviceFits,
           links: _LinkFits) -> list[str]:
    """The profile's ``notes``: how the figures were measured and what they leave out."""
    notes = [
        f"all {ranks} ranks measured at once, each with {spec.get('threads', 1)} thread(s): per-rank figures "
        f"include the sharing of {os.cpu_count()} CPU cores (and any other load on the machine)"
        if spec["device"] == "cpu" else f"{ranks} GPU rank(s), {device.dtype} GEMMs, NCCL collectives",
        "peak_flops is the fitted asymptotic achieved rate, so flop_efficiency = 1.0; small-GEMM "
        "inefficiency is device.half_saturation_flops (costmodel.compute.matmul_efficiency)",
        "the cluster link is fits.link (one alpha-beta fitted to every collective and group size) "
        "with fits.collectives (one per collective) as its per-collective exceptions, and "
        "fits.redistribute (the same kinds through DTensor's redistribute) as the reshards' own",
    ]
    if links.link is None:
        notes.append("no collective measured (1 rank): the link keeps its default")
    for kind, why in raw["unsupported"].items():
        notes.append(f"{kind} not supported by {spec['backend']}: {why}")
    eager = (raw.get("runtime_pipeline") or {}).get("compiled", {}).get("eager_regions")
    if eager:
        notes.append(f"compiled_pipeline_action_overhead not fitted: the probe's {'; '.join(eager)}")
    return notes


def build_profile(raw: Mapping[str, Any], spec: Mapping[str, Any], ranks: int, *, quick: bool = False,
                  wall_s: float = 0.0) -> tuple[Cluster, dict[str, Any]]:
    """Fit measurements and build ``(cluster, profile dict)``; no I/O, no processes.

    ``raw`` is :func:`costmodel.profiling.run.measure`'s result for ``spec``
    (keys ``overhead``, ``memory``, ``gemms``, ``collectives``,
    ``unsupported``); ``wall_s`` is the seconds profiling took.
    """
    device = _fit_device(raw, spec["device"])
    links = _fit_links(raw["collectives"], redistribute_records(raw))
    build_cluster = _cpu_cluster if spec["device"] == "cpu" else _gpu_cluster
    cluster = build_cluster(ranks, device, links, raw, device_memory_per_rank(spec["device"], ranks))
    actions = pipeline_actions(raw, cluster.intra_node)
    if any(actions.values()):
        cluster = dataclasses.replace(cluster, device=dataclasses.replace(
            cluster.device, **{k: v for k, v in actions.items() if v}))
    profile = {
        "format": "planner-profile",
        "version": PROFILE_FORMAT_VERSION,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine_info(),
        "ranks": ranks,
        "device": spec["device"],
        "backend": spec["backend"],
        "quick": quick,
        "wall_s": wall_s,
        "cluster": cluster.to_dict(),
        "fits": {
            "kernel_overhead": device.overhead,
            "dispatch_overhead": dispatch_overhead(raw),
            "dispatch_measured_on": "the planner's runtime" if raw.get("runtime") else "DTensor",
            "fsdp_call_overhead": fsdp_call_overhead(raw),
            **actions,
            "pipeline_action_measured_on": ("the planner's runtime" if raw.get("runtime_pipeline")
                                            else "torch's schedule"),
            **device.compiled_calls,
            "memory_bandwidth": device.memory_bandwidth,
            "memory_chain_efficiency": device.memory_efficiency,
            "fused_element_rate": device.fused_element_rate,
            "gemm": device.gemm,
            "link": links.link,
            "collectives": links.per_kind,
            "redistribute": links.redistribute,
        },
        "unsupported": dict(raw["unsupported"]),
        "notes": _notes(raw, spec, ranks, device, links),
        "spec": {k: v for k, v in spec.items() if k not in ("init_method", "result_path")},
        "measurements": {k: raw[k] for k in ("overhead", "memory", "gemms", "collectives",
                                             "redistribute", "redistribute_burst",
                                             "compiled_call", "dispatch", "runtime", "fsdp_unit",
                                             "pipeline", "runtime_pipeline", "split_backward",
                                             "memory_chain", "fused_chain")
                         if k in raw},
    }
    return cluster, profile
