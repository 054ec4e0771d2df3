"""Execution overhead of the generated program against a hand-written DTensor program.

    python -m benchmarks.exec_overhead                 # gpt-tiny, tp=2 on 2 ranks and tp=4 on 4 ranks
    python -m benchmarks.exec_overhead --worlds 2 --repeats 1 --steps 6    # quicker

For one Megatron tensor-parallel configuration (tp = world size, no data
parallelism) of the same model and batch:

* *generated*: ``planner.baselines.megatron.megatron_plan`` run by the code generator
  (``training.launch.launch``: torchrun, ``training.job``, the plan's
  placements and explicit redistributes);
* *hand-written*: ``benchmarks/handwritten_tp.py``, the same layout written with
  ``parallelize_module`` (ColwiseParallel / RowwiseParallel, vocabulary-parallel
  embedding and loss), launched the same way (torchrun, ``OMP_NUM_THREADS=1``);
* for reference, the plain one-process step on one thread (no DTensor at all).

Each launch trains ``--steps`` steps; the first is dropped as warm-up and the
median of the rest is its step time. The two programs are launched alternately
``--repeats`` times (load on a shared machine drifts) and the step time of each
is the median over all its kept steps. Both check step 1 against one process.
Reports the ratio generated / hand-written (1.0 = no overhead) per world size
and writes ``benchmarks/results/exec_overhead.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.common import load_average, machine_block, write_results, wrote_message  # noqa: E402
from training.launch import launch  # noqa: E402
from training.torchrun import LaunchError, end_group, output_tail  # noqa: E402
from costmodel.presets import load_cluster  # noqa: E402
from models.source import build_model  # noqa: E402
from planner.baselines.megatron import MegatronConfig, megatron_plan  # noqa: E402

RESULTS = os.path.join(HERE, "results")


def run_handwritten(model: str, batch_size: int, world: int, steps: int, check: bool,
                    timeout_s: float = 300.0) -> dict[str, Any]:
    """Launch benchmarks/handwritten_tp.py on ``world`` ranks; rank 0's result dict."""
    with tempfile.TemporaryDirectory(prefix="handwritten-") as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
               os.path.join(HERE, "handwritten_tp.py"), "--model", model, "--batch-size", str(batch_size),
               "--steps", str(steps), "--result-json", out] + (["--check"] if check else [])
        env = dict(os.environ, OMP_NUM_THREADS="1")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH", "")) if p)
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        try:
            stdout, stderr = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            end_group(proc)
            raise LaunchError(f"handwritten_tp on {world} ranks did not finish in {timeout_s:.0f} s") from None
        except BaseException:
            end_group(proc)
            raise
        if not os.path.exists(out):
            raise LaunchError(f"handwritten_tp on {world} ranks exited with {proc.returncode} and no result:\n"
                              f"{output_tail(stdout + stderr)}")
        with open(out) as f:
            return json.load(f)


