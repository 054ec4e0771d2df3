"""``planner compare``: the automatic plan against every Megatron configuration.

All plans are priced by the same cost model. Throughput figures per plan:
tokens/s = tokens of the step / predicted step time; model FLOP/s per device =
3 x forward FLOPs (forward + backward) / step time / devices; MFU = that / the
device's peak FLOP/s for the model's dtype.
"""

from __future__ import annotations

import json
import os
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from costmodel.cluster import Cluster
from costmodel.presets import load_cluster
from ir.device_capture import planned_copy
from ir.graph import Graph
from ir.layers import block_count, pipeline_layers
from models.source import build_model
from ir.trace import trace
from planner.api import plan
from planner.search.cp_search import search_sizes, sequence_length
from planner.request import PlanRequest, PlanningError, resolve_precision
from planner.baselines.megatron import (MegatronConfig, MegatronDoesNotFit, megatron_configs,
                              megatron_plan, num_experts)
from plan.format import Plan
from planner.report import format_bytes


@dataclass
class Entry:
    """One compared plan (``plan`` is None when the configuration is impossible)."""

    name: str
    config_label: str
    plan: Plan | None
    error: str | None = None
    config: MegatronConfig | None = None
    seconds: float | None = None  # planning time


def _metrics(p: Plan, cluster: Cluster, forward_flops: float, tokens: int) -> dict[str, float]:
    step = p.predicted["step_time_s"]
    per_device = 3.0 * forward_flops / step / cluster.num_devices
    peak = cluster.device.flops(p.training.get("dtype", "float32"))
    return {"step_time_s": step, "tokens_per_s": tokens / step,
            "model_tflops_per_device": per_device / 1e12, "mfu": per_device / peak,
            "memory_bytes_per_device": p.predicted["memory_bytes_per_device"]["total"]}


def _megatron_fields(cfg: MegatronConfig) -> dict[str, Any]:
    return {"tp": cfg.tp, "pp": cfg.pp, "dp": cfg.dp, "ep": cfg.ep, "mbs": cfg.micro_batch_size,
            "vpp": cfg.virtual_pipeline_model_parallel_size,
            "distributed_optimizer": cfg.use_distributed_optimizer,
            "sequence_parallel": cfg.sequence_parallel, "cp": cfg.cp}


def compare(model_spec: str, cluster_spec: str | Cluster, *,
            zoo_kwargs: dict[str, Any] | None = None, time_limit_s: float = 60.0,
            model: torch.nn.Module | None = None, inputs: tuple | None = None,
            configs: Sequence[MegatronConfig] | None = None,
            micro_batch_sizes: Sequence[int] = (1, 2, 4),
            virtual_stages: Sequence[int | None] = (None, 2),
            sequence_parallel: Sequence[bool] = (False, True), pipeline: bool = True,
            auto_options: dict[str, Any] | None = None,
            megatron_deadline_s: float | None = None,
            progress: Callable[[str], None] | None = None,
            graph: Graph | None = None, precision: str | None = None) -> dict[str, Any]:
    """Plan ``model_spec`` automatically and with every Megatron configuration.

    Args:
        model, inputs: the model and its example inputs when they are not built
            from ``model_spec`` (which is then only recorded); ``graph``: their
            trace, if already traced.
        configs: the Megatron configurations to price (default:
            :func:`planner.baselines.megatron.megatron_configs` of the cluster, the batch
            and the number of pipeline layers, with ``micro_batch_sizes``,
            ``virtual_stages`` and ``sequence_parallel``, expert
            parallelism for a model with experts, and at sequences of
            :data:`planner.search.cp_search.CP_MIN_SEQ` tokens or more the
            context-parallel sizes the automatic search tries there
            (:func:`planner.search.cp_search.search_sizes`); ``pipeline=False``
            keeps pp = 1 only).
        auto_options: extra keyword arguments of :func:`planner.api.plan` (for
            example ``pp``, ``schedules``, ``num_microbatches`` to restrict the
            automatic search).
        megatron_deadline_s: stop pricing Megatron configurations after this many
            seconds; the rest are listed as skipped.

    Memory pruning: configurations are priced in grid order; when one does not
    fit, the larger micro-batch sizes of the same tp/pp/dp/ep/vpp/sp are listed as
    impossible without planning them (more activations never fit better).

    Returns a JSON-ready dict: model, cluster, ``plans`` sorted fastest first
    (each with its metrics, configuration, planning seconds, or the reason it is
    impossible), ``best_megatron``, ``runners_up`` (the next three Megatron
    plans) and ``auto_speedup_over_best_megatron`` (auto throughput / best
    Megatron throughput).
    """
    zoo_kwargs = zoo_kwargs or {}
    say = progress or (lambda msg: None)
    cluster = load_cluster(cluster_spec) if isinstance(cluster_spec, str) else cluster_spec
    if model is None:
        model, inputs = build_model(model_spec, device="meta", **zoo_kwargs)
    inputs = tuple(inputs)
    chosen = resolve_precision(model, cluster, precision)
    graph = graph or trace(*planned_copy(model, inputs, chosen, cluster.device_type))
    tokens = int(inputs[0].numel()) if isinstance(inputs[0], torch.Tensor) else 0
    global_batch = int(inputs[0].shape[0]) if isinstance(inputs[0], torch.Tensor) else None
    if configs is None:
        configs = _default_configs(cluster, graph, inputs, global_batch, pipeline,
                                   micro_batch_sizes, virtual_stages, sequence_parallel)
    request = PlanRequest(model_source=model_spec, time_limit_s=time_limit_s,
                          zoo_kwargs=zoo_kwargs, precision=chosen)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        entries = [_auto_entry(model, cluster, inputs, request, auto_options or {}, say)]
        entries += _megatron_entries(model, cluster, inputs, graph, request, configs,
                                     megatron_deadline_s, say)
    rows = sorted((_row(e, cluster, graph.forward_flops, tokens) for e in entries),
                  key=lambda r: (r.get("step_time_s", float("inf")), r["config"]))
    feasible = [r for r in rows if "step_time_s" in r]
    manual = [r for r in feasible if r["name"] == "megatron"]
    best_manual = manual[0] if manual else None
    auto_row = next((r for r in feasible if r["name"] == "auto"), None)
    speedup = (best_manual["step_time_s"] / auto_row["step_time_s"]
               if best_manual and auto_row else None)
    return {"model": model_spec, "cluster": cluster.name, "devices": cluster.num_devices,
            "tokens_per_step": tokens, "global_batch": global_batch,
            "seq_len": _seq_len(inputs),
            "precision": chosen.name,
            "forward_flops": graph.forward_flops,
            "auto_speedup_over_best_megatron": speedup,
            "best_megatron": best_manual["config"] if best_manual else None,
            "runners_up": [r["config"] for r in manual[1:4]],
            "megatron_configs": len(configs),
            "megatron_feasible": len(manual), "plans": rows}


