"""Planning-time benchmark: trace time of a large model and ILP time for one block.

Writes ``benchmarks/results/plan_time.json`` with the machine it ran on.
Targets (issue 2): trace of gpt3-175b < 15 s; ILP for one gpt3-175b block on an
(8, 8) mesh < 5 s.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
import warnings

import torch

from costmodel.cluster import load_cluster
from ir import trace
from ir.source import build_model
from ir.zoo import GPTConfig, build_from_config, config
from planner.intra_op import IntraOpCost, build_problem
from planner.ilp import solve
from planner.strategies import build_strategies, fake_mesh


def machine() -> dict:
    return {"platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__, "cpus": os.cpu_count(),
            "processor": platform.processor() or platform.machine()}


def time_trace(name: str) -> dict:
    model, inputs = build_model(name, device="meta")
    t0 = time.perf_counter()
    graph = trace(model, inputs)
    return {"model": name, "trace_s": time.perf_counter() - t0, "nodes": len(graph),
            "parameters": graph.num_parameters}


def timed_problem(graph, cluster, mesh_shape: tuple[int, ...]):
    """Strategies and the (tied) intra-op problem of ``graph`` on ``mesh_shape``.

    Returns ``(problem, cost, strategies, {"strategies_s", "build_s"})`` (seconds).
    """
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with fake_mesh(mesh_shape) as mesh:
            strategies = build_strategies(graph, mesh)
    t1 = time.perf_counter()
    cost = IntraOpCost(graph, cluster, mesh_shape, "float32")
    built = build_problem(cost, strategies)
    t2 = time.perf_counter()
    return built, cost, strategies, {"strategies_s": t1 - t0, "build_s": t2 - t1}


def time_block_ilp(name: str, cluster_spec: str, mesh_shape: tuple[int, ...]) -> dict:
    cfg = config(name)
    one_block = GPTConfig(1, cfg.n_embd, cfg.n_head, vocab_size=cfg.vocab_size,
                          block_size=cfg.block_size)
    model, inputs = build_from_config(one_block, batch_size=mesh_shape[0] * 2)
    graph = trace(model, inputs)
    built, _, _, times = timed_problem(graph, load_cluster(cluster_spec), mesh_shape)
    t0 = time.perf_counter()
    solution = solve(built.problem, time_limit_s=60)
    solve_s = time.perf_counter() - t0
    return {"model": name, "block_layers": 1, "cluster": cluster_spec, "mesh": list(mesh_shape),
            **times, "solve_s": solve_s,
            "total_s": times["strategies_s"] + times["build_s"] + solve_s,
            "status": solution.status,
            "variables": solution.num_variables, "constraints": solution.num_constraints,
            "objective_s": solution.objective_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                      "plan_time.json"))
    parser.add_argument("--skip-trace", action="store_true", help="only the ILP benchmark")
    args = parser.parse_args()
    results = {"machine": machine(), "targets": {"trace_gpt3_175b_s": 15.0,
                                                 "ilp_block_8x8_s": 5.0}}
    if not args.skip_trace:
        results["trace"] = time_trace("gpt3-175b")
        print(f"trace gpt3-175b: {results['trace']['trace_s']:.1f} s, "
              f"{results['trace']['nodes']} nodes")
    results["ilp"] = time_block_ilp("gpt3-175b", "dgx-a100-80g:8", (8, 8))
    print(f"ILP one gpt3-175b block on (8, 8): {results['ilp']['total_s']:.1f} s "
          f"(strategies {results['ilp']['strategies_s']:.1f} s, build "
          f"{results['ilp']['build_s']:.1f} s, solve {results['ilp']['solve_s']:.1f} s)")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
