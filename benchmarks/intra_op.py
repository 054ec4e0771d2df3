"""Intra-op ILP at scale: solve time, problem size before/after tying, solvers compared.

Writes ``benchmarks/results/intra_op.json`` with the machine it ran on. Targets
(issue 4): gpt3-175b on a (128, 8) mesh of dgx-a100-80g:128 < 10 s, llama3-70b on
(8, 8) of dgx-h100:8 < 5 s (intra-op pass only: strategies + pricing + solve; the
trace is reported separately). A 3-D case (gpt-tiny on a (2, 2, 2) mesh) measures
how large N-D meshes make the problem, also under a memory budget.

Sizes (variables, constraints) are those of the MIP: before tying (every node its
own variables), after tying, and after tying plus :func:`planner.ilp.solve.eliminate`
(what :func:`planner.ilp.solve.solve` builds), without and with the budget.
``--cases`` reruns some cases and keeps the others' recorded numbers.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time

from benchmarks.common import machine_info, read_results, write_results
from benchmarks.plan_time import timed_problem
from costmodel.presets import load_cluster
from ir import trace
from models.source import build_model
from planner.ilp.solve import SOLVERS, reduced_size, solve
from planner.ilp.intra_op import build_problem, least_memory

# (model, cluster, mesh, target seconds, budget fraction or None): the budgeted
# run gives least + fraction x (unconstrained - least) bytes per device.
CASES = (
    ("gpt3-175b", "dgx-a100-80g:128", (128, 8), 10.0, None),
    ("llama3-70b", "dgx-h100:8", (8, 8), 5.0, None),
    ("gpt-tiny", "dgx-a100-80g", (2, 2, 2), 10.0, 0.3),
)


def _size(problem, reduce: bool) -> dict:
    variables, constraints = reduced_size(problem) if reduce else problem.size()
    return {"variables": variables, "constraints": constraints}


def _solve(problem, solver: str, time_limit_s: float) -> dict:
    s0 = time.perf_counter()
    try:
        sol = solve(problem, solver=solver, time_limit_s=time_limit_s)
        return {"solve_s": time.perf_counter() - s0, "status": sol.status,
                "objective_s": sol.objective_s, "gap": sol.gap}
    except Exception as err:  # noqa: BLE001 - recorded, the benchmark goes on
        return {"solve_s": time.perf_counter() - s0, "error": str(err)[:200]}


def run_case(name: str, cluster_spec: str, mesh_shape: tuple[int, ...], target_s: float,
             solvers: tuple[str, ...], time_limit_s: float,
             budget_fraction: float | None = None) -> dict:
    model, inputs = build_model(name, device="meta")
    t0 = time.perf_counter()
    graph = trace(model, inputs)
    t1 = time.perf_counter()
    tied, cost, strategies, times = timed_problem(graph, load_cluster(cluster_spec), mesh_shape)
    untied = build_problem(cost, strategies, tie=False)
    before = untied.problem.size()
    solves = {solver: _solve(tied.problem, solver, time_limit_s) for solver in solvers}
    default = solves[solvers[0]]
    intra_op_s = times["strategies_s"] + times["build_s"] + default["solve_s"]
    out = {
        "model": name, "cluster": cluster_spec, "mesh": list(mesh_shape),
        "nodes": len(graph), "trace_s": t1 - t0, **times, "intra_op_s": intra_op_s, "target_s": target_s,
        "met_target": intra_op_s < target_s,
        "ilp_before_tying": {"variables": before[0], "constraints": before[1],
                             "decision_nodes": len(untied.problem.node_costs)},
        "ilp_after_tying": {**_size(tied.problem, reduce=False),
                            "decision_nodes": len(tied.problem.node_costs)},
        "ilp_after_elimination": _size(tied.problem, reduce=True),
        "solvers": solves,
    }
    if budget_fraction is not None and "error" not in default:
        unconstrained = solve(tied.problem, time_limit_s=time_limit_s)
        least = least_memory(tied.problem)
        most = tied.problem.memory(unconstrained.choice, unconstrained.checkpoint)
        budget = least + budget_fraction * (most - least)
        budgeted = dataclasses.replace(tied.problem, memory_budget=budget)
        out["budgeted"] = {
            "budget_fraction": budget_fraction, "memory_budget_bytes": budget,
            "least_bytes": least, "unconstrained_bytes": most,
            "ilp_after_tying": _size(budgeted, reduce=False),
            "ilp_after_elimination": _size(budgeted, reduce=True),
            "time_limit_s": time_limit_s, solvers[0]: _solve(budgeted, solvers[0], time_limit_s),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                      "intra_op.json"))
    parser.add_argument("--solvers", default=",".join(SOLVERS),
                        help="comma-separated OR-Tools backends; the first is the default")
    parser.add_argument("--time-limit", type=float, default=60.0)
    parser.add_argument("--cases", default=None,
                        help="comma-separated model names to rerun (default: all); the other "
                             "cases keep the numbers already in --out")
    args = parser.parse_args()
    solvers = tuple(s.strip().upper() for s in args.solvers.split(","))
    wanted = None if args.cases is None else {c.strip() for c in args.cases.split(",")}
    kept = [] if wanted is None else [c for c in read_results(args.out).get("cases", [])
                                      if c["model"] not in wanted]
    results = {"machine": machine_info(brief=True), "cases": kept}
    for name, cluster, mesh, target, fraction in CASES:
        if wanted is not None and name not in wanted:
            continue
        r = run_case(name, cluster, mesh, target, solvers, args.time_limit, fraction)
        results["cases"].append(r)
        print(f"{name} on {cluster} mesh {mesh}: intra-op {r['intra_op_s']:.1f} s (target "
              f"{target:.0f} s; strategies {r['strategies_s']:.1f}, build {r['build_s']:.1f}, "
              f"solve {r['solvers'][solvers[0]]['solve_s']:.1f}); trace {r['trace_s']:.1f} s; "
              f"ILP {r['ilp_before_tying']['variables']} -> {r['ilp_after_tying']['variables']} "
              f"-> {r['ilp_after_elimination']['variables']} variables; solvers: " + ", ".join(
                  f"{k} {v['solve_s']:.2f} s {v.get('status', v.get('error', ''))}"
                  for k, v in r["solvers"].items()))
        if "budgeted" in r:
            b = r["budgeted"]
            print(f"  budget {b['memory_budget_bytes']:.3g} B: ILP "
                  f"{b['ilp_after_tying']['variables']} -> {b['ilp_after_elimination']['variables']} "
                  f"variables; {solvers[0]}: {b[solvers[0]]}")
    order = [c[0] for c in CASES]
    results["cases"].sort(key=lambda c: order.index(c["model"]) if c["model"] in order else len(order))
    write_results(args.out, results)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
