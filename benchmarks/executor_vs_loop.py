"""The executor's step time over a plain eager loop of the same model, on one CPU rank.

    OMP_NUM_THREADS=1 python -m benchmarks.executor_vs_loop            # writes results JSON
    OMP_NUM_THREADS=1 python -m benchmarks.executor_vs_loop --quick    # gpt-tiny only

For each model and precision: a plan for one device (``planner.plan(mesh_shape=(1,))``),
run by :class:`codegen.executor.PlanExecutor` (what ``planner run`` runs on each
rank: the captured program, the plan's checkpointing and precision), against
:class:`benchmarks.plain_loop.PlainLoop` (the model's own forward, the same
precision, the plan's checkpointed layers; one case plans with every layer
checkpointed, ``recompute=True``). Both train with AdamW (foreach),
gradients set to None after each step, in this one process (a gloo group of one
rank), on one thread. Their steps alternate (``--rounds`` rounds of ``--steps``
steps each, after warm-up) so that load elsewhere on the machine falls on both
alike; each one's step time is the median of its steps. The goal is a ratio
(executor / plain loop) of at most 1.15.

Writes ``benchmarks/results/executor_vs_loop.json``. Units: seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import Any, Callable

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.common import add_timing_args, time_alternating  # noqa: E402

DEFAULT_OUT = os.path.join(HERE, "results", "executor_vs_loop.json")
#: (zoo name, batch size, sequence length, precisions, recompute) measured by default
#: (bf16 runs emulated on this CPU, ~10x slower: the bigger model is measured in fp32
#: only). ``recompute``: the planner's choice (None), or every layer checkpointed (True).
CASES = [("gpt-tiny", 8, 32, ("fp32", "bf16-mixed"), None),
         ("llama-tiny", 8, 32, ("fp32", "bf16-mixed"), None),
         ("llama-tiny", 8, 32, ("fp32",), True),
         ("gpt2-small-4l", 4, 128, ("fp32",), None)]


def _model(name: str, batch: int, seq: int, device: str) -> tuple[Any, tuple]:
    from models import zoo
    from models.zoo.gpt import GPTConfig

    if name == "gpt2-small-4l":  # gpt2's width, 4 blocks: big enough for the kernels to matter
        cfg = GPTConfig(n_layer=4, n_embd=768, n_head=12, vocab_size=50304, block_size=seq)
        return zoo.build_from_config(cfg, batch_size=batch, seq_len=seq, device=device)
    return zoo.build(name, batch_size=batch, seq_len=seq, device=device)


def _plan(name: str, batch: int, seq: int, precision: str, recompute: bool | None) -> Any:
    """The one-device plan (made before the process group exists: the planner forks)."""
    from planner.api import plan

    meta_model, meta_inputs = _model(name, batch, seq, "meta")
    return plan(meta_model, "local-cpu:1", example_inputs=meta_inputs, mesh_shape=(1,),
                precision=precision, recompute=recompute, time_limit_s=10)


def executor_step(p: Any, name: str, batch: int, seq: int) -> tuple[Callable[[], None], Any]:
    """One AdamW training step of one-device plan ``p`` run by the executor (in
    this process's one-rank group), and the executor."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from codegen.executor import PlanExecutor
    from codegen.plan_model import loss_of

    torch.manual_seed(0)
    model, inputs = _model(name, batch, seq, "cpu")
    executor = PlanExecutor(p, model, inputs, init_device_mesh("cpu", (1,)))
    del model
    opt = torch.optim.AdamW(list(executor.parameters()), foreach=True)

    def step() -> None:
        loss_of(executor(*inputs)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step, executor


def _one_case(name: str, batch: int, seq: int, precision: str, p: Any,
              args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from benchmarks.plain_loop import PlainLoop

    one_executor_step, _ = executor_step(p, name, batch, seq)

    torch.manual_seed(0)
    loop_model, loop_inputs = _model(name, batch, seq, "cpu")
    loop = PlainLoop(loop_model, loop_inputs, precision=precision, checkpoint=p.checkpoint)

    timed = time_alternating({"executor": one_executor_step, "plain_loop": loop.step},
                             warmup=args.warmup, rounds=args.rounds, each=args.steps)
    executor_s = statistics.median(timed["executor"])
    loop_s = statistics.median(timed["plain_loop"])
    return {"model": name, "batch_size": batch, "seq_len": seq, "precision": precision,
            "checkpoint": list(p.checkpoint), "executor_step_s": executor_s,
            "plain_loop_step_s": loop_s, "ratio": executor_s / loop_s,
            "steps_each": len(timed["executor"])}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="gpt-tiny, fp32 and bf16-mixed")
    ap.add_argument("--precisions", nargs="+", default=None,
                    help="precisions to measure (default: each case's own)")
    add_timing_args(ap, steps=3, out=DEFAULT_OUT)
    args = ap.parse_args(argv)

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    cases = CASES[:1] if args.quick else CASES
    plans: dict[tuple[str, str, bool | None], Any] = {}
    for name, batch, seq, own, recompute in cases:
        for precision in args.precisions or own:
            try:
                plans[name, precision, recompute] = _plan(name, batch, seq, precision, recompute)
            except Exception as err:  # noqa: BLE001 - recorded below
                plans[name, precision, recompute] = err
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29571")
    dist.init_process_group("gloo", rank=0, world_size=1)
    results = []
    try:
        for name, batch, seq, own, recompute in cases:
            for precision in args.precisions or own:
                try:
                    made = plans[name, precision, recompute]
                    if isinstance(made, Exception):
                        raise made
                    r = _one_case(name, batch, seq, precision, made, args)
                except Exception as err:  # noqa: BLE001 - recorded, the next case runs
                    r = {"model": name, "precision": precision,
                         "error": f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"}
                results.append(r)
                if "error" in r:
                    print(f"{name:14s} {precision:10s} error: {r['error']}")
                else:
                    print(f"{name:14s} {precision:10s} executor {r['executor_step_s'] * 1e3:8.2f} ms"
                          f"  plain loop {r['plain_loop_step_s'] * 1e3:8.2f} ms  ratio "
                          f"{r['ratio']:.3f}  checkpointed {len(r['checkpoint'])}")
    finally:
        dist.destroy_process_group()
    out = {"benchmark": "executor_vs_loop", "torch": torch.__version__, "threads": 1,
           "goal_ratio": 1.15, "cases": results}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {args.out}")
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
