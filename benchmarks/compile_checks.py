"""Compiled plans on CPU ranks: ``planner run --check --compile`` over plan kinds, and
the compiled step against the eager one.

    OMP_NUM_THREADS=1 python -m benchmarks.compile_checks            # writes results JSON
    OMP_NUM_THREADS=1 python -m benchmarks.compile_checks --cases 2x2

For each case a plan is made with ``planner plan`` and run twice by
:func:`training.launch.launch` (``planner run``'s job): compiled with
``--check`` (loss and gradients of every step against one eager process, the
placements against the plan), and eager, for the step time. It records
whether the check passed, its errors, the compile lines the ranks printed
(each region's compile time, or why it runs eager) and the last step's time
of each run (seconds; on a shared machine only a rough comparison).

Writes ``benchmarks/results/compile_checks.json`` (a run of some cases keeps the others').
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time
from typing import Any

from benchmarks.common import check_fields, machine_info, read_results, write_results

DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                           "compile_checks.json")
#: name -> ``planner plan`` arguments (besides -o)
CASES: dict[str, list[str]] = {
    "gpt-tiny-dp2": ["--model", "gpt-tiny", "--cluster", "local-cpu:2", "--mesh", "2"],
    "gpt-tiny-2x2": ["--model", "gpt-tiny", "--cluster", "local-cpu:4", "--mesh", "2x2"],
    "llama-tiny-bf16-mixed-2": ["--model", "llama-tiny", "--cluster", "local-cpu:2", "--mesh",
                                "2", "--precision", "bf16-mixed"],
    "moe-tiny-2": ["--model", "moe-tiny", "--cluster", "local-cpu:2", "--mesh", "2"],
    "gpt-tiny-zero3-2": ["--model", "gpt-tiny", "--cluster", "local-cpu:2", "--mesh", "2",
                         "--zero", "3"],
    "hf-llama-2": ["--model", "hf:llama,num_hidden_layers=2,hidden_size=64,intermediate_size=128,"
                   "num_attention_heads=4,num_key_value_heads=2,vocab_size=128,"
                   "max_position_embeddings=64", "--cluster", "local-cpu:2", "--mesh", "2",
                   "--batch-size", "4", "--seq-len", "16"],
    "gpt-tiny-pp2-1f1b": ["--model", "gpt-tiny", "--cluster", "local-cpu:2", "--pp", "2",
                          "--schedule", "1f1b"],
    "gpt-tiny-pp2-zbv": ["--model", "gpt-tiny", "--cluster", "local-cpu:2", "--pp", "2",
                         "--schedule", "zbv"],
    "llama-tiny-cp2": ["--model", "llama-tiny", "--cluster", "local-cpu:2", "--cp", "2"],
    "gpt-tiny-cp2": ["--model", "gpt-tiny", "--cluster", "local-cpu:2", "--cp", "2"],
    "gpt-tiny-cp2-pp2": ["--model", "gpt-tiny", "--cluster", "local-cpu:4", "--cp", "2",
                         "--pp", "2", "--schedule", "1f1b"],
    "llama-tiny-cp2-zero3": ["--model", "llama-tiny", "--cluster", "local-cpu:2", "--cp", "2",
                             "--zero", "3"],
    "gpt-tiny-recompute-2": ["--model", "gpt-tiny", "--cluster", "local-cpu:2", "--mesh", "2",
                             "--recompute", "all"],
    "llama-tiny-recompute-1": ["--model", "llama-tiny", "--cluster", "local-cpu:1", "--mesh", "1",
                               "--recompute", "all"],
}


def _step_s(result: dict[str, Any]) -> float | None:
    times = result.get("step_times_s") or []
    return float(times[-1]) if times else None


def _one_case(name: str, args: list[str], folder: str, steps: int) -> dict[str, Any]:
    from app.cli import main as cli_main
    from training.launch import launch

    path = os.path.join(folder, f"{name}.json")
    if cli_main(["plan", *args, "--compile", "--quiet", "-o", path]) != 0:
        return {"case": name, "error": "planner plan failed"}
    t0 = time.perf_counter()
    compiled = launch(path, check=True, steps=steps, timeout_s=1200)
    compiled_wall = time.perf_counter() - t0
    eager = launch(path, steps=steps, timeout_s=600, compile=False)
    output = compiled.get("output", "")
    return {"case": name, "plan_args": args, **check_fields(compiled),
            "compile_lines": re.findall(r"^compile: .*$", output, flags=re.M),
            "eager_step_s": _step_s(eager), "compiled_run_wall_s": compiled_wall,
            "steps": steps}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="*", help="only cases whose name contains one of these")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory(prefix="compile-checks-") as folder:
        for name, plan_args in CASES.items():
            if args.cases and not any(w in name for w in args.cases):
                continue
            try:
                r = _one_case(name, plan_args, folder, args.steps)
            except Exception as err:  # noqa: BLE001 - recorded, the next case runs
                r = {"case": name, "error": f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"}
            print(r, flush=True)
            results.append(r)
    import torch

    ran = {r["case"] for r in results}
    kept = [r for r in read_results(args.out).get("cases", []) if r["case"] not in ran]
    order = list(CASES)
    merged = sorted(kept + results, key=lambda r: order.index(r["case"])
                    if r["case"] in order else len(order))
    write_results(args.out, {"benchmark": "compile_checks", "torch": torch.__version__,
                             "machine": machine_info(brief=True), "cases": merged})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
