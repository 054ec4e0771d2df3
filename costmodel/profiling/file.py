"""Reading, writing and summarising a ``planner profile`` result.

Two files: the cluster JSON at ``out_path`` (``Cluster.to_dict()``, loadable
by ``load_cluster``) and, next to it, ``<stem>.profile.json`` with the
cluster, the fits and every raw measurement (see :func:`profile_path`).
Units in both: seconds, bytes, FLOPs, bytes/s, FLOP/s.
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping

from costmodel.cluster import Cluster
from costmodel.profiling.spec import ProfileError

__all__ = ["PROFILE_FORMAT_VERSION", "load_profile", "profile_path", "summary_rows", "write_profile"]

#: Version of the ``*.profile.json`` layout.
PROFILE_FORMAT_VERSION = 1


def profile_path(out_path: str | os.PathLike) -> str:
    """The profile JSON next to cluster JSON ``out_path``: ``x.json`` -> ``x.profile.json``."""
    out = os.fspath(out_path)
    stem = out[:-5] if out.endswith(".json") else out
    return stem + ".profile.json"


def load_profile(path: str | os.PathLike) -> dict[str, Any]:
    """Read a ``*.profile.json`` (or the cluster JSON it sits next to)."""
    path = os.fspath(path)
    if not path.endswith(".profile.json") and os.path.isfile(profile_path(path)):
        path = profile_path(path)
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict) or data.get("format") != "planner-profile":
        raise ProfileError(f"'{path}' is not a planner profile (no \"format\": \"planner-profile\")")
    if data.get("version") != PROFILE_FORMAT_VERSION:
        raise ProfileError(f"'{path}' is profile version {data.get('version')}, this code reads {PROFILE_FORMAT_VERSION}")
    return data


def write_profile(cluster: Cluster, profile: dict[str, Any], out_path: str | os.PathLike) -> None:
    """Write the cluster JSON to ``out_path`` and the profile next to it (:func:`profile_path`)."""
    out_path = os.fspath(out_path)
    profile["cluster_path"] = out_path
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    with open(out_path, "w", encoding="utf-8") as f:
        f.write(cluster.to_json() + "\n")
    with open(profile_path(out_path), "w", encoding="utf-8") as f:
        json.dump(profile, f, indent=2)
        f.write("\n")


def _link_text(fit: Mapping[str, Any]) -> str:
    """``"<latency> us, <bandwidth> GB/s"`` of one fitted link (or ``latency-bound``)."""
    bw = "latency-bound" if fit.get("bandwidth_bound") else f"{fit['bandwidth'] / 1e9:.2f} GB/s"
    return f"{fit['latency'] * 1e6:.1f} us, {bw}"


def summary_rows(profile: Mapping[str, Any]) -> list[tuple[str, str, str]]:
    """``(what, value, detail)`` rows summarising a profile dict (for the CLI table)."""
    fits = profile["fits"]
    gemm = fits["gemm"]
    action_on = fits.get("pipeline_action_measured_on", "torch's schedule")
    rows = [
        (f"GEMM {gemm['dtype']} peak", f"{gemm['peak_flops'] / 1e9:.1f} GFLOP/s",
         f"per rank; half-saturation {gemm['half_saturation_flops']:.3g} FLOPs, "
         f"fit median err {gemm['median_abs_pct_error']:.1f}%"),
        *([("unaligned GEMM", f"{gemm['unaligned_efficiency']:.2f} x",
            "a row not a multiple of 16 bytes, against the aligned curve")]
          if gemm.get("unaligned_efficiency", 1.0) < 1.0 else []),
        ("memory bandwidth", f"{fits['memory_bandwidth'] / 1e9:.2f} GB/s", "per rank, copy (read + write)"),
        *([("memory-bound kernels", f"{fits['memory_chain_efficiency']:.2f} x",
            "a layer norm, GELU and add against the copy's bandwidth")]
          if fits.get("memory_chain_efficiency") else []),
        *([("fused kernels", f"{fits['fused_element_rate'] / 1e9:.2f} G elements/s",
            "the same chain compiled, per element each op makes")]
          if fits.get("fused_element_rate") else []),
        ("kernel overhead", f"{fits['kernel_overhead'] * 1e6:.2f} us", "per eager op"),
        *([("dispatch overhead", f"{fits['dispatch_overhead'] * 1e6:.1f} us",
            f"{fits.get('dispatch_measured_on', 'DTensor')}, per op and pass")]
          if fits.get("dispatch_overhead") is not None else []),
        *([("compiled call", f"{fits['compiled_call_overhead'] * 1e6:.1f} us",
            f"per region call (forward and backward), and "
            f"{fits['compiled_param_overhead'] * 1e6:.1f} us per parameter")]
          if "compiled_call_overhead" in fits else []),
        *([("FSDP2 unit call", f"{fits['fsdp_call_overhead'] * 1e6:.1f} us",
            "per collective call of a unit, beyond its bytes")]
          if fits.get("fsdp_call_overhead") is not None else []),
        *([("pipeline action", f"{fits['pipeline_action_overhead'] * 1e6:.1f} us",
            f"{action_on}, per forward or backward of a stage, beyond the stage's own work")]
          if fits.get("pipeline_action_overhead") is not None else []),
        *([("compiled pipeline action", f"{fits['compiled_pipeline_action_overhead'] * 1e6:.1f} us",
            "the same, the stages compiled")]
          if fits.get("compiled_pipeline_action_overhead") is not None else []),
        *([("split backward", f"{fits['split_backward_group_overhead'] * 1e6:.1f} us",
            "per parameter group of an eager stage, zero-bubble schedules")]
          if fits.get("split_backward_group_overhead") is not None else []),
    ]
    link = fits.get("link")
    if link:
        rows.append(("link (cluster)", _link_text(link),
                     f"latency, bandwidth; all collectives, fit median err {link['median_abs_pct_error']:.1f}%"))
    for kind, fit in fits.get("collectives", {}).items():
        rows.append((kind, _link_text(fit), f"fit median err {fit['median_abs_pct_error']:.1f}%"))
    for kind, fit in fits.get("redistribute", {}).items():
        rows.append((f"{kind} (redistribute)", _link_text(fit),
                     f"through DTensor; fit median err {fit['median_abs_pct_error']:.1f}%"))
    for kind in profile.get("unsupported", {}):
        rows.append((kind, "skipped", f"not supported by {profile['backend']}"))
    return rows
