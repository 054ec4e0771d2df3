"""Llama 3 405B's published runs (Llama 3 paper, arXiv 2407.21783, Table 4) priced
by the cost model as the Megatron baseline runs them.

    python benchmarks/published_llama3.py                  # the 3 rows, ~4 min
    python benchmarks/published_llama3.py --rows 3         # the long-context row

Each row: ``llama3-405b`` (126 layers, hidden 16384, FFN 53248, 128 heads, 8 KV
heads, vocabulary 128256) on 8-GPU ``dgx-h100`` nodes (H100 80 GB, 400 Gb/s
network per GPU: the preset's datasheet figures), bf16 mixed precision with
gradients reduced in fp32 (the paper, section 3.3.4: fp32 gradient
accumulation and reduce-scatter), 16M tokens per step. As the paper ran it
(section 3.3.2), priced with what the Megatron baseline has:

* TP 8 (with Megatron's sequence parallelism), CP, PP 16 and DP as published;
  micro-batches of one sequence, ``batch per DP`` of them per step;
* the interleaved schedule with one layer per model chunk (v = 8 chunks per
  pipeline rank) and one layer fewer on the first and last stage: the first
  chunk holds the embedding alone, the last the head and loss alone
  (``pipeline_model_parallel_layout = (0, 1 x 126, 0)``). torch's
  ``ScheduleInterleaved1F1B`` (the order the cost model simulates) is the
  paper's flexible schedule: N = m / max(1, m // pp) micro-batches per round
  (Figure 6's N), so N = 16 in every row (m = 32 in row 1, 16 in rows 2-3).
  Each chunk is priced with its own micro-batches in flight at its rank's
  peak (the head chunk holds one at a time;
  ``planner.baselines.megatron_pipeline.stage_copies``);
* CP as Llama 3 ran it: K/V all-gathered over the cp group before attention
  (``cp_comm_type="all_gather"``), each rank two chunks (i and 2 cp - 1 - i);
* the paper's FSDP sharded optimizer states and gradients and kept the
  parameters gathered (no resharding after the forward); the Megatron
  baseline runs the distributed optimizer (ZeRO-1: states sharded over
  dp x cp, gradients reduce-scattered once per step): the same traffic per
  step, the gradients held whole rather than sharded;
* recomputation as the ILP decides under the memory budget. The paper ran the
  8K rows without activation checkpointing; the cost model's saved
  activations of one 405B layer (1.07 GB per 8,192-token micro-batch at
  tp 8) do not fit 16-31 micro-batches per chunk in 80 GB, so its plans
  recompute (see the results' ``recomputed_chunks``).

Device: the ``dgx-h100`` preset's memory (80 GB) and links (NVLink 450 GB/s
per direction, 400 Gb/s network per GPU: datasheet figures), with the
compute of one H100 80GB HBM3 as ``planner profile`` measured it
(``benchmarks/results/gpu/h100_profile_2026-11-27.json``, made by
``benchmarks/gpu_single.py``, torch 2.11: bf16 GEMMs up to 814 TFLOP/s,
half-saturated at 3.4 GFLOP; causal SDPA (flash) forward + backward at 0.51
of that, 415 TFLOP/s; HBM 3.0 TB/s). The preset's flat 70 % of the 989
TFLOP/s datasheet peak prices attention at the GEMM rate (692 TFLOP/s), which
no measured flash kernel here reaches, and large GEMMs below what they
measure. ``--device datasheet`` prices with the preset alone.

Memory budget: the project's default (the device's 80 GB less the allocator
reserve), then the full 80 GB for a row that does not fit it (recorded).

TFLOP/s per GPU = F / (predicted step seconds x GPUs), with F the model FLOPs
of the MFU convention (PaLM, Chowdhery et al. 2022, appendix B; torchtitan's
count): per token 6 N + 12 L h s, N the parameters less the input embedding
(the head's matmul counts), attention counted over the full s x s scores.
The paper gives no count of its own: it reports BF16 MFU citing PaLM
(Chowdhery et al., section 3.3.2), whose appendix B counts the attention's
score and value products over the full s x s (12 L h s), and its MFU is the
TFLOP/s over the H100's 989 (430 -> 43 %, 400 -> 41 %, 380 -> 38 %). The same
step priced with causal attention counted (6 N + 6 L h s) is recorded too
(``tflops_per_gpu_causal_count``).

Table 4 prints DP 4 in the 131,072-token row; TP 8 x CP 16 x PP 16 x DP 4 is
8,192 GPUs and 4 x 16 sequences 8M tokens, so the row's 16,384 GPUs and 16M
tokens are DP 8, priced here.

Writes ``benchmarks/results/published_llama3.json`` (or ``--out``) and prints the
table. Exit status 0 when every row was priced, 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import load_average, machine_block
from benchmarks.published_megatron import _priced, write_published

MODEL = "llama3-405b"
PRECISION = ("bf16-mixed", "fp32")  # bf16 compute; fp32 gradient accumulation and reduction
GPUS_PER_NODE = 8
PP, TP, CHUNKS_PER_RANK = 16, 8, 8
DEVICE_MEMORY = 80e9  # H100 80 GB, the datasheet figure (the preset's)
#: One H100 80GB HBM3's compute, measured by ``planner profile`` (benchmarks/gpu_single.py).
MEASURED_PROFILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "gpu",
                                "h100_profile_2026-11-27.json")
DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                           "published_llama3.json")


@dataclass(frozen=True)
class PublishedRun:
    """One row of Table 4 (Llama 3 paper): the layout and the measured TFLOP/s per GPU."""

    gpus: int
    cp: int
    dp: int
    seq_len: int
    batch_per_dp: int
    tflops_per_gpu: float

    @property
    def global_batch(self) -> int:
        """Sequences per step."""
        return self.dp * self.batch_per_dp

    def iteration_flops(self, causal: bool = False) -> float:
        """Model FLOPs of one step (MFU convention: 6 N + 12 L h s per token;
        ``causal``: 6 N + 6 L h s)."""
        from models import zoo
        c = zoo.config(MODEL)
        n = c.num_params() - c.vocab_size * c.dim  # less the input embedding
        attention = (6 if causal else 12) * c.n_layers * c.dim * self.seq_len
        return float(self.global_batch * self.seq_len * (6 * n + attention))


#: Table 4 of the Llama 3 paper, as published (TP 8, PP 16 in every row).
TABLE_4 = (
    PublishedRun(8192, 1, 64, 8192, 32, 430),
    PublishedRun(16384, 1, 128, 8192, 16, 400),
    PublishedRun(16384, 16, 8, 131072, 16, 380),
)


def megatron_config(run: PublishedRun):
    """The row's configuration in the Megatron baseline's terms."""
    from planner.baselines.megatron import MegatronConfig

    layers = 126
    chunks = PP * CHUNKS_PER_RANK
    layout = (0,) + (layers // (chunks - 2),) * (chunks - 2) + (0,)
    return MegatronConfig(TP, run.dp, pipeline_model_parallel_size=PP,
                          virtual_pipeline_model_parallel_size=CHUNKS_PER_RANK,
                          micro_batch_size=1, sequence_parallel=True,
                          context_parallel_size=run.cp, cp_comm_type="all_gather",
                          pipeline_model_parallel_layout=layout)


def row_cluster(run: PublishedRun, device: str = "measured"):
    """The row's ``dgx-h100`` cluster; ``device="measured"``: its devices'
    compute (peak rates, efficiency curves, HBM bandwidth, overheads) from the
    measured H100 profile (:data:`MEASURED_PROFILE`), memory and links the
    preset's datasheet figures."""
    from dataclasses import replace

    from costmodel.presets import load_cluster

    cluster = load_cluster(f"dgx-h100:{run.gpus // GPUS_PER_NODE}")
    if device == "datasheet":
        return cluster
    measured = load_cluster(MEASURED_PROFILE).device
    return replace(cluster, device=replace(measured, name=cluster.device.name,
                                           memory=cluster.device.memory))


