"""Plan quality: predicted throughput of the automatic plan against the best
Megatron-LM configuration, both priced by the same cost model.

Cases:

* Alpa's GPT-3 weak-scaling set on p3.16xlarge (V100 16 GB; 1 and 4 GPUs are
  part of one node): 350M on 1 GPU, 1.3B on 4, 2.6B on 8, 6.7B on 16, 15B on
  32, 39B on 64 (Alpa's table: sequence 1024, vocabulary 51200, float16).
  Global batch 16 sequences per GPU (1024 on 64 GPUs, Alpa's batch; a fixed
  batch of 1024 would leave the small cases hundreds of accumulated
  micro-batches).
* GPT-3 on dgx-a100-80g up to 1024 GPUs (sequence 2048, bfloat16), batch as
  in Megatron-LM's scaling table (Narayanan et al. 2021).
* llama3-8b and llama3-70b on dgx-h100, and the MoE model (``moe-8x``) on
  dgx-h100 (bfloat16); the Megatron grid of a model with experts includes
  Megatron-Core's expert parallelism (``ep`` in a configuration's name).

Every case records the auto plan, the best Megatron configuration and its
runners-up, the ratio auto / best-Megatron throughput, the planning seconds of
each side and what was restricted to keep this machine's budget (the
restrictions are part of the case: ``auto`` = keyword arguments of
``planner.plan``, ``megatron`` = the Megatron grid).

Writes ``benchmarks/results/plan_quality.json`` (cases already there and not
re-run are kept) and the markdown table made from it,
``benchmarks/results/plan_quality.md``.

    python -m benchmarks.plan_quality --quick          # a small subset
    python -m benchmarks.plan_quality --cases alpa     # cases whose name contains 'alpa'

Precision: mixed, as both Alpa and Megatron-LM train: fp32 master weights
and Adam states, compute in fp16 on the V100 (``fp16-mixed``) and in bf16 on
A100 and H100 (``bf16-mixed``); 18 bytes of state per parameter on both sides.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from benchmarks.common import git_commit, machine_info, read_results, write_results
from costmodel.cluster import Cluster
from costmodel.presets import preset
from ir.precision import compute_copy, get_precision
from models.zoo import GPTConfig, build, build_from_config
from models.zoo import config as zoo_config
from planner.baselines.compare import compare
from planner.baselines.megatron import MegatronConfig, megatron_configs, num_experts

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results", "plan_quality.json")
TABLE = os.path.join(HERE, "results", "plan_quality.md")

# Alpa (OSDI'22) table 4, GPT-3: (layers, hidden, heads).
ALPA_GPT = {"350m": (24, 1024, 16), "1.3b": (24, 2048, 32), "2.6b": (32, 2560, 32),
            "6.7b": (32, 4096, 32), "15b": (48, 5120, 40), "39b": (48, 8192, 64)}


@dataclass
class Case:
    name: str
    model: str                      # zoo name, or "alpa-gpt3-<size>"
    cluster: str                    # preset:nodes, or "p3.16xlarge/<gpus>" for part of a node
    batch: int
    seq: int
    precision: str                  # training precision (ir.precision), the same for both sides
    auto: dict[str, Any] = field(default_factory=dict)       # plan() restrictions
    megatron: dict[str, Any] = field(default_factory=dict)   # grid restrictions
    quick: bool = False
    vocab: int | None = None        # padded vocabulary (Megatron pads to a multiple of 128 tp)


def build_cluster(spec: str) -> Cluster:
    """``preset:nodes`` or ``preset/gpus`` (gpus of one node, e.g. 4 of a p3.16xlarge)."""
    if "/" in spec:
        name, gpus = spec.split("/")
        c = preset(name, 1)
        return dataclasses.replace(c, name=f"{name}/{gpus}gpu", devices_per_node=int(gpus))
    name, _, nodes = spec.partition(":")
    return preset(name, int(nodes or 1))


def build_case_model(case: Case) -> tuple[torch.nn.Module, tuple]:
    if case.model.startswith("alpa-gpt3-"):
        layers, hidden, heads = ALPA_GPT[case.model.removeprefix("alpa-gpt3-")]
        cfg = GPTConfig(layers, hidden, heads, vocab_size=51200, block_size=case.seq)
        return build_from_config(cfg, device="meta", batch_size=case.batch, seq_len=case.seq)
    if case.vocab is not None:
        cfg = dataclasses.replace(zoo_config(case.model), vocab_size=case.vocab)
        return build_from_config(cfg, device="meta", batch_size=case.batch, seq_len=case.seq)
    return build(case.model, device="meta", batch_size=case.batch, seq_len=case.seq)


# The auto search tries every pipeline degree, stage mesh and schedule with its
# own micro-batch counts: micro-batches of 1, 4 and 16 sequences and of one
# sequence per device of the stage mesh (the Megatron grid's micro-batch of one
# sequence per data-parallel rank). Cases measured before that last option was
# searched recorded these counts as ``num_microbatches``: batch/16, batch/4, batch.
# Every case's ``auto`` restriction is therefore empty.
def _cases() -> list[Case]:
    f16, bf16 = "fp16-mixed", "bf16-mixed"
    out = []
    for size, gpus in (("350m", 1), ("1.3b", 4), ("2.6b", 8), ("6.7b", 16), ("15b", 32),
                       ("39b", 64)):
        cluster = f"p3.16xlarge/{gpus}" if gpus < 8 else f"p3.16xlarge:{gpus // 8}"
        grid = {"micro_batch_sizes": [1, 4]} if gpus <= 8 else {
            "micro_batch_sizes": [1], "tp": [2, 4, 8]}
        out.append(Case(f"alpa-gpt3-{size}-p3x{gpus}", f"alpa-gpt3-{size}", cluster,
                        16 * gpus, 1024, f16, {}, grid, quick=gpus <= 8))
    # Megatron-LM's scaling table (tp inside a node); batch as there; GPT-2's
    # vocabulary 50257 padded to 51200 as Megatron does for tp = 8
    # (--make-vocab-size-divisible-by 128 x tp), else the vocabulary-parallel
    # embedding does not divide.
    for model, nodes, batch, pps, tps in (("gpt3-6.7b", 8, 512, [1, 2, 4], [4, 8]),
                                          ("gpt3-39b", 32, 1536, [4, 8, 16], [8]),
                                          ("gpt3-175b", 128, 1536, [8, 16], [8])):
        out.append(Case(f"{model}-a100x{8 * nodes}", model, f"dgx-a100-80g:{nodes}", batch,
                        2048, bf16, {},
                        {"micro_batch_sizes": [1], "tp": tps, "pp": pps,
                         "virtual_stages": [None]}, vocab=51200))
    out.append(Case("llama3-8b-h100x8", "llama3-8b", "dgx-h100:1", 32, 2048, bf16,
                    {}, {"micro_batch_sizes": [1, 2]}, quick=True))
    out.append(Case("llama3-70b-h100x64", "llama3-70b", "dgx-h100:8", 128, 2048, bf16,
                    {},
                    {"micro_batch_sizes": [1], "tp": [8], "pp": [4, 8]}))
    # expert parallelism (ep 1 to 8 of the 8 experts) makes tp = 1 and 2 worth trying
    out.append(Case("moe-8x-h100x16", "moe-8x", "dgx-h100:2", 64, 2048, bf16,
                    {},
                    {"micro_batch_sizes": [1], "tp": [1, 2, 4, 8], "pp": [1, 2, 4]}))
    return out


def megatron_grid(cluster: Cluster, batch: int, num_layers: int,
                  restrict: dict[str, Any], experts: int | None = None) -> list[MegatronConfig]:
    """The Megatron grid of a case (``experts``: the model's expert count, for
    expert parallelism), restricted as ``restrict`` says (``ep``: the
    expert-parallel sizes tried)."""
    cfgs = megatron_configs(cluster, batch, num_layers,
                            micro_batch_sizes=restrict.get("micro_batch_sizes", (1, 2, 4)),
                            virtual_stages=restrict.get("virtual_stages", (None, 2)),
                            sequence_parallel=restrict.get("sequence_parallel", (False, True)),
                            num_experts=experts, expert_parallel=restrict.get("ep"))
    for key, attr in (("tp", "tp"), ("pp", "pp")):
        if key in restrict:
            cfgs = [c for c in cfgs if getattr(c, attr) in restrict[key]]
    return cfgs


def run_case(case: Case, time_limit_s: float, megatron_deadline_s: float,
             commit: str | None = None) -> dict[str, Any]:
    """Plan ``case`` both ways; ``commit``: the code's git commit, recorded."""
    from ir.layers import block_count, pipeline_layers
    from ir.trace import trace

    cluster = build_cluster(case.cluster)
    model, inputs = build_case_model(case)
    graph = trace(*compute_copy(model, inputs, get_precision(case.precision)))
    configs = megatron_grid(cluster, case.batch, block_count(pipeline_layers(graph)), case.megatron,
                            num_experts(graph))
    t0 = time.perf_counter()
    result = compare(case.model, cluster, model=model, inputs=inputs, time_limit_s=time_limit_s,
                     configs=configs, auto_options=case.auto,
                     megatron_deadline_s=megatron_deadline_s,
                     zoo_kwargs={"batch_size": case.batch, "seq_len": case.seq}, graph=graph,
                     precision=case.precision,
                     progress=lambda msg: print(f"  {time.perf_counter() - t0:7.1f}s {msg}",
                                                flush=True))
    total = time.perf_counter() - t0
    auto = next(r for r in result["plans"] if r["name"] == "auto")
    manual = [r for r in result["plans"] if r["name"] == "megatron"]
    best = next((r for r in manual if "step_time_s" in r), None)
    # with expert parallelism in the grid, also the best configuration without it
    with_ep = any(r["megatron"]["ep"] > 1 for r in manual)
    best_dense = next((r for r in manual if "step_time_s" in r and r["megatron"]["ep"] == 1),
                      None)
    keys = ("config", "step_time_s", "tokens_per_s", "mfu", "memory_bytes_per_device",
            "planning_s")
    return {
        "case": case.name, "commit": commit, "model": case.model, "cluster": cluster.name,
        "devices": cluster.num_devices, "global_batch": case.batch, "seq_len": case.seq,
        "precision": case.precision,
        "parameters": graph.num_parameters,
        "restricted": {"auto": case.auto, "megatron": case.megatron,
                       "ilp_time_limit_s": time_limit_s,
                       "megatron_deadline_s": megatron_deadline_s},
        "auto": {k: auto.get(k) for k in ("config", "step_time_s", "tokens_per_s", "mfu",
                                         "memory_bytes_per_device", "planning_s", "error")},
        "best_megatron": best and {k: best.get(k) for k in keys},
        **({"best_megatron_without_ep": best_dense and {k: best_dense.get(k) for k in keys}}
           if with_ep else {}),
        "runners_up": result["runners_up"],
        "auto_over_best_megatron": result["auto_speedup_over_best_megatron"],
        "megatron_configs": {
            "grid": len(manual), "feasible": sum("step_time_s" in r for r in manual),
            "does_not_fit": sum("fit" in r.get("error", "") for r in manual),
            "pruned_or_skipped": sum(r.get("error", "").startswith(("pruned", "skipped"))
                                     for r in manual),
            "planning_s": sum(r.get("planning_s") or 0.0 for r in manual)},
        "planning_s": total,
        "plans": result["plans"],
    }


