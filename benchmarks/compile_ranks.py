"""A compiled multi-rank step against an eager one, and this runtime against
an earlier checkout of it: does compiling pay on several ranks?

    python -m benchmarks.compile_ranks                       # llama-tiny, gpt-tiny on local-cpu:2
    python -m benchmarks.compile_ranks --before /tmp/old-checkout --rounds 2
    python -m benchmarks.compile_ranks --models llama-tiny --plans dp --steps 6

Plans each ``--models`` model on ``local-cpu:RANKS`` twice with ``--compile``
pricing: the plan the search picks (``auto``) and plain data parallelism
(``dp``, ``--mesh RANKS``). Each plan runs through ``planner run``'s
launcher (``training.launch.launch``) compiled and eager, from this checkout
(``after``) and, with ``--before``, from another checkout of the project
(``before``: its own ``training`` and ``codegen``, in a process started in
it), in alternating rounds. A run's first step is dropped (it compiles).
Writes ``benchmarks/results/compile_ranks.json``: per plan and variant the
step times, their median and the load average when each run started.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import (RESULTS_DIR, git_commit, load_average, machine_block,  # noqa: E402
                               write_results, wrote_message)
from benchmarks.stats import median_after_warmup  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: What one variant's process runs in its checkout: the launcher, rank 0's step times out.
_RUN = ("import json, sys; from training.launch import launch; "
        "r = launch(sys.argv[1], steps=int(sys.argv[2]), check=False, "
        "compile=sys.argv[3] == 'compiled', timeout_s=1500); "
        "print('STEPS ' + json.dumps(r['step_times_s']))")


def _make_plans(models: list[str], kinds: list[str], ranks: int, batch: int, folder: str
                ) -> dict[str, dict[str, Any]]:
    """plan name -> its path and layout, planned with compiled pricing."""
    from models.source import build_model
    from planner.api import plan

    out = {}
    for name in models:
        model, inputs = build_model(name, device="meta", batch_size=batch)
        for kind in kinds:
            kw: dict[str, Any] = dict(example_inputs=inputs, model_source=name, compile=True,
                                      zoo_kwargs={"batch_size": batch})
            if kind == "dp":
                kw["mesh_shape"] = (ranks,)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                made = plan(model, f"local-cpu:{ranks}", **kw)
            path = os.path.join(folder, f"{name}-{kind}.json")
            made.save(path)
            pipe = made.pipeline
            out[f"{name} {kind}"] = {
                "path": path, "mesh": list(made.mesh_shape),
                "microbatches": pipe.num_microbatches if pipe is not None else 1,
                "zero_stage": pipe.zero_stage if pipe is not None else 0,
                "predicted_s": made.predicted["step_time_s"]}
    return out


def _run(tree: str, plan_path: str, steps: int, mode: str) -> list[float]:
    """Rank 0's step times of ``plan_path`` run ``mode`` from checkout ``tree``."""
    env = {**os.environ, "PYTHONPATH": tree, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", _RUN, plan_path, str(steps), mode], cwd=tree,
                          env=env, capture_output=True, text=True, timeout=1800)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("STEPS ")), None)
    if proc.returncode or line is None:
        raise RuntimeError(f"{mode} run of {plan_path} from {tree} failed:\n"
                           f"{(proc.stdout + proc.stderr)[-3000:]}")
    return json.loads(line[len("STEPS "):])


def _summary(rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per plan: compiled over eager (each tree), after over before (each mode)."""
    out: dict[str, Any] = {}
    for name, row in rows.items():
        med = {k: v["median_s"] for k, v in row["variants"].items()}
        entry = {f"compiled_over_eager_{tree}": med[f"{tree} compiled"] / med[f"{tree} eager"]
                 for tree in ("after", "before") if f"{tree} compiled" in med}
        for mode in ("compiled", "eager"):
            if f"before {mode}" in med:
                entry[f"{mode}_after_over_before"] = med[f"after {mode}"] / med[f"before {mode}"]
        out[name] = entry
    return out


def _result(args: argparse.Namespace, argv: list[str] | None, trees: dict[str, str],
            rows: dict[str, dict[str, Any]], load_before: Any, t0: float, done: bool
            ) -> dict[str, Any]:
    """The result JSON so far (``complete`` once every run is in)."""
    for row in rows.values():
        for variant in row["variants"].values():
            variant["median_s"] = (median_after_warmup(variant["steps_s"], 0)
                                   if variant["steps_s"] else None)
    summary = _summary({k: r for k, r in rows.items()
                        if all(v["median_s"] for v in r["variants"].values())})
    return {"benchmark": "compile_ranks",
            "command": "python -m benchmarks.compile_ranks " + " ".join(argv or sys.argv[1:]),
            "complete": done, "machine": machine_block(load_before, after=True),
            "trees": {t: {"path": p, "commit": git_commit(p)} for t, p in trees.items()},
            "cluster": f"local-cpu:{args.ranks}", "batch_size": args.batch_size,
            "steps_per_run": args.steps, "rounds": args.rounds,
            "statistic": "median step time over the runs' steps, each run's first dropped",
            "plans": rows, "summary": summary, "wall_s": time.perf_counter() - t0}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["llama-tiny", "gpt-tiny"])
    ap.add_argument("--plans", nargs="+", default=["auto", "dp"], choices=("auto", "dp"))
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--steps", type=int, default=8, help="steps per run (the first is dropped)")
    ap.add_argument("--rounds", type=int, default=2, help="alternating runs of each variant")
    ap.add_argument("--before", help="another checkout of the project to run as 'before'")
    ap.add_argument("-o", "--output", default=os.path.join(RESULTS_DIR, "compile_ranks.json"))
    args = ap.parse_args(argv)
    t0, load_before = time.perf_counter(), load_average()
    trees = {"after": ROOT}
    if args.before:
        trees["before"] = os.path.abspath(args.before)
    rows: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="compile-ranks-") as tmp:
        plans = _make_plans(args.models, args.plans, args.ranks, args.batch_size, tmp)
        for name, info in plans.items():
            rows[name] = {k: v for k, v in info.items() if k != "path"}
            rows[name]["variants"] = {f"{t} {m}": {"steps_s": [], "runs": []}
                                      for t in trees for m in ("compiled", "eager")}
        for r in range(args.rounds):
            order = [(t, m) for t in trees for m in ("compiled", "eager")]
            for name, info in plans.items():
                for tree, mode in (order if r % 2 == 0 else order[::-1]):
                    load = load_average()
                    steps = _run(trees[tree], info["path"], args.steps, mode)
                    variant = rows[name]["variants"][f"{tree} {mode}"]
                    variant["steps_s"] += steps[1:]
                    variant["runs"].append({"round": r, "loadavg": load,
                                            "first_step_s": steps[0]})
                    print(f"{name:16s} {tree:6s} {mode:8s} median "
                          f"{median_after_warmup(steps, 1) * 1e3:7.1f} ms  load {load}",
                          flush=True)
                    # written after every run: a long benchmark cut short keeps what it measured
                    write_results(args.output, _result(args, argv, trees, rows, load_before,
                                                       t0, False))
    result = _result(args, argv, trees, rows, load_before, t0, True)
    write_results(args.output, result)
    for name, entry in result["summary"].items():
        print(name, {k: round(v, 3) for k, v in entry.items()})
    print(wrote_message(args.output, result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
