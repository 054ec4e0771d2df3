"""How long starting a plan's ranks takes: the elastic agent in the launching
process (ranks forked from a preloaded forkserver, :mod:`training.local_agent`)
against torchrun (each rank a fresh interpreter).

The same ``planner run --check`` job of one plan, launched ``--rounds`` times each
way, alternating, in one process (so the forkserver is started once, as in a
test session or a long-lived launcher): the wall time of each launch. torchrun is run as a one-node job of the several-node path
(:class:`training.torchrun.Nodes` with one node), which starts it as before.

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.launch_time [--rounds 3]

writes ``benchmarks/results/launch_time.json``.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import RESULTS_DIR, load_average, machine_block, median, \
    write_results, wrote_message  # noqa: E402

CASES = {  # name -> (model, planner plan flags)
    "gpt8-pp2-tp2 (4 ranks)": ("tests/pipeline_model.py:gpt8", ["--cluster", "local-cpu:4",
                                                                  "--pp", "2", "--schedule",
                                                                  "1f1b", "--microbatches", "2"]),
    "gpt-tiny-dp2 (2 ranks)": ("gpt-tiny", ["--cluster", "local-cpu:2", "--mesh", "2"]),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _timed(launch_once) -> float:
    """Seconds one ``--check`` launch takes, wall clock."""
    start = time.perf_counter()
    result = launch_once()
    assert result["passed"], result["output"]
    return round(time.perf_counter() - start, 2)


def main() -> int:
    from app.cli import main as planner
    from training.launch import launch
    from training.torchrun import Nodes

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    load_before = load_average()
    started = time.perf_counter()
    cases = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (model, flags) in CASES.items():
            path = os.path.join(tmp, "plan.json")
            assert planner(["plan", "--model", model, *flags, "--quiet", "-o", path]) == 0
            runs: dict[str, list[float]] = {"elastic agent here": [], "torchrun": []}
            for _ in range(args.rounds):
                runs["elastic agent here"].append(_timed(lambda: launch(path, check=True)))
                nodes = Nodes(1, 0, "127.0.0.1", _free_port())
                runs["torchrun"].append(_timed(lambda: launch(path, check=True, nodes=nodes)))
            cases[name] = {
                way: {"launch_wall_s": rows, "median_wall_s": median(rows)}
                for way, rows in runs.items()}
            print(name, {w: c["median_wall_s"] for w, c in cases[name].items()}, flush=True)
    result = {"machine": machine_block(load_before), "rounds": args.rounds,
              "note": "the first elastic launch of the process also starts the forkserver, "
                      "which imports torch and the job once",
              "cases": cases, "wall_s": round(time.perf_counter() - started, 1)}
    path = os.path.join(RESULTS_DIR, "launch_time.json")
    write_results(path, result)
    print(wrote_message(path, result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
