"""Predicted vs measured step time of real plans, auto and Megatron, on local ranks.

    planner profile --ranks 2 -o local-cpu-2.json
    python -m benchmarks.measured --profile local-cpu-2.profile.json   # every plan on 2 ranks
    python -m benchmarks.measured                      # profile 2 ranks now, then the same
    python -m benchmarks.measured --quick              # fewer plans and steps (smoke test)
    python -m benchmarks.measured --compile --worlds 2 # compiled plans, priced as compiled

1. Price plans on a profiled cluster: for each world size (default 2 ranks) a fresh ``costmodel.profiling.profile_local`` of this machine, or a
   cached profile given with ``--profile`` (matched by its rank count; the
   result JSON records which was used, its fits and when it was made).
2. Make the plans of each model (``benchmarks.step_models``, whose step is
   compute rather than launch overhead): the automatic plan (``planner.plan``,
   the whole two-level search), the plans each :data:`RECIPES` entry pins (one
   stage on all ranks: the mesh's own ILP choice, ZeRO-1/2/3, every layer
   recomputed, 4 accumulated micro-batches; a 2-stage pipeline under GPipe and
   under 1F1B; one stage whose sequences context parallelism splits over
   2 ranks), and every Megatron configuration
   (``planner.baselines.megatron.megatron_configs`` / ``megatron_plan``: DP,
   TP, TP with sequence parallelism). Plans that come out identical (same
   placements everywhere) are run once.
3. Run each for real, every plan once per round (``--rounds``, default 2, so that
   a slower hour of the machine falls on all plans alike):
   ``training.launch.launch(plan, steps=N, check=True)``
   (torchrun, gloo on CPU / NCCL on GPU, one thread per rank). The first step is
   warm-up and dropped; a launch's step time is the median of the rest, and a
   plan's the median over its rounds. The
   check compares step 1 with one process, so a timing of a wrong program is
   flagged (``passed``).
4. Report per plan the predicted and measured step time and their ratio; over
   all plans the Spearman rank correlation and the mean absolute percentage
   error (``benchmarks.stats``); per (model, batch, ranks) the auto plan's
   step time over the best other plan's, and its rank among them, measured
   and predicted.
5. Where two plans are within the machine's drift of each other, their
   medians from separate launches cannot order them: the auto plan and the
   fastest other plan then run in turns (``--pairs`` pairs of launches, the
   order swapped every pair), and the report gives the geometric mean of
   the pairs' ratios with its 90 % bootstrap interval (``paired``).

Writes ``benchmarks/results/measured.json`` and a scatter plot of predicted
against measured step time beside it (``measured.png``). Other work on the
machine shares its cores: the load average is recorded.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import statistics
import time
import warnings
from dataclasses import dataclass, field, replace
from typing import Any, Callable

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:  # python benchmarks/measured.py as well as python -m benchmarks.measured
    sys.path.insert(0, ROOT)

from benchmarks.common import (load_average, load_average_1min, machine_block,  # noqa: E402
                               torch_speed_probe, write_results, wrote_message)
from benchmarks.stats import mape, median_after_warmup, paired_ratio, spearman  # noqa: E402
from training.launch import launch  # noqa: E402
from training.torchrun import LaunchError  # noqa: E402
from costmodel.cluster import Cluster  # noqa: E402
from codegen.runtime_probe import profile_with_runtime  # noqa: E402
from costmodel.profiling import ProfileError, load_profile, profile_path  # noqa: E402
from models.source import build_model  # noqa: E402
from ir.trace import trace  # noqa: E402
from planner.api import PlanningError, plan  # noqa: E402
from planner.baselines.megatron import megatron_configs, megatron_plan  # noqa: E402
from plan.format import Plan  # noqa: E402

RESULTS = os.path.join(HERE, "results")


#: Plan recipes: a name and the :func:`planner.api.plan` options that pin it. The
#: single-stage ones pin the mesh to all ranks in one axis; "auto" is the whole
#: two-level search (meshes, pipelines, ZeRO, recompute, micro-batches).
RECIPES: dict[str, dict[str, Any]] = {
    "auto": {},
    "mesh": {"mesh_shape": "all", "recompute": False},
    "zero-1": {"mesh_shape": "all", "zero_stages": (1,), "recompute": False},
    "zero-2": {"mesh_shape": "all", "zero_stages": (2,), "recompute": False},
    "zero-3": {"mesh_shape": "all", "zero_stages": (3,), "recompute": False},
    "recompute": {"mesh_shape": "all", "recompute": True},
    "accumulate-4": {"mesh_shape": "all", "num_microbatches": (4,), "recompute": False},
    "pp2-gpipe": {"pp": (2,), "schedules": ("gpipe",), "num_microbatches": (4,),
                  "zero_stages": (0,), "context_parallel": (1,)},
    "pp2-1f1b": {"pp": (2,), "schedules": ("1f1b",), "num_microbatches": (4,),
                 "zero_stages": (0,), "context_parallel": (1,)},
    "cp-2": {"pp": (1,), "context_parallel": (2,)},
}


@dataclass(frozen=True)
class Case:
    """A group of plans for one model, batch and world size: ``recipes`` (keys
    of :data:`RECIPES`) and, with ``megatron``, every Megatron configuration."""

    model: str
    ranks: int
    batch_size: int
    megatron: bool = True
    recipes: tuple[str, ...] = ("auto",)


#: Models whose step is compute (hundreds of ms per rank), not launch overhead.
STEP_MODELS = ("benchmarks.step_models:gpt_small", "benchmarks.step_models:llama_small")

#: The plans: every recipe and Megatron configuration of each step model on 2 ranks.
CASES = tuple(Case(m, 2, 8, recipes=tuple(RECIPES)) for m in STEP_MODELS)
#: ``--quick``: the tiny zoo models, auto and Megatron only.
QUICK_CASES = (Case("gpt-tiny", 2, 8), Case("gpt-tiny", 4, 8))


@dataclass
class Row:
    name: str  # "auto" | "megatron"
    config: str
    case: Case
    plan: Plan | None = None
    path: str | None = None
    signature: str | None = None
    same_as: str | None = None
    error: str | None = None
    plan_s: float = 0.0
    result: dict[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return f"{short_name(self.case.model)} b{self.case.batch_size} {self.case.ranks}r {self.name} {self.config}"


def short_name(model: str) -> str:
    """A model spec without its module: ``gpt_small`` for ``benchmarks.step_models:gpt_small``."""
    return model.rpartition(":")[2]


def plan_signature(p: Plan) -> str:
    """Identical placements, stages and training settings (and the same model) -> identical program."""
    d = p.to_dict()
    key = {k: d.get(k) for k in ("mesh", "parameters", "inputs", "nodes", "checkpoint", "pipeline")}
    key["fingerprint"] = d.get("model", {}).get("fingerprint")
    key["training"] = {k: v for k, v in (d.get("training") or {}).items() if k != "memory_budget_bytes"}
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]


def get_profiles(worlds: list[int], cached: list[str], quick: bool, tmp: str) -> dict[int, dict[str, Any]]:
    """World size -> profile dict (with ``source``: the cached file, or "fresh")."""
    out: dict[int, dict[str, Any]] = {}
    for path in cached:
        prof = load_profile(path)
        prof["source"] = os.path.relpath(os.path.abspath(path), ROOT)
        out[int(prof["ranks"])] = prof
    for w in worlds:
        if w in out:
            continue
        cluster_path = os.path.join(tmp, f"local-{w}.json")
        t0 = time.perf_counter()
        profile_with_runtime(w, cluster_path, quick=quick, progress=False)
        prof = load_profile(profile_path(cluster_path))
        prof["source"] = "fresh" + (" (quick)" if quick else "")
        print(f"profiled {w} ranks in {time.perf_counter() - t0:.0f} s", flush=True)
        out[w] = prof
    return out


def recipe_options(recipe: str, ranks: int) -> dict[str, Any]:
    """:func:`planner.api.plan` options of ``recipe`` on ``ranks`` ranks."""
    opts = dict(RECIPES[recipe])
    if opts.get("mesh_shape") == "all":
        opts["mesh_shape"] = (ranks,)
    return opts


def _recipe_config(p: Plan) -> str:
    """Where a plan runs, in a few words: its mesh, or its stages and schedule."""
    pipe = p.pipeline
    if pipe is not None:
        return f"pp{pipe.pp} {pipe.schedule} x{pipe.num_microbatches}"
    return "mesh " + "x".join(map(str, p.mesh_shape))


def _try_plan(row: Row, make: Callable[[], Plan]) -> Row:
    t0 = time.perf_counter()
    try:
        row.plan = make()
    except PlanningError as err:
        row.error = str(err)
    row.plan_s = time.perf_counter() - t0
    return row


def make_plans(case: Case, cluster: Cluster, time_limit_s: float, compile: bool = False) -> list[Row]:
    """The case's plans on ``cluster``; ``compile``: made, priced and run as
    compiled programs (``--compile``)."""
    kw = {"batch_size": case.batch_size}
    model, inputs = build_model(case.model, device="meta", **kw)
    graph = trace(model, inputs)
    rows = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for recipe in case.recipes:
            opts = recipe_options(recipe, case.ranks)
            row = _try_plan(Row(recipe, "", case), lambda: plan(
                model, cluster, example_inputs=inputs, model_source=case.model,
                time_limit_s=time_limit_s, zoo_kwargs=kw, compile=compile, **opts))
            if row.plan is not None:
                row.config = _recipe_config(row.plan)
            rows.append(row)
        for cfg in megatron_configs(cluster) if case.megatron else ():
            sp = " sp" if cfg.sequence_parallel else ""
            rows.append(_try_plan(
                Row("megatron", f"tp={cfg.tensor_model_parallel_size} dp={cfg.data_parallel_size}{sp}",
                    case),
                lambda: megatron_plan(model, cluster.running_compiled(compile), cfg,
                                      example_inputs=inputs, model_source=case.model,
                                      zoo_kwargs=kw, time_limit_s=time_limit_s,
                                      graph=graph).with_compile(compile)))
    return rows


def _launch(row: Row, steps: int, timeout_s: float, *, check: bool) -> dict[str, Any] | None:
    """``training.launch.launch`` of ``row``'s plan; None where it failed, the
    failure's first line recorded as the row's error."""
    try:
        return launch(row.path, steps=steps, check=check, timeout_s=timeout_s)
    except LaunchError as err:
        row.error = "launch failed: " + str(err).splitlines()[0]
        return None


def run_row(row: Row, steps: int, warmup: int, timeout_s: float) -> None:
    """Launch ``row``'s plan once and add the run to ``row.result``: each
    round's median step (``rounds_s``), and as ``measured_s`` the median over
    the rounds so far."""
    t0 = time.perf_counter()
    res = _launch(row, steps, timeout_s, check=True)
    wall = time.perf_counter() - t0
    if res is None:
        return
    times = res["step_times_s"]
    out = row.result
    out.setdefault("rounds_s", []).append(median_after_warmup(times, warmup))
    out.setdefault("step_times_s", []).append(times)
    meas = statistics.median(out["rounds_s"])
    pred = row.plan.predicted["step_time_s"]
    out.update({
        "measured_s": meas,
        "measured_min_s": min(min(t[warmup:] or t) for t in out["step_times_s"]),
        "predicted_s": pred, "ratio_measured_over_predicted": meas / pred,
        "passed": res.get("passed") and out.get("passed", True),
        "max_rel_grad_err": res.get("max_rel_grad_err"),
        "explicit_reshards": res.get("explicit_reshards"), "fallback_ops": res.get("fallback_ops"),
        "launch_wall_s": wall, "setup_s": res.get("setup_s"), "loadavg_1min_after": load_average_1min(),
    })


def auto_vs_best(rows: list[Row]) -> list[dict[str, Any]]:
    """Per (model, batch, ranks): the auto plan's step time over the fastest
    other plan's, measured and predicted, and its rank (1 = fastest) among the
    distinct plans as measured."""
    out = []
    for case in dict.fromkeys(r.case for r in rows):
        auto = next((r for r in rows if r.case == case and r.name == "auto" and r.result), None)
        if auto is None:
            continue
        group = [r for r in rows if r.case == case and r.result and r.same_as is None]
        others = [r for r in group if r.name != "auto" and r.signature != auto.signature]
        if not others:
            continue
        best_meas = min(others, key=lambda r: r.result["measured_s"])
        best_pred = min(others, key=lambda r: r.result["predicted_s"])
        measured = sorted(r.result["measured_s"] for r in group)
        out.append({
            "model": case.model, "batch_size": case.batch_size, "ranks": case.ranks,
            "auto": f"{auto.config}" + (f" (= {auto.same_as})" if auto.same_as else ""),
            "auto_rank_measured": 1 + sum(m < auto.result["measured_s"] for m in measured),
            "distinct_plans": len(group),
            "best_other_measured": best_meas.label, "best_other_predicted": best_pred.label,
            "auto_over_best_other_measured": auto.result["measured_s"] / best_meas.result["measured_s"],
            "auto_over_best_other_predicted": auto.result["predicted_s"] / best_pred.result["predicted_s"],
        })
    return out


def _round_step(row: Row, steps: int, warmup: int) -> float | None:
    """One launch of ``row``'s plan without the one-process check: its median
    step after ``warmup`` (None where it failed, recorded as the row's error)."""
    res = _launch(row, steps, 300.0, check=False)
    return None if res is None else median_after_warmup(res["step_times_s"], warmup)


def auto_against_best(rows: list[Row], entries: list[dict[str, Any]], steps: int, warmup: int,
                      rounds: int) -> None:
    """For each :func:`auto_vs_best` entry, the auto plan and the fastest other
    plan as measured, launched in turns (``rounds`` pairs, the order swapped
    every pair) so that the machine's drift falls on both: the pairs'
    ratios, auto over the other, their geometric mean and its 90 % interval
    (``entry["paired"]``), the verdict when two plans are close."""
    for entry in entries:
        group = [r for r in rows if r.case.model == entry["model"] and r.path and r.case.ranks
                 == entry["ranks"] and r.case.batch_size == entry["batch_size"]]
        auto = next(r for r in group if r.name == "auto")
        other = next(r for r in group if r.label == entry["best_other_measured"])
        a, b = [], []
        for k in range(rounds):
            print(f"pair {k + 1}/{rounds}: {auto.label} and {other.label} ...", flush=True)
            order = (auto, other) if k % 2 == 0 else (other, auto)
            steps_s = {r.label: _round_step(r, steps, warmup) for r in order}
            if None in steps_s.values():
                break
            a.append(steps_s[auto.label])
            b.append(steps_s[other.label])
        if a:
            entry["paired"] = {"other": other.label, "auto_s": a, "other_s": b,
                               **paired_ratio(a, b)}


def summarize(rows: list[Row]) -> dict[str, Any]:
    """Spearman and MAPE over the distinct plans that ran (all, and per world size).

    The headline uses each plan's median step; ``*_min_step`` the fastest kept
    step, less sensitive to other work on a shared machine.
    """
    ran = [r for r in rows if r.result and r.same_as is None]

    def stats(sub: list[Row], key: str) -> tuple[float | None, float | None]:
        pred = [r.result["predicted_s"] for r in sub]
        meas = [r.result[key] for r in sub]
        return spearman(pred, meas), mape(pred, meas)

    out: dict[str, Any] = {"plans_run": len(ran)}
    out["spearman"], out["mape_pct"] = stats(ran, "measured_s")
    out["spearman_min_step"], out["mape_pct_min_step"] = stats(ran, "measured_min_s")
    for w in sorted({r.case.ranks for r in ran}):
        sub = [r for r in ran if r.case.ranks == w]
        out[f"spearman_{w}_ranks"], out[f"mape_pct_{w}_ranks"] = stats(sub, "measured_s")
    ratios = sorted(r.result["ratio_measured_over_predicted"] for r in ran)
    if ratios:
        out["ratio_measured_over_predicted"] = {"min": ratios[0], "median": ratios[len(ratios) // 2],
                                                "max": ratios[-1]}
    out["within_25_pct"] = sum(abs(r.result["predicted_s"] - r.result["measured_s"])
                               <= 0.25 * r.result["measured_s"] for r in ran)
    out["all_checks_passed"] = all(r.result.get("passed") for r in ran)
    return out


def print_report(result: dict[str, Any]) -> None:
    print(f"\n{'plan':<44}{'predicted':>11}{'measured':>11}{'meas/pred':>10}  check")
    for p in result["plans"]:
        label = f"{short_name(p['model'])} b{p['batch_size']} {p['ranks']}r {p['name']} {p['config']}"
        if "measured_s" not in p:
            print(f"{label:<44}  {p.get('error') or ('same program as ' + p['same_as'])}"[:140])
            continue
        print(f"{label:<44}{p['predicted_s'] * 1e3:>9.2f}ms{p['measured_s'] * 1e3:>9.2f}ms"
              f"{p['ratio_measured_over_predicted']:>10.2f}  {'ok' if p['passed'] else 'FAILED'}"
              + (f"  (= {p['same_as']})" if p.get("same_as") else ""))
    s = result["summary"]
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    print(f"\n{s['plans_run']} distinct plans, {s['within_25_pct']} within 25 %: "
          f"Spearman {fmt(s['spearman'], '.3f')}, "
          f"MAPE {fmt(s['mape_pct'], '.1f')} % (fastest step instead of median: Spearman "
          f"{fmt(s['spearman_min_step'], '.3f')}, MAPE {fmt(s['mape_pct_min_step'], '.1f')} %)")
    for k, v in s.items():
        if k.startswith(("spearman_", "mape_pct_")) and "min_step" not in k:
            print(f"  {k}: {fmt(v, '.3f')}")
    for a in result["auto_vs_best"]:
        print(f"\n{short_name(a['model'])} b{a['batch_size']} {a['ranks']}r: auto {a['auto']} ranks "
              f"{a['auto_rank_measured']} of {a['distinct_plans']} measured; auto / best other: "
              f"measured {a['auto_over_best_other_measured']:.3f} "
              f"({a['best_other_measured']}), predicted {a['auto_over_best_other_predicted']:.3f}")
        if "paired" in a:
            p = a["paired"]
            print(f"  in {len(p['ratios'])} pairs of launches: auto / other {p['geomean']:.3f} "
                  f"(90 % interval {p['low']:.3f}-{p['high']:.3f}; pairs "
                  f"{', '.join(f'{x:.2f}' for x in p['ratios'])})")


def draw_scatter(result: dict[str, Any], path: str) -> str | None:
    """Predicted against measured step time of every distinct plan (log-log,
    ms), the diagonal and its +-25 % band; the auto plans ringed. None (no
    plot) when no plan ran."""
    runs = [p for p in result["plans"] if "measured_s" in p and not p.get("same_as")]
    if not runs:
        return None
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.4, 5.6))
    for model in dict.fromkeys(p["model"] for p in runs):
        mine = [p for p in runs if p["model"] == model]
        ax.scatter([p["measured_s"] * 1e3 for p in mine], [p["predicted_s"] * 1e3 for p in mine],
                   label=short_name(model), s=24)
        for p in mine:
            ax.annotate(p["name"] if p["name"] != "megatron" else p["config"],
                        (p["measured_s"] * 1e3, p["predicted_s"] * 1e3), fontsize=6,
                        xytext=(3, 2), textcoords="offset points")
    autos = [p for p in runs if p["name"] == "auto"]
    ax.scatter([p["measured_s"] * 1e3 for p in autos], [p["predicted_s"] * 1e3 for p in autos],
               s=90, facecolors="none", edgecolors="black", label="auto")
    values = [p[k] * 1e3 for p in runs for k in ("measured_s", "predicted_s")]
    lo, hi = min(values) / 1.3, max(values) * 1.3
    ax.plot([lo, hi], [lo, hi], color="grey", lw=1)
    ax.fill_between([lo, hi], [lo * 0.75, hi * 0.75], [lo * 1.25, hi * 1.25], color="grey", alpha=0.15,
                    label="within 25 %")
    ax.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(lo, hi), xlabel="measured step, ms",
           ylabel="predicted step, ms", title="Step time: predicted against measured")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", nargs="+", default=[], metavar="PATH",
                    help="cached profile JSON(s) (planner profile output, matched by rank count); "
                         "world sizes without one are profiled now")
    ap.add_argument("--worlds", type=int, nargs="+", default=[2], help="rank counts (default 2)")
    ap.add_argument("--steps", type=int, default=9, help="training steps per plan (default 9)")
    ap.add_argument("--warmup", type=int, default=2,
                    help="leading steps dropped (default 2: the first makes the optimizer's "
                         "states, and the second ran slower than the rest in half the launches)")
    ap.add_argument("--rounds", type=int, default=2,
                    help="launches of every plan, one round after the other; a plan's step "
                         "is the median over rounds of each launch's median (default 2)")
    ap.add_argument("--pairs", type=int, default=6,
                    help="then the auto plan and the fastest other one in turns, this many pairs "
                         "of launches each case (default 6; 0: none)")
    ap.add_argument("--time-limit", type=float, default=10.0, help="ILP time limit per solve, s")
    ap.add_argument("--quick", action="store_true", help="two cases, quick profiles, 4 steps")
    ap.add_argument("--compile", action="store_true",
                    help="plan, price and run every plan compiled (torch.compile); the first "
                         "step compiles, so keep --warmup >= 1")
    ap.add_argument("--models", nargs="+", default=None, metavar="NAME",
                    help="only the cases of these models")
    ap.add_argument("--recipes", nargs="+", default=None, choices=tuple(RECIPES), metavar="NAME",
                    help="only these recipes of each case (default all; "
                         f"{', '.join(RECIPES)}); Megatron's configurations run unless --no-megatron")
    ap.add_argument("--no-megatron", action="store_true", help="leave out Megatron's configurations")
    ap.add_argument("-o", "--output", default=None,
                    help="result JSON (default benchmarks/results/measured.json, "
                         "measured_compiled.json with --compile)")
    return ap


