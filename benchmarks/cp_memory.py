"""A context-parallel stage's predicted peak memory against torch's own count.

    OMP_NUM_THREADS=1 python benchmarks/cp_memory.py      # ~2 min on 2 cores

The model: a 2-layer Llama (dim 256, 4 query and 2 key/value heads, FFN 688,
vocabulary 1024) at one sequence of 16,384 tokens, planned by the automatic
search on ``local-cpu:4`` with context parallel size 4 (``context_parallel=(4,)``,
one stage, fp32, Adam): each rank holds 4,096 tokens of the sequence, and ring
or all-gather attention over the other ranks' K/V (:mod:`codegen.context_parallel`).

Measured on 4 CPU ranks (torchrun, gloo): each rank runs the plan's program
(:func:`codegen.parallel_model.parallelize`, built as ``planner train`` builds
it), one untracked step (Adam's states exist from then on), then one step
under torch's ``torch.distributed._tools.mem_tracker.MemTracker`` (live tensor
storages, bytes), with the parameters, the optimizer and the batch registered
as held before the step. The measured peak is MemTracker's; the predicted one
is ``plan.predicted["memory_bytes_per_device"]["peak"]`` (the stage's peak
plus the exchange's K/V buffers). The must-show is within +-10 %.

Writes ``benchmarks/results/cp_memory.json`` (``-o``). Exit status 0 when
every rank is within 10 %, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "cp_memory.json")
WORLD = 4
CP = 4
SEQ = 16384
BOUND = 0.10
SOURCE = f"{os.path.abspath(__file__)}:make_model"


def _baseline() -> bool:
    """Whether this run is the baseline without cp (``--baseline``, passed to
    the ranks in the environment): the same per-rank program, data parallel."""
    return os.environ.get("CP_MEMORY_BASELINE") == "1"


def make_model(batch_size: int | None = None, seq_len: int | None = None) -> tuple:
    """The benchmark's Llama and one batch of ``batch_size`` sequences of
    ``seq_len`` tokens (a ``planner`` model factory): one sequence of
    :data:`SEQ` tokens, or for the baseline :data:`WORLD` sequences of
    ``SEQ / CP`` (each rank's tokens as many as under cp)."""
    batch_size = batch_size or (WORLD if _baseline() else 1)
    seq_len = seq_len or (SEQ // CP if _baseline() else SEQ)
    from models.zoo import build_from_config
    from models.zoo.llama import LlamaConfig

    cfg = LlamaConfig(n_layers=2, dim=256, n_heads=4, n_kv_heads=2, ffn_dim=688,
                      vocab_size=1024, max_seq_len=SEQ, rope_theta=10000.0)
    import torch

    # build_model calls a factory under ``with torch.device(...)``
    return build_from_config(cfg, device=torch.get_default_device(), batch_size=batch_size,
                             seq_len=seq_len)


def make_plan(path: str) -> dict[str, Any]:
    """Plan the model on the meta device with cp = :data:`CP`; returns what it predicts."""
    from planner.api import plan

    from models.source import build_model

    model, inputs = build_model(SOURCE, device="meta")
    cp = 1 if _baseline() else CP
    p = plan(model, f"local-cpu:{WORLD}", example_inputs=inputs, context_parallel=(cp,),
             pp=(1,), model_source=SOURCE, time_limit_s=10.0)
    p.save(path)
    return {"mesh_shape": list(p.mesh_shape),
            "context_parallel": p.training.get("context_parallel"),
            "memory_bytes_per_device": p.predicted["memory_bytes_per_device"],
            "exchange": p.predicted.get("context_parallel")}


def rank_main(plan_path: str, out_dir: str) -> None:
    """One rank: a step, then a step under MemTracker; writes rank_<r>.json."""
    import torch
    import torch.distributed as dist
    from torch.distributed._tools.mem_tracker import MemTracker

    from codegen.parallel_model import parallelize
    from models.source import build_model
    from plan.format import load_plan
    from benchmarks.common import training_step

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    plan = load_plan(plan_path)
    model, inputs = build_model(plan.model["source"], device="cpu", seed=0)
    pm = parallelize(plan, model, inputs)
    del model
    params = [p for _, p in pm.named_parameters()]
    opt = torch.optim.Adam(params, lr=1e-3)
    losses: list[float] = []
    step = training_step(pm, inputs, opt, losses)
    step()
    tracker = MemTracker()
    tracker.track_external(opt, *params, *inputs)
    dev = torch.device("cpu")

    def snap(kind: str = "current") -> dict[str, int]:
        return {getattr(k, "value", str(k)): int(v)
                for k, v in tracker.get_tracker_snapshot(kind).get(dev, {}).items()}

    with tracker:
        before = snap()
        step()
    row = {"rank": rank, "before_step": before, "peak": snap("peak"), "losses": losses}
    with open(os.path.join(out_dir, f"rank_{rank}.json"), "w") as f:
        json.dump(row, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank-main", nargs=2, metavar=("PLAN", "OUT_DIR"),
                        help=argparse.SUPPRESS)
    parser.add_argument("-o", "--output", default=RESULTS)
    parser.add_argument("--baseline", action="store_true",
                        help=f"the same per-rank program without cp: {WORLD} sequences of "
                             f"{SEQ // CP} tokens, data parallel (compare its ratio)")
    args = parser.parse_args(argv)
    if args.baseline:
        os.environ["CP_MEMORY_BASELINE"] = "1"
    if args.rank_main:
        rank_main(*args.rank_main)
        return 0
    from benchmarks.common import (git_commit, job_env, load_average, machine_block,
                                   write_results, wrote_message)

    load_before = load_average()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="cp-memory-") as workdir:
        plan_path = os.path.join(workdir, "plan.json")
        predicted = make_plan(plan_path)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={WORLD}", os.path.abspath(__file__), "--rank-main",
               plan_path, workdir]
        proc = subprocess.run(cmd, env=job_env(), capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            first = proc.stderr.find("Traceback")
            print(proc.stderr[max(first, 0):][:3000], file=sys.stderr)
            return 1
        ranks = [json.load(open(os.path.join(workdir, f"rank_{r}.json"))) for r in range(WORLD)]
    peak = predicted["memory_bytes_per_device"]["peak"]
    for r in ranks:
        r["measured_peak_bytes"] = r["peak"]["Total"]
        r["predicted_over_measured"] = peak / r["measured_peak_bytes"]
    ok = all(abs(r["predicted_over_measured"] - 1) <= BOUND for r in ranks)
    cp = predicted["context_parallel"] or {}
    print(f"cp={cp.get('size', 1)}, mesh {predicted['mesh_shape']}, exchange "
          f"{cp.get('comm_type')}: predicted peak {peak / 2**20:.1f} MiB")
    for r in ranks:
        print(f"  rank {r['rank']}: MemTracker peak {r['measured_peak_bytes'] / 2**20:.1f} MiB, "
              f"predicted / measured {r['predicted_over_measured']:.3f}, losses "
              f"{', '.join(f'{x:.4f}' for x in r['losses'])}")
    result = {"model": "2-layer Llama, dim 256, 4/2 heads, FFN 688, vocab 1024",
              "seq_len": SEQ, "cp": CP, "world": WORLD, "commit": git_commit(),
              "method": __doc__, "machine": machine_block(load_before, after=True),
              "predicted": predicted, "ranks": ranks, "bound": BOUND, "within_bound": ok,
              "wall_s": round(time.perf_counter() - t0, 1)}
    write_results(args.output, result)
    print(wrote_message(args.output, result))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
