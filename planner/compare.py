"""``planner compare``: the automatic plan against every Megatron configuration.

All plans are priced by the same cost model. Throughput figures per plan:
tokens/s = tokens of the step / predicted step time; model FLOP/s per device =
3 x forward FLOPs (forward + backward) / step time / devices; MFU = that / the
device's peak FLOP/s for the model's dtype.
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from costmodel.cluster import Cluster, load_cluster
from ir.source import build_model
from ir.trace import trace
from planner.api import PlanningError, plan
from planner.megatron import megatron_configs, megatron_plan
from planner.plan_format import Plan
from planner.report import format_bytes


@dataclass
class Entry:
    """One compared plan (``plan`` is None when the configuration is impossible)."""

    name: str
    config: str
    plan: Plan | None
    error: str | None = None


def _metrics(p: Plan, cluster: Cluster, forward_flops: float, tokens: int) -> dict[str, float]:
    step = p.predicted["step_time_s"]
    per_device = 3.0 * forward_flops / step / cluster.num_devices
    peak = cluster.device.flops(p.training.get("dtype", "float32"))
    return {"step_time_s": step, "tokens_per_s": tokens / step,
            "model_tflops_per_device": per_device / 1e12, "mfu": per_device / peak,
            "memory_bytes_per_device": p.predicted["memory_bytes_per_device"]["total"]}


def compare(model_spec: str, cluster_spec: str, *, zoo_kwargs: dict[str, Any] | None = None,
            time_limit_s: float = 60.0) -> dict[str, Any]:
    """Plan ``model_spec`` automatically and with every Megatron configuration.

    Returns a JSON-ready dict: model, cluster, and ``plans`` sorted fastest first
    (each with its metrics and configuration, or the reason it is impossible).
    """
    zoo_kwargs = zoo_kwargs or {}
    cluster = load_cluster(cluster_spec)
    model, inputs = build_model(model_spec, device="meta", **zoo_kwargs)
    graph = trace(model, inputs)
    tokens = int(inputs[0].numel()) if isinstance(inputs[0], torch.Tensor) else 0
    entries: list[Entry] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            auto = plan(model, cluster, example_inputs=inputs, model_source=model_spec,
                        time_limit_s=time_limit_s, zoo_kwargs=zoo_kwargs)
            entries.append(Entry("auto", f"mesh {'x'.join(map(str, auto.mesh_shape))}", auto))
        except PlanningError as err:
            entries.append(Entry("auto", "-", None, str(err)))
        for cfg in megatron_configs(cluster):
            try:
                p = megatron_plan(model, cluster, cfg, example_inputs=inputs,
                                  model_source=model_spec, zoo_kwargs=zoo_kwargs,
                                  time_limit_s=time_limit_s, graph=graph)
                entries.append(Entry("megatron", cfg.label(), p))
            except PlanningError as err:
                entries.append(Entry("megatron", cfg.label(), None, str(err)))
    rows = []
    for e in entries:
        row: dict[str, Any] = {"name": e.name, "config": e.config}
        if e.plan is None:
            row["error"] = e.error
        else:
            row.update(_metrics(e.plan, cluster, graph.forward_flops, tokens))
        rows.append(row)
    rows.sort(key=lambda r: (r.get("step_time_s", float("inf")), r["config"]))
    feasible = [r for r in rows if "step_time_s" in r]
    best_manual = next((r for r in feasible if r["name"] == "megatron"), None)
    auto_row = next((r for r in feasible if r["name"] == "auto"), None)
    speedup = (best_manual["step_time_s"] / auto_row["step_time_s"]
               if best_manual and auto_row else None)
    return {"model": model_spec, "cluster": cluster.name, "devices": cluster.num_devices,
            "tokens_per_step": tokens, "forward_flops": graph.forward_flops,
            "auto_speedup_over_best_megatron": speedup, "plans": rows}


def format_comparison(result: dict[str, Any]) -> str:
    """The comparison as a text table."""
    head = ["plan", "config", "step", "tokens/s", "TFLOP/s/dev", "MFU", "memory/dev"]
    body = []
    for r in result["plans"]:
        if "error" in r:
            body.append([r["name"], r["config"], "does not fit / divide", "", "", "", ""])
            continue
        body.append([r["name"], r["config"], f"{r['step_time_s'] * 1e3:.2f} ms",
                     f"{r['tokens_per_s']:,.0f}", f"{r['model_tflops_per_device']:.2f}",
                     f"{r['mfu']:.1%}", format_bytes(r["memory_bytes_per_device"])])
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(b, widths)) for b in body]
    s = result["auto_speedup_over_best_megatron"]
    lines.append(f"\n{result['model']} on {result['cluster']}: auto plan is "
                 + (f"{s:.3f}x the best Megatron plan's throughput" if s else
                    "not comparable (one side has no feasible plan)"))
    return "\n".join(lines)


def write_outputs(result: dict[str, Any], out_prefix: str) -> list[str]:
    """Write ``PREFIX.json`` and a bar chart ``PREFIX.png``; returns the paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(os.path.dirname(os.path.abspath(out_prefix)), exist_ok=True)
    json_path, png_path = out_prefix + ".json", out_prefix + ".png"
    with open(json_path, "w") as f:
        json.dump(result, f, indent=1)
    rows = [r for r in result["plans"] if "step_time_s" in r]
    fig, ax = plt.subplots(figsize=(8, 0.5 + 0.45 * max(1, len(rows))))
    labels = [f"{r['name']}: {r['config']}" for r in rows]
    values = [r["tokens_per_s"] for r in rows]
    colors = ["tab:green" if r["name"] == "auto" else "tab:blue" for r in rows]
    ax.barh(labels[::-1], values[::-1], color=colors[::-1])
    ax.set_xlabel("predicted tokens/s")
    ax.set_title(f"{result['model']} on {result['cluster']}")
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return [json_path, png_path]
