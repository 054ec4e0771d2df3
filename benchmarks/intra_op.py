"""Intra-op ILP at scale: solve time, problem size before/after tying, solvers compared.

Writes ``benchmarks/results/intra_op.json`` with the machine it ran on. Targets
(issue 4): gpt3-175b on a (128, 8) mesh of dgx-a100-80g:128 < 10 s, llama3-70b on
(8, 8) of dgx-h100:8 < 5 s (intra-op pass only: strategies + pricing + solve; the
trace is reported separately).
"""

from __future__ import annotations

import argparse
import json
import os
import time

from benchmarks.plan_time import machine, timed_problem
from costmodel.cluster import load_cluster
from ir import trace
from ir.source import build_model
from planner.ilp import SOLVERS, solve
from planner.intra_op import build_problem

CASES = (
    ("gpt3-175b", "dgx-a100-80g:128", (128, 8), 10.0),
    ("llama3-70b", "dgx-h100:8", (8, 8), 5.0),
)


def run_case(name: str, cluster_spec: str, mesh_shape: tuple[int, ...], target_s: float,
             solvers: tuple[str, ...], time_limit_s: float) -> dict:
    model, inputs = build_model(name, device="meta")
    t0 = time.perf_counter()
    graph = trace(model, inputs)
    t1 = time.perf_counter()
    tied, cost, strategies, times = timed_problem(graph, load_cluster(cluster_spec), mesh_shape)
    untied = build_problem(cost, strategies, tie=False)
    before, after = untied.problem.size(), tied.problem.size()
    solves = {}
    for solver in solvers:
        s0 = time.perf_counter()
        try:
            sol = solve(tied.problem, solver=solver, time_limit_s=time_limit_s)
            solves[solver] = {"solve_s": time.perf_counter() - s0, "status": sol.status,
                              "objective_s": sol.objective_s, "gap": sol.gap}
        except Exception as err:  # noqa: BLE001 - recorded, the benchmark goes on
            solves[solver] = {"solve_s": time.perf_counter() - s0, "error": str(err)[:200]}
    default = solves[solvers[0]]
    intra_op_s = times["strategies_s"] + times["build_s"] + default["solve_s"]
    return {
        "model": name, "cluster": cluster_spec, "mesh": list(mesh_shape),
        "nodes": len(graph), "trace_s": t1 - t0, **times, "intra_op_s": intra_op_s, "target_s": target_s,
        "met_target": intra_op_s < target_s,
        "ilp_before_tying": {"variables": before[0], "constraints": before[1],
                             "decision_nodes": len(untied.problem.node_costs)},
        "ilp_after_tying": {"variables": after[0], "constraints": after[1],
                            "decision_nodes": len(tied.problem.node_costs)},
        "solvers": solves,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                      "intra_op.json"))
    parser.add_argument("--solvers", default=",".join(SOLVERS),
                        help="comma-separated OR-Tools backends; the first is the default")
    parser.add_argument("--time-limit", type=float, default=60.0)
    args = parser.parse_args()
    solvers = tuple(s.strip().upper() for s in args.solvers.split(","))
    results = {"machine": machine(), "cases": []}
    for name, cluster, mesh, target in CASES:
        r = run_case(name, cluster, mesh, target, solvers, args.time_limit)
        results["cases"].append(r)
        print(f"{name} on {cluster} mesh {mesh}: intra-op {r['intra_op_s']:.1f} s (target "
              f"{target:.0f} s; strategies {r['strategies_s']:.1f}, build {r['build_s']:.1f}, "
              f"solve {r['solvers'][solvers[0]]['solve_s']:.1f}); trace {r['trace_s']:.1f} s; "
              f"ILP {r['ilp_before_tying']['variables']} -> {r['ilp_after_tying']['variables']} "
              f"variables; solvers: " + ", ".join(
                  f"{k} {v['solve_s']:.2f} s {v.get('status', v.get('error', ''))}"
                  for k, v in r["solvers"].items()))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