def _fmt_rate(x: float | None) -> str:
    return "-" if x is None else f"{x:,.0f}"


def markdown(results: dict[str, Any]) -> str:
    lines = [
        "| case | GPUs | batch x seq | auto plan | auto tokens/s | best Megatron | Megatron "
        "tokens/s | auto / Megatron | Megatron configs (fit / grid) | planning s (auto / "
        "Megatron) | restricted |",
        "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results["cases"]:
        auto, best = r["auto"], r["best_megatron"] or {}
        ratio = r["auto_over_best_megatron"]
        restricted = "; ".join(f"{side}: " + ", ".join(f"{k}={v}" for k, v in opts.items())
                               for side, opts in (("auto", r["restricted"]["auto"]),
                                                  ("megatron", r["restricted"]["megatron"]))
                               if opts) or "-"
        lines.append(
            f"| {r['case']} | {r['devices']} | {r['global_batch']} x {r['seq_len']} | "
            f"{auto.get('config') or '-'} | {_fmt_rate(auto.get('tokens_per_s'))} | "
            f"{best.get('config', '-')} | {_fmt_rate(best.get('tokens_per_s'))} | "
            f"{f'{ratio:.3f}' if ratio else '-'} | "
            f"{r['megatron_configs']['feasible']} / {r['megatron_configs']['grid']} | "
            f"{auto.get('planning_s') or 0:.0f} / {r['megatron_configs']['planning_s']:.0f} | "
            f"{restricted} |")
    lines.append("")
    for r in results["cases"]:
        if r.get("auto_note"):
            lines += [f"{r['case']}: {r['auto_note']}.", ""]
        if "best_megatron_without_ep" in r:
            dense = r["best_megatron_without_ep"] or {}
            lines.append(f"{r['case']}: the grid includes expert parallelism (ep); the best "
                         f"Megatron configuration without it is "
                         f"{dense.get('config', 'none (nothing fits)')}"
                         + (f", {_fmt_rate(dense.get('tokens_per_s'))} tokens/s." if dense
                            else "."))
            lines.append("")
    lines.append(f"Predicted by the cost model (`python -m benchmarks.plan_quality`); "
                 f"ILP limit {results.get('ilp_time_limit_s')} s per solve, planned on "
                 f"{results['machine']['cpus']} CPU cores. auto / Megatron > 1: the "
                 f"automatic plan is faster.")
    return "\n".join(lines)


def write_table(table: str, path: str = TABLE) -> None:
    """The markdown table of the results, beside their JSON."""
    with open(path, "w", encoding="utf-8") as f:
        f.write("# Plan quality: auto vs Megatron-LM\n\n" + table + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the small subset (1 to 8 GPUs)")
    ap.add_argument("--cases", nargs="*", help="run cases whose name contains one of these")
    ap.add_argument("--time-limit", type=float, default=10.0, help="ILP limit per solve, s")
    ap.add_argument("--megatron-deadline", type=float, default=600.0,
                    help="seconds of Megatron planning per case; later configurations skipped")
    ap.add_argument("--out", default=RESULTS)
    ap.add_argument("--table-only", action="store_true",
                    help="only rewrite plan_quality.md from the JSON")
    args = ap.parse_args(argv)
    if args.table_only:
        with open(args.out) as f:
            write_table(markdown(json.load(f)))
        return 0
    cases = _cases()
    if args.quick:
        cases = [c for c in cases if c.quick]
    if args.cases:
        cases = [c for c in cases if any(s in c.name for s in args.cases)]
    previous: dict[str, Any] = {r["case"]: r for r in read_results(args.out).get("cases", [])}
    warnings.simplefilter("ignore")
    commit = git_commit()  # the code this process loaded (later commits do not change it)
    for case in cases:
        print(f"{case.name}: {case.model} on {case.cluster}, batch {case.batch} x {case.seq}",
              flush=True)
        r = run_case(case, args.time_limit, args.megatron_deadline, commit)
        previous[case.name] = r
        ratio = r["auto_over_best_megatron"]
        print(f"{case.name}: auto {r['auto']['config']} vs Megatron "
              f"{(r['best_megatron'] or {}).get('config')}: "
              f"{'-' if ratio is None else f'{ratio:.3f}x'} ({r['planning_s']:.0f} s)", flush=True)
        order = [c.name for c in _cases()]
        results = {"machine": machine_info(brief=True), "ilp_time_limit_s": args.time_limit,
                   "cases": sorted(previous.values(), key=lambda x: order.index(x["case"])
                                   if x["case"] in order else len(order))}
        write_results(args.out, results)
    if cases:
        write_table(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
