"""Megatron-LM's published runs (Narayanan et al., SC'21, Table 1) priced by the cost model.

    python benchmarks/published_megatron.py                 # all 10 rows, ~2 min
    python benchmarks/published_megatron.py --rows 1 2 3    # some rows
    python benchmarks/published_megatron.py --auto 1 2 3    # and the automatic plan of rows 1-3

Each row is priced exactly as published: the GPT-3-style model (sequence 2048,
vocabulary 51200) built on the meta device as Megatron-LM ran it in 2021
(``GPTConfig(attention="unfused", dropout=0.1)``: the s x s attention scores
materialised, dropout 0.1), on ``dgx-a100-80g`` nodes (A100 80 GB datasheet
figures, the same for every row), in fp16 mixed precision as published
(``fp16-mixed``: fp16 weights and gradients, gradients reduced in fp16; fp32
master weights, main gradients and Adam states in Megatron's optimizer: 20
bytes of state per parameter, Megatron-LM's own count,
:func:`costmodel.memory.training_state_bytes` at ZeRO stage 1 on one rank), with
Megatron's own choices: tensor, pipeline and data parallel sizes, micro-batch
size, the interleaved schedule where a row gives layers per virtual stage, full
recomputation (``--recompute-granularity full``) and plain DDP (no distributed
optimizer: gradients all-reduced once per step).

Predicted TFLOP/s per GPU = F / (predicted step seconds x GPUs), with the paper's
count of one iteration's work, recomputation included:
``F = 96 B s l h^2 (1 + s / (6 h) + V / (16 l h))``.

``--auto ROW ...`` also plans those rows automatically (``planner.plan``) on the
same cluster, batch and sequence, and prices the automatic plan's TFLOP/s by the
same F (the work the published configuration does), so that the two step
times compare directly.

Writes ``benchmarks/results/published_megatron.json`` (or ``--out``) and prints
the table. Exit status 0 when every row was priced, 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import load_average, machine_block, write_results, wrote_message

SEQ_LEN = 2048
VOCAB = 51200
DROPOUT = 0.1
# fp16 compute, fp32 master weights; Megatron's DDP reduced fp16 gradients in fp16
# (--accumulate-allreduce-grads-in-fp32 was off unless asked for)
PRECISION = ("fp16-mixed", "fp16")
GPUS_PER_NODE = 8
DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                           "published_megatron.json")


@dataclass(frozen=True)
class PublishedRun:
    """One row of Table 1 (Narayanan et al., SC'21): the model, Megatron's
    configuration and the measured throughput, TFLOP/s per GPU."""

    params_billion: float
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    global_batch: int
    micro_batch: int
    layers_per_virtual_stage: int | None
    tflops_per_gpu: float

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)

    @property
    def virtual_stages(self) -> int | None:
        """Model chunks per pipeline rank (interleaved schedule), None for plain 1F1B."""
        if self.layers_per_virtual_stage is None:
            return None
        v = self.layers // (self.pp * self.layers_per_virtual_stage)
        return v if v > 1 else None

    def iteration_flops(self) -> float:
        """The paper's FLOPs of one iteration (recomputation included)."""
        b, s, l, h, v = self.global_batch, SEQ_LEN, self.layers, self.hidden, VOCAB
        return 96.0 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))


#: Table 1 of Narayanan et al., SC'21, as published.
TABLE_1 = (
    PublishedRun(1.7, 24, 2304, 24, 1, 1, 32, 512, 16, None, 137),
    PublishedRun(3.6, 32, 3072, 30, 2, 1, 64, 512, 16, None, 138),
    PublishedRun(7.5, 32, 4096, 36, 4, 1, 128, 512, 16, None, 142),
    PublishedRun(18.4, 48, 6144, 40, 8, 1, 256, 1024, 8, None, 135),
    PublishedRun(39.1, 64, 8192, 48, 8, 2, 512, 1536, 4, None, 138),
    PublishedRun(76.1, 80, 10240, 60, 8, 4, 1024, 1792, 2, 5, 140),
    PublishedRun(145.6, 96, 12288, 80, 8, 8, 1536, 2304, 2, 5, 148),
    PublishedRun(310.1, 128, 16384, 96, 8, 16, 1920, 2160, 1, 3, 155),
    PublishedRun(529.6, 128, 20480, 105, 8, 35, 2520, 2520, 1, 1, 163),
    PublishedRun(1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 1, None, 163),
)


def megatron_config(run: PublishedRun):
    """The row's Megatron-LM configuration, as it ran."""
    from planner.baselines.megatron import MegatronConfig

    return MegatronConfig(run.tp, run.dp, use_distributed_optimizer=False,
                          pipeline_model_parallel_size=run.pp,
                          virtual_pipeline_model_parallel_size=run.virtual_stages,
                          micro_batch_size=run.micro_batch, recompute_granularity="full")


def build_row(run: PublishedRun):
    """(model on meta, example inputs of the global batch, cluster)."""
    from costmodel.presets import load_cluster
    from models.zoo import GPTConfig, build_from_config

    cfg = GPTConfig(run.layers, run.hidden, run.heads, vocab_size=VOCAB, block_size=SEQ_LEN,
                    attention="unfused", dropout=DROPOUT)
    model, inputs = build_from_config(cfg, batch_size=run.global_batch, seq_len=SEQ_LEN)
    return model, inputs, load_cluster(f"dgx-a100-80g:{run.gpus // GPUS_PER_NODE}")