def _seq_len(inputs: tuple) -> int | None:
    """The sequence length of the first input (its dim 1), None where it has none."""
    return (int(inputs[0].shape[1]) if isinstance(inputs[0], torch.Tensor)
            and inputs[0].ndim > 1 else None)


def _default_configs(cluster: Cluster, graph: Graph, inputs: tuple, global_batch: int | None,
                     pipeline: bool, micro_batch_sizes: Sequence[int],
                     virtual_stages: Sequence[int | None],
                     sequence_parallel: Sequence[bool]) -> list[MegatronConfig]:
    """The Megatron grid :func:`compare` prices by default
    (:func:`planner.baselines.megatron.megatron_configs`)."""
    num_layers = block_count(pipeline_layers(graph)) if pipeline else None
    # long sequences: Megatron with the cp sizes the automatic search tries there
    seq = sequence_length(inputs)
    cps = (1, *search_sizes(None, seq, cluster.num_devices, fits_without=True))
    return megatron_configs(cluster, global_batch, num_layers,
                            micro_batch_sizes=micro_batch_sizes,
                            virtual_stages=virtual_stages,
                            sequence_parallel=sequence_parallel,
                            num_experts=num_experts(graph), context_parallel=cps,
                            seq_len=seq)


def _auto_entry(model: torch.nn.Module, cluster: Cluster, inputs: tuple, request: PlanRequest,
                auto_options: dict[str, Any], say: Callable[[str], None]) -> Entry:
    """The automatic plan (``auto_options``: :class:`PlanRequest` fields that
    restrict its search), or why there is none."""
    say("auto plan")
    t0 = time.perf_counter()
    try:
        auto = plan(model, cluster, example_inputs=inputs, request=request, **auto_options)
    except PlanningError as err:
        return Entry("auto", "-", None, str(err), seconds=time.perf_counter() - t0)
    return Entry("auto", auto_label(auto), auto, seconds=time.perf_counter() - t0)