def single_process_step(model_name: str, batch_size: int, steps: int, warmup: int) -> float:
    """Median step time of the plain model on one process and one thread (no DTensor)."""
    import torch

    from training.reference import make_optimizer

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, inputs = build_model(model_name, device="cpu", seed=0, batch_size=batch_size)
        opt = make_optimizer(model.parameters(), "sgd", 1e-3)
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            loss = model(*inputs)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            float(loss.detach())
            times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    return statistics.median(times[warmup:])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt-tiny")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--steps", type=int, default=10, help="steps per launch (default 10)")
    ap.add_argument("--warmup", type=int, default=1, help="leading steps dropped per launch (default 1)")
    ap.add_argument("--repeats", type=int, default=2, help="launches of each program (default 2)")
    ap.add_argument("--cluster", default="local-cpu:{n}",
                    help="cluster the Megatron plan is priced on ({n}: world size; default local-cpu:{n})")
    ap.add_argument("-o", "--output", default=os.path.join(RESULTS, "exec_overhead.json"))
    args = ap.parse_args(argv)

    t_start = time.perf_counter()
    load_before = load_average()
    kw = {"batch_size": args.batch_size}
    worlds_out = []
    for world in args.worlds:
        cluster_spec = args.cluster.format(n=world)
        model, inputs = build_model(args.model, device="meta", **kw)
        cfg = MegatronConfig(tensor_model_parallel_size=world, data_parallel_size=1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            p = megatron_plan(model, load_cluster(cluster_spec), cfg, example_inputs=inputs,
                              model_source=args.model, zoo_kwargs=kw)
        gen_steps: list[float] = []
        hand_steps: list[float] = []
        launches = []
        with tempfile.TemporaryDirectory(prefix="exec-overhead-") as tmp:
            path = os.path.join(tmp, "plan.json")
            p.save(path)
            for rep in range(args.repeats):
                print(f"{world} ranks, repeat {rep + 1}: generated ...", flush=True)
                g = launch(path, steps=args.steps, check=True)
                print(f"{world} ranks, repeat {rep + 1}: hand-written ...", flush=True)
                h = run_handwritten(args.model, args.batch_size, world, args.steps, check=True)
                gen_steps += g["step_times_s"][args.warmup:]
                hand_steps += h["step_times_s"][args.warmup:]
                launches.append({
                    "generated": {"step_times_s": g["step_times_s"], "passed": g["passed"],
                                  "losses": g["losses"], "explicit_reshards": g["explicit_reshards"],
                                  "implicit_reshards": g.get("implicit_reshards")},
                    "handwritten": {"step_times_s": h["step_times_s"], "passed": h.get("passed"),
                                    "losses": h["losses"]},
                })
        gen, hand = statistics.median(gen_steps), statistics.median(hand_steps)
        worlds_out.append({
            "ranks": world, "config": cfg.label(), "mesh": list(p.mesh_shape), "cluster": cluster_spec,
            "plan_reshards": len(p.reshards), "predicted_step_s": p.predicted["step_time_s"],
            "generated_step_s": gen, "handwritten_step_s": hand, "ratio_generated_over_handwritten": gen / hand,
            "both_checks_passed": all(x["generated"]["passed"] and x["handwritten"]["passed"] for x in launches),
            "handwritten_parameters": h.get("parameters"),
            "launches": launches,
        })
        print(f"{world} ranks: generated {gen * 1e3:.1f} ms, hand-written {hand * 1e3:.1f} ms, "
              f"ratio {gen / hand:.2f}", flush=True)
    single = single_process_step(args.model, args.batch_size, args.steps, args.warmup)
    result = {
        "benchmark": "exec_overhead",
        "machine": machine_block(load_before),
        "model": args.model, "batch_size": args.batch_size,
        "method": {"steps_per_launch": args.steps, "warmup_steps_dropped": args.warmup,
                   "repeats": args.repeats, "statistic": "median over all kept steps of all launches",
                   "generated": "training.launch.launch(megatron_plan tp=world dp=1, check=True)",
                   "handwritten": "benchmarks/handwritten_tp.py (parallelize_module) under torchrun"},
        "single_process_step_s": single,
        "worlds": worlds_out,
        "wall_s": time.perf_counter() - t_start,
    }
    write_results(args.output, result)
    print(f"\n{'ranks':<7}{'config':<26}{'generated':>11}{'hand-written':>14}{'ratio':>8}  checks")
    for w in worlds_out:
        print(f"{w['ranks']:<7}{w['config']:<26}{w['generated_step_s'] * 1e3:>9.1f}ms"
              f"{w['handwritten_step_s'] * 1e3:>12.1f}ms{w['ratio_generated_over_handwritten']:>8.2f}  "
              f"{'ok' if w['both_checks_passed'] else 'FAILED'}")
    print(f"one process, one thread, plain PyTorch: {single * 1e3:.1f} ms")
    print("\n" + wrote_message(args.output, result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