def _priced(plan, run: PublishedRun, seconds: float) -> dict[str, Any]:
    step = float(plan.predicted["step_time_s"])
    memory = plan.predicted["memory_bytes_per_device"]
    out = {"step_time_s": step,
           "tflops_per_gpu": run.iteration_flops() / (step * run.gpus) / 1e12,
           "breakdown_s": {k: v for k, v in plan.predicted.items()
                           if k.endswith("_s") and k != "step_time_s"},
           # a pipeline's: its fullest rank's stages, each at its own peak
           "peak_bytes_per_device": float(memory["peak"]),
           "memory_bytes_per_device": dict(memory),
           "planning_s": seconds}
    return out


def price_row(run: PublishedRun, auto: bool, time_limit_s: float) -> dict[str, Any]:
    """The row priced as published (and planned automatically with ``auto``)."""
    from ir.precision import get_precision
    from planner.api import plan
    from planner.baselines.compare import auto_label
    from planner.baselines.megatron import megatron_plan

    model, inputs, cluster = build_row(run)
    cfg = megatron_config(run)
    record: dict[str, Any] = {"row": {**run.__dict__}, "config": cfg.label(),
                              "published_tflops_per_gpu": run.tflops_per_gpu}
    start = time.monotonic()
    try:
        published = megatron_plan(model, cluster, cfg, example_inputs=inputs,
                                  time_limit_s=time_limit_s, precision=get_precision(*PRECISION))
        record["predicted"] = _priced(published, run, time.monotonic() - start)
        record["predicted"]["fits"] = (published.predicted["memory_bytes_per_device"]["total"]
                                       <= cluster.device.memory)
        record["error"] = record["predicted"]["tflops_per_gpu"] / run.tflops_per_gpu - 1
    except Exception as err:  # noqa: BLE001 - the row's failure is the result
        record["failed"] = f"{type(err).__name__}: {err}"
    if auto:
        start = time.monotonic()
        try:
            best = plan(model, cluster, example_inputs=inputs, time_limit_s=time_limit_s,
                        precision=get_precision(*PRECISION))
            record["auto"] = _priced(best, run, time.monotonic() - start)
            record["auto"]["plan"] = auto_label(best)
            record["auto"]["checkpointed_layers"] = len(best.checkpoint) + sum(
                len(st.checkpoint) for st in (best.pipeline.stages if best.pipeline else ()))
        except Exception as err:  # noqa: BLE001
            record["auto"] = {"failed": f"{type(err).__name__}: {err}"}
    return record


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| params | config | published TFLOP/s | predicted | error | peak GB | auto TFLOP/s "
             "| auto plan |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        p = r.get("predicted", {})
        auto = r.get("auto", {})
        lines.append(
            f"| {r['row']['params_billion']}B | {r['config']} | {r['published_tflops_per_gpu']:.0f} | "
            + (f"{p['tflops_per_gpu']:.1f} | {100 * r['error']:+.1f} % | "
               f"{p['peak_bytes_per_device'] / 1e9:.1f} | " if p else f"{r.get('failed')} | | | ")
            + (f"{auto['tflops_per_gpu']:.1f} | {auto['plan']} |" if "tflops_per_gpu" in auto
               else f"{auto.get('failed', '')} | |"))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="*", default=list(range(1, len(TABLE_1) + 1)),
                    help="rows of Table 1 to price (1-10; default all)")
    ap.add_argument("--auto", type=int, nargs="*", default=[],
                    help="rows to also plan automatically on the same cluster and batch")
    ap.add_argument("--time-limit", type=float, default=30.0, help="ILP time limit per solve, s")
    ap.add_argument("--out", default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    bad = [r for r in args.rows + args.auto if not 1 <= r <= len(TABLE_1)]
    if bad:
        print(f"error: row {bad[0]} is not in Table 1; give rows 1-{len(TABLE_1)}", file=sys.stderr)
        return 2
    load_before, start = load_average(), time.monotonic()
    rows = []
    for r in sorted(set(args.rows) | set(args.auto)):
        rows.append(price_row(TABLE_1[r - 1], r in args.auto, args.time_limit))
        print(table(rows[-1:]).splitlines()[-1], flush=True)
    return write_published(args.out, rows, {
        "machine": machine_block(load_before),
        "source": "Narayanan et al., Efficient Large-Scale Language Model Training on GPU "
                  "Clusters Using Megatron-LM, SC'21, Table 1",
        "cluster": "dgx-a100-80g (datasheet preset)"}, start, table)


def write_published(out: str, rows: list[dict[str, Any]], header: dict[str, Any],
                    start: float, table: Callable[[list[dict[str, Any]]], str]) -> int:
    """Write a published-runs check: ``header``, the rows, their mean and largest
    absolute error (a fraction) and the wall time since ``start`` (monotonic
    seconds); print the table and the errors. Exit status: 0 every row priced."""
    errors = [abs(r["error"]) for r in rows if "error" in r]
    result = {**header, "rows": rows,
              "mean_absolute_error": sum(errors) / len(errors) if errors else None,
              "max_absolute_error": max(errors) if errors else None,
              "wall_s": time.monotonic() - start}
    write_results(out, result)
    print(table(rows))
    if errors:
        print(f"mean |error| {100 * result['mean_absolute_error']:.1f} %, "
              f"max {100 * result['max_absolute_error']:.1f} %")
    print(wrote_message(out, result))
    return 0 if len(errors) == len(rows) else 1

if __name__ == "__main__":
    sys.exit(main())
