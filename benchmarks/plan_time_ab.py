"""Planning time of two checkouts, side by side in alternating runs.

A restructuring must not slow planning down. This runs
``benchmarks/plan_identity.py`` for the same cases in checkout A (the code
before) and checkout B (after), alternating A, B, A, B, ... so that a change of
load on a shared machine falls on both, and writes each plan's seconds per
run and their medians to ``benchmarks/results/plan_time_ab.json``. It also
checks that both checkouts wrote the same bytes.

    git worktree add /tmp/before <commit>
    python -m benchmarks.plan_time_ab --a /tmp/before --b . \\
        --cases llama3-8b-h100x8 gpt3-175b-a100x1024 --rounds 2

Checkout A needs ``benchmarks/plan_identity.py``; the script copies B's there
when A lacks it (and imports the command line from ``planner.cli`` when A has
no ``app`` package).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import git_commit, load_average, machine_info, write_results  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results", "plan_time_ab.json")


def _ready(tree: str) -> None:
    """Give checkout ``tree`` this checkout's plan_identity script if it has none."""
    target = os.path.join(tree, "benchmarks", "plan_identity.py")
    if os.path.exists(target):
        return
    shutil.copy(os.path.join(HERE, "plan_identity.py"), target)
    if not os.path.isdir(os.path.join(tree, "app")):
        with open(target) as f:
            text = f.read()
        with open(target, "w") as f:
            f.write(text.replace("from app.cli import", "from planner.cli import"))


def _run(tree: str, cases: list[str], out: str) -> dict[str, dict]:
    """plan_identity in ``tree`` (its own code first on the path): name -> plan_s, sha256."""
    env = {**os.environ, "PYTHONPATH": tree, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-m", "benchmarks.plan_identity", "--out", out,
                    "--cases", *cases], cwd=tree, env=env, check=True,
                   stdout=subprocess.DEVNULL)
    with open(os.path.join(out, "manifest.json")) as f:
        return json.load(f)["plans"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--a", required=True, help="checkout of the code before")
    ap.add_argument("--b", required=True, help="checkout of the code after")
    ap.add_argument("--cases", nargs="+", required=True, help="plan_identity case words")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=RESULTS)
    args = ap.parse_args(argv)
    trees = {"a": os.path.abspath(args.a), "b": os.path.abspath(args.b)}
    for tree in trees.values():
        _ready(tree)
    seconds: dict[str, dict[str, list[float]]] = {}
    digests: dict[str, dict[str, str]] = {"a": {}, "b": {}}
    loads = []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        for r in range(args.rounds):
            for side, tree in trees.items():
                loads.append(load_average())
                plans = _run(tree, args.cases, os.path.join(scratch, f"{side}{r}"))
                for name, rec in plans.items():
                    seconds.setdefault(name, {"a": [], "b": []})[side].append(rec["plan_s"])
                    digests[side][name] = rec["sha256"]
                print(f"round {r + 1} {side}: " + ", ".join(
                    f"{n} {p['plan_s']} s" for n, p in sorted(plans.items())), flush=True)
    result = {
        "machine": machine_info(brief=True), "load_average_before_each_run": loads,
        "a": {"tree": trees["a"], "commit": git_commit(trees["a"])},
        "b": {"tree": trees["b"], "commit": git_commit(trees["b"])},
        "cases": args.cases, "rounds": args.rounds,
        "plan_s": {n: {**s, "median_a": statistics.median(s["a"]),
                       "median_b": statistics.median(s["b"])} for n, s in sorted(seconds.items())},
        "identical": sorted(n for n in digests["b"] if digests["a"].get(n) == digests["b"][n]),
        "different": sorted(n for n in digests["b"] if digests["a"].get(n) != digests["b"][n]),
        "wall_s": time.perf_counter() - t0,
    }
    write_results(args.out, result)
    for name, s in result["plan_s"].items():
        print(f"{name}: median A {s['median_a']:.2f} s, B {s['median_b']:.2f} s")
    return 1 if result["different"] else 0


if __name__ == "__main__":
    sys.exit(main())