def _save_distinct(rows: list[Row], tmp: str) -> None:
    """Save each distinct plan under ``tmp`` (``row.path``); a row whose plan
    equals an earlier row's names that row (``row.same_as``) instead."""
    seen: dict[str, Row] = {}
    for i, row in enumerate(rows):
        if row.plan is None:
            continue
        row.signature = plan_signature(row.plan)
        if row.signature in seen:
            row.same_as = seen[row.signature].label
            continue
        seen[row.signature] = row
        row.path = os.path.join(tmp, f"plan{i}.json")
        row.plan.save(row.path)


def _run_distinct(rows: list[Row], steps: int, warmup: int, rounds: int) -> None:
    """Run every saved plan, all of them once per round (so that a slower
    hour of the machine falls on every plan alike); duplicates share the
    measurement of the plan they equal."""
    for k in range(rounds):
        for row in rows:
            if row.path is None or row.error:
                continue
            print(f"round {k + 1}/{rounds}: running {row.label} ...", flush=True)
            run_row(row, steps, warmup, timeout_s=300.0)
    for row in rows:
        if row.same_as is not None:
            twin = next(r for r in rows if r.signature == row.signature and r.same_as is None)
            row.result = dict(twin.result)


def _plan_record(r: Row) -> dict[str, Any]:
    """One row of the result's ``plans``: the case, the plan's mesh and prediction, the run."""
    d: dict[str, Any] = {"model": r.case.model, "batch_size": r.case.batch_size, "ranks": r.case.ranks,
                         "name": r.name, "config": r.config, "plan_s": r.plan_s}
    if r.plan is not None:
        d["mesh"] = list(r.plan.mesh_shape)
        d["predicted"] = r.plan.predicted
        d["signature"] = r.signature
    if r.same_as:
        d["same_as"] = r.same_as
    if r.error:
        d["error"] = r.error
    d.update(r.result)
    return d


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.output is None:
        args.output = os.path.join(RESULTS, "measured_compiled.json" if args.compile
                                   else "measured.json")
    if args.quick:
        args.steps, args.rounds = min(args.steps, 4), 1

    t_start = time.perf_counter()
    load_before, speed_before = load_average(), torch_speed_probe()
    cases = [replace(c, recipes=tuple(r for r in c.recipes
                                      if args.recipes is None or r in args.recipes),
                     megatron=c.megatron and not args.no_megatron)
             for c in (QUICK_CASES if args.quick else CASES) if c.ranks in args.worlds
             and (args.models is None or c.model in args.models)]
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="measured-") as tmp:
        try:
            profiles = get_profiles(sorted(set(args.worlds)), args.profile, args.quick, tmp)
        except (ProfileError, OSError, json.JSONDecodeError) as err:
            print(f"measured: error: {err}", file=sys.stderr)
            return 1
        t_plan = time.perf_counter()
        for case in cases:
            cluster = Cluster.from_dict(profiles[case.ranks]["cluster"])
            rows += make_plans(case, cluster, args.time_limit, args.compile)
        planning_s = time.perf_counter() - t_plan
        _save_distinct(rows, tmp)
        t_run = time.perf_counter()
        _run_distinct(rows, args.steps, args.warmup, args.rounds)
        versus = auto_vs_best(rows)
        auto_against_best(rows, versus, args.steps, args.warmup, args.pairs)
        running_s = time.perf_counter() - t_run

    plans_out = [_plan_record(r) for r in rows]
    result = {
        "benchmark": "measured",
        "machine": machine_block(load_before, speed_before=speed_before),
        "profiles": {str(w): {"source": p["source"], "ranks": p["ranks"], "device": p["device"],
                              "created": p.get("created"), "quick": p.get("quick"), "wall_s": p.get("wall_s"),
                              "cluster": p["cluster"]}
                     for w, p in sorted(profiles.items())},
        "method": {"recipes": {k: {o: list(v) if isinstance(v, tuple) else v for o, v in opts.items()}
                               for k, opts in RECIPES.items()},
                   "megatron": "planner.baselines.megatron.megatron_plan of every megatron_configs",
                   "steps": args.steps, "warmup_steps_dropped": args.warmup, "rounds": args.rounds,
                   "statistic": "median over rounds of each launch's median step",
                   "pairs": args.pairs,
                   "launch": "training.launch.launch(plan, steps, check=True)",
                   "compiled": args.compile,
                   "predicted": "plan.predicted['step_time_s'] on the profiled cluster",
                   "spearman_and_mape_over": "distinct plans (identical plans run once)"},
        "summary": summarize(rows),
        "auto_vs_best": versus,
        "plans": plans_out,
        "planning_s": planning_s,
        "running_s": running_s,
        "wall_s": time.perf_counter() - t_start,
    }
    write_results(args.output, result)
    draw_scatter(result, os.path.splitext(args.output)[0] + ".png")
    print_report(result)
    print("\n" + wrote_message(args.output, result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