def _megatron_entries(model: torch.nn.Module, cluster: Cluster, inputs: tuple, graph: Graph,
                      request: PlanRequest, configs: Sequence[MegatronConfig],
                      deadline_s: float | None, say: Callable[[str], None]) -> list[Entry]:
    """Every Megatron configuration's plan, in grid order, or why it has none:
    a larger micro-batch of a family (tp, pp, dp, ep, vpp, optimizer, sp) that
    did not fit is pruned, and after ``deadline_s`` seconds the rest are skipped."""
    entries: list[Entry] = []
    cache: dict = {"graph": graph}
    start = time.perf_counter()
    too_big: set[tuple] = set()
    for k, cfg in enumerate(configs):
        family = (cfg.tp, cfg.pp, cfg.dp, cfg.cp, cfg.ep,
                  cfg.virtual_pipeline_model_parallel_size, cfg.use_distributed_optimizer,
                  cfg.sequence_parallel)
        if family in too_big:
            entries.append(Entry("megatron", cfg.label(), None,
                                 "pruned: a smaller micro-batch size does not fit", config=cfg))
            continue
        if deadline_s is not None and time.perf_counter() - start > deadline_s:
            entries.append(Entry("megatron", cfg.label(), None,
                                 "skipped: planning time budget spent", config=cfg))
            continue
        say(f"[{k + 1}/{len(configs)}] megatron {cfg.label()}")
        t0 = time.perf_counter()
        try:
            p = megatron_plan(model, cluster, cfg, example_inputs=inputs,
                              model_source=request.model_source, zoo_kwargs=request.zoo_kwargs,
                              time_limit_s=request.time_limit_s, graph=graph, cache=cache,
                              precision=request.precision)
            entries.append(Entry("megatron", cfg.label(), p, config=cfg,
                                 seconds=time.perf_counter() - t0))
        except PlanningError as err:
            if isinstance(err, MegatronDoesNotFit):
                too_big.add(family)
            entries.append(Entry("megatron", cfg.label(), None, str(err), config=cfg,
                                 seconds=time.perf_counter() - t0))
    return entries


def _row(e: Entry, cluster: Cluster, forward_flops: float, tokens: int) -> dict[str, Any]:
    """The JSON row of one compared plan: its metrics, or its error."""
    row: dict[str, Any] = {"name": e.name, "config": e.config_label}
    if e.config is not None:
        row["megatron"] = _megatron_fields(e.config)
    if e.seconds is not None:
        row["planning_s"] = e.seconds
    if e.plan is None:
        row["error"] = e.error
    else:
        row.update(_metrics(e.plan, cluster, forward_flops, tokens))
        if e.plan.pipeline is not None:
            row["bubble_s"] = e.plan.predicted.get("bubble_s")
    return row


def auto_label(p: Plan) -> str:
    """An automatic plan's layout in words, e.g. ``pp=4 stage mesh 2x2 ZeRO-3 zbv m=64``."""
    cp = ((p.training or {}).get("context_parallel") or {}).get("size")
    cp_label = f" cp={cp}" if cp else ""
    if p.pipeline is None:
        return f"mesh {'x'.join(map(str, p.mesh_shape))}{cp_label}"
    pipe = p.pipeline
    zero = f" ZeRO-{pipe.zero_stage}" if pipe.zero_stage else ""
    return (f"pp={pipe.pp} stage mesh {'x'.join(map(str, pipe.stage_mesh['shape']))}{zero} "
            f"{pipe.schedule} m={pipe.num_microbatches}{cp_label}")


def format_comparison(result: dict[str, Any]) -> str:
    """The comparison as a text table (impossible configurations last, with why)."""
    head = ["plan", "config", "step", "tokens/s", "TFLOP/s/dev", "MFU", "memory/dev", "planned in"]
    body = []
    for r in result["plans"]:
        took = f"{r['planning_s']:.1f} s" if r.get("planning_s") is not None else ""
        if "error" in r:
            why = r["error"]
            short = (why if why.startswith(("pruned", "skipped")) else
                     "does not fit" if "fit" in why else "does not divide")
            body.append([r["name"], r["config"], short, "", "", "", "", took])
            continue
        body.append([r["name"], r["config"], f"{r['step_time_s'] * 1e3:.2f} ms",
                     f"{r['tokens_per_s']:,.0f}", f"{r['model_tflops_per_device']:.2f}",
                     f"{r['mfu']:.1%}", format_bytes(r["memory_bytes_per_device"]), took])
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(b, widths)) for b in body]
    s = result["auto_speedup_over_best_megatron"]
    if result.get("best_megatron"):
        lines.append(f"\nbest Megatron plan: {result['best_megatron']}"
                     + (f"; runners-up: {', '.join(result['runners_up'])}"
                        if result.get("runners_up") else ""))
    lines.append(f"{result['model']} on {result['cluster']}: auto plan is "
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
    bars = ax.barh(labels[::-1], values[::-1], color=colors[::-1])
    best = max(values, default=0.0)
    # the value and its share of the best on each bar: a 1.5 % gap is not visible
    ax.bar_label(bars, [f"{v:,.0f} ({v / best:.1%})" if best else f"{v:,.0f}"
                        for v in values[::-1]], fontsize=7, padding=2)
    ax.set_xlim(0, best * 1.25 if best else 1)
    ax.set_xlabel("predicted tokens/s")
    step = (f", batch {result['global_batch']} x seq {result['seq_len']}"
            if result.get("global_batch") and result.get("seq_len") else "")
    ax.set_title(f"{result['model']} on {result['cluster']}{step}"
                 + (f", {result['precision']}" if result.get("precision") else ""))
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return [json_path, png_path]
