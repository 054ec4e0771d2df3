"""``planner train --compile`` against eager: the loss curve, and compile time paid once.

    OMP_NUM_THREADS=1 python -m benchmarks.compile_train            # writes results JSON

One CPU rank, a plan of ``--model`` on one device, ``--steps`` steps of the
example batch at the default learning rate, every step logged:

1. eager (``compile=False``);
2. compiled, with a new ``--checkpoint-dir`` (its ``compile_cache`` starts
   empty: every graph is compiled);
3. compiled, resumed from 2.'s last save for ``--more`` steps: a restart, which
   reads the compiled graphs from that cache.

It records the largest difference between 1.'s and 2.'s loss at any step
(the goal: at most 1e-5), the compile lines each compiled run printed (the
region's first-call seconds and the graphs it found in the cache) and each
run's wall time. Writes ``benchmarks/results/compile_train.json``. Units: seconds.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import tempfile
import time
from typing import Any

from benchmarks.common import compile_lines, machine_info, write_results

DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                           "compile_train.json")


def _train(folder: str, name: str, plan: str, steps: int, **fields: Any) -> dict[str, Any]:
    """One ``planner train`` job; its losses by step, compile lines and wall time."""
    from training.config import TrainConfig
    from training.launch import train

    log = os.path.join(folder, f"{name}.jsonl")
    config = TrainConfig(plan=plan, steps=steps, log=log, log_every=1, **fields)
    t0 = time.perf_counter()
    outcome = train(config, out=io.StringIO())
    wall = time.perf_counter() - t0
    if outcome.returncode != 0:
        raise RuntimeError(f"{name}: {outcome.error}")
    lines = compile_lines(outcome.log_path)
    with open(log) as f:
        losses = {r["step"]: r["loss"] for r in map(json.loads, f)}
    return {"losses": losses, "compile_lines": lines, "wall_s": wall}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt-tiny")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--more", type=int, default=10)
    ap.add_argument("--out", default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    from app.cli import main as cli_main

    with tempfile.TemporaryDirectory(prefix="compile-train-") as folder:
        plan = os.path.join(folder, "plan.json")
        if cli_main(["plan", "--model", args.model, "--cluster", "local-cpu:1", "--mesh", "1",
                     "--quiet", "-o", plan]) != 0:
            raise SystemExit("planner plan failed")
        ckpt = os.path.join(folder, "ckpt")
        eager = _train(folder, "eager", plan, args.steps, compile=False)
        first = _train(folder, "compiled", plan, args.steps, compile=True, checkpoint_dir=ckpt,
                       save_every=args.steps)
        restart = _train(folder, "restart", plan, args.steps + args.more, compile=True,
                         checkpoint_dir=ckpt, resume=True)
    diffs = [abs(eager["losses"][s] - first["losses"][s]) for s in eager["losses"]]
    result = {"benchmark": "compile_train", "model": args.model, "steps": args.steps,
              "machine": machine_info(brief=True),
              "max_abs_loss_diff": max(diffs), "goal_max_abs_loss_diff": 1e-5,
              "final_loss": {"eager": eager["losses"][args.steps - 1],
                             "compiled": first["losses"][args.steps - 1]},
              "compile_lines": {"first_run": first["compile_lines"],
                                "restart": restart["compile_lines"]},
              "wall_s": {"eager": eager["wall_s"], "compiled": first["wall_s"],
                         "restart": restart["wall_s"]}}
    write_results(args.out, result)
    print(json.dumps({k: result[k] for k in ("max_abs_loss_diff", "final_loss", "compile_lines",
                                             "wall_s")}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