def price_row(run: PublishedRun, time_limit_s: float, device: str = "measured") -> dict[str, Any]:
    """The row priced as published: under the default budget, and at 80 GB."""
    from models import zoo
    from ir.precision import get_precision
    from planner.baselines.megatron import MegatronDoesNotFit, megatron_plan

    model, inputs = zoo.build(MODEL, batch_size=run.global_batch, seq_len=run.seq_len)
    cluster = row_cluster(run, device)
    cfg = megatron_config(run)
    record: dict[str, Any] = {"row": {**run.__dict__}, "config": cfg.label().split(" layout=")[0]
                              + " layout=0,1x126,0 cp-comm=" + cfg.cp_comm_type,
                              "published_tflops_per_gpu": run.tflops_per_gpu}
    precision = get_precision(*PRECISION)
    for budget in (None, DEVICE_MEMORY):
        start = time.monotonic()
        try:
            plan = megatron_plan(model, cluster, cfg, example_inputs=inputs,
                                 time_limit_s=time_limit_s, precision=precision,
                                 memory_budget=budget, model_source=MODEL)
        except MegatronDoesNotFit as err:
            record["default_budget" if budget is None else "device_memory"] = {
                "fits": False, "error": str(err).split(": ", 1)[-1][:400]}
            continue
        except Exception as err:  # noqa: BLE001 - the row's failure is the result
            record["failed"] = f"{type(err).__name__}: {err}"
            return record
        priced = _priced(plan, run, time.monotonic() - start)
        priced["tflops_per_gpu_causal_count"] = (run.iteration_flops(causal=True)
                                                 / (priced["step_time_s"] * run.gpus) / 1e12)
        priced["memory_budget_bytes"] = budget
        priced["context_parallel"] = {k: v for k, v in plan.predicted.get(
            "context_parallel", {}).items() if k == "kv_buffer_bytes"}
        priced["recomputed_chunks"] = sum(bool(st.checkpoint) for st in plan.pipeline.stages)
        record["predicted"] = priced
        record["error"] = priced["tflops_per_gpu"] / run.tflops_per_gpu - 1
        record["error_causal_count"] = priced["tflops_per_gpu_causal_count"] / run.tflops_per_gpu - 1
        break
    return record


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| GPUs | TP | CP | PP | DP | seq | batch/DP | published TFLOP/s | predicted "
             "| error | causal-count TFLOP/s | error | peak GB | budget |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        run, p = r["row"], r.get("predicted")
        head = (f"| {run['gpus']:,} | {TP} | {run['cp']} | {PP} | {run['dp']} | {run['seq_len']:,} "
                f"| {run['batch_per_dp']} | {r['published_tflops_per_gpu']:.0f} | ")
        if not p:
            lines.append(head + f"{r.get('failed') or r.get('device_memory')} | | | | | |")
            continue
        budget = "default" if p["memory_budget_bytes"] is None else "80 GB"
        lines.append(head + f"{p['tflops_per_gpu']:.0f} | {100 * r['error']:+.1f} % | "
                     f"{p['tflops_per_gpu_causal_count']:.0f} | {100 * r['error_causal_count']:+.1f} % "
                     f"| {p['peak_bytes_per_device'] / 1e9:.1f} | {budget} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="*", default=list(range(1, len(TABLE_4) + 1)),
                    help="rows of Table 4 to price (1-3; default all)")
    ap.add_argument("--time-limit", type=float, default=30.0, help="ILP time limit per solve, s")
    ap.add_argument("--device", choices=("measured", "datasheet"), default="measured",
                    help="H100 compute: the measured profile (default) or the preset's datasheet")
    ap.add_argument("--out", default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    bad = [r for r in args.rows if not 1 <= r <= len(TABLE_4)]
    if bad:
        print(f"error: row {bad[0]} is not in Table 4; give rows 1-{len(TABLE_4)}", file=sys.stderr)
        return 2
    load_before, start = load_average(), time.monotonic()
    rows = []
    for r in sorted(set(args.rows)):
        rows.append(price_row(TABLE_4[r - 1], args.time_limit, args.device))
        print(table(rows[-1:]).splitlines()[-1], flush=True)
    return write_published(args.out, rows, {
        "machine": machine_block(load_before),
        "source": "Llama Team, AI @ Meta, The Llama 3 Herd of Models, arXiv 2407.21783, Table 4",
        "cluster": "dgx-h100 (datasheet preset: H100 SXM5 80 GB, NVLink 450 GB/s per direction, "
                   "400 Gb/s InfiniBand per GPU)" + (
                       "; device compute measured: benchmarks/results/gpu/"
                       + os.path.basename(MEASURED_PROFILE)
                       if args.device == "measured" else "; device compute: datasheet preset"),
        "flop_count": "6 N + 12 L h s per token (PaLM MFU convention, N less the input "
                      "embedding); error_causal_count: 6 N + 6 L h s"}, start, table)

if __name__ == "__main__":
    sys.exit(main())
