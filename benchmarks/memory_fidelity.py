"""Predicted peak memory against torch's own count of the same training step.

    python benchmarks/memory_fidelity.py                  # ~5 min on this machine's CPU
    python benchmarks/memory_fidelity.py --quick          # gpt-tiny only, no 1B model
    python benchmarks/memory_fidelity.py --no-fake        # the real CPU models only

For every precision (``fp32``, ``bf16``, ``bf16-mixed``) and with and without
activation checkpointing (``recompute=False`` / ``True``: no layer / every layer):

* predicted: ``planner.plan(..., mesh_shape=(1,), precision=p, recompute=r)`` on one
  device, ``plan.predicted["memory_bytes_per_device"]["peak"]`` (bytes). The plan
  gets an unbounded memory budget (1e15 bytes), so that a forced ``recompute``
  always has a plan: only its prediction is read.
* measured: one steady-state step of :class:`benchmarks.plain_loop.PlainLoop` (the
  same model, precision and the *plan's* ``checkpoint`` layers), counted by torch's
  ``torch.distributed._tools.mem_tracker.MemTracker`` (live tensor storages, bytes).
  The step is the second: a first, untracked step allocates the AdamW states, so
  the count covers parameters, buffers, inputs and optimizer states held before
  the step, plus everything forward, backward, ``optimizer.step()`` and
  ``zero_grad`` allocate: the steady state the planner's memory model prices.

Two kinds of model:

* real: small GPTs run on this CPU with real tensors (``gpt-tiny``, 8 x 32, and a
  4-layer 256-wide GPT, 4 x 256), priced on ``local-cpu:1``;
* fake: a ~1.4B-parameter GPT (``gpt3-1.3b``, 4 x 2048 by default) built and run under
  ``FakeTensorMode`` (nothing is allocated; MemTracker counts the fake storages),
  priced on one H100 (``dgx-h100`` cut to one device).

Each step is measured twice: with torch's default ``scaled_dot_product_attention``
kernel (what a user's loop runs; the verdict) and with the math kernel forced
(``SDPBackend.MATH``: the s x s scores the capture records), so that a gap can be
put on attention or elsewhere. Verdict: ``|predicted / measured - 1| <= 10 %``.

Writes ``benchmarks/results/memory_fidelity.json`` (or ``--out``) and prints the
table. Units: bytes (the table shows MB = 1e6 bytes).
Exit status: 0 every case measured, 1 some case failed (its error is in the JSON).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import sys
import time
from typing import Any, Iterator

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from benchmarks.common import load_average, machine_block, write_results, wrote_message
from benchmarks.plain_loop import PlainLoop, plan_one_device, predicted_of, tracked_peak_memory

PRECISIONS = ("fp32", "bf16", "bf16-mixed")
TOLERANCE = 0.10
UNBOUNDED_BYTES = 1e15
RECOMPUTE = {"off": False, "on": True, "auto": None}
DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                           "memory_fidelity.json")


def _cpu_small_config() -> Any:
    from ir.zoo import GPTConfig

    return GPTConfig(n_layer=4, n_embd=256, n_head=8, vocab_size=2048, block_size=256)


#: name -> (zoo name or None, config factory or None, batch, seq, cluster, fake)
MODELS: dict[str, tuple[str | None, Any, int, int, str, bool]] = {
    "gpt-tiny": ("gpt-tiny", None, 8, 32, "local-cpu:1", False),
    "gpt-4x256": (None, _cpu_small_config, 4, 256, "local-cpu:1", False),
    "gpt3-1.3b": ("gpt3-1.3b", None, 4, 2048, "h100:1", True),
}


def _cluster(spec: str) -> Any:
    from costmodel.presets import load_cluster

    if spec == "h100:1":  # one H100: the dgx-h100 preset cut to one device
        return load_cluster("dgx-h100").sub_cluster(1, 1)
    return load_cluster(spec)


def _build(name: str, device: str, batch: int, seq: int) -> tuple[torch.nn.Module, tuple]:
    from ir import zoo

    zoo_name, cfg, _, _, _, _ = MODELS[name]
    if zoo_name is not None:
        return zoo.build(zoo_name, device=device, batch_size=batch, seq_len=seq)
    return zoo.build_from_config(cfg(), device=device, batch_size=batch, seq_len=seq)


@contextlib.contextmanager
def _attention(kind: str) -> Iterator[None]:
    if kind == "default":
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        yield


def measure_step(name: str, precision: str, checkpoint: list[str], attention: str,
                 batch: int, seq: int) -> dict[str, Any]:
    """MemTracker's peak of one steady-state step (bytes), real or fake per ``MODELS``."""
    fake = MODELS[name][5]
    t0 = time.perf_counter()
    mode: Any = contextlib.nullcontext()
    if fake:
        from torch._subclasses.fake_tensor import FakeTensorMode

        mode = FakeTensorMode()
    with mode, _attention(attention):
        model, inputs = _build(name, "cpu", batch, seq)
        loop = PlainLoop(model, inputs, precision=precision, checkpoint=checkpoint)
        out = tracked_peak_memory(loop, warmup=1)
        del loop, model, inputs
    gc.collect()
    out["wall_s"] = round(time.perf_counter() - t0, 2)
    return out


def run_case(name: str, precision: str, recompute: bool | None, attentions: list[str],
             batch: int, seq: int, time_limit_s: float) -> dict[str, Any]:
    """One row: the plan's prediction and the measured peaks; errors recorded, not raised."""
    _, _, _, _, cluster_spec, fake = MODELS[name]
    row: dict[str, Any] = {"model": name, "batch_size": batch, "seq_len": seq,
                           "precision": precision, "recompute": recompute,
                           "cluster": cluster_spec, "fake": fake}
    try:
        model, inputs = _build(name, "meta", batch, seq)
        t0 = time.perf_counter()
        plan = plan_one_device(model, inputs, _cluster(cluster_spec), precision=precision,
                               recompute=recompute, model_source=MODELS[name][0],
                               zoo_kwargs={"batch_size": batch, "seq_len": seq},
                               memory_budget=UNBOUNDED_BYTES, time_limit_s=time_limit_s)
        row["plan_s"] = round(time.perf_counter() - t0, 2)
        pred = predicted_of(plan)
        row["predicted"] = pred
        row["plan_precision"] = pred["precision"]
    except Exception as err:  # noqa: BLE001 - one case's failure is recorded
        row["error"] = f"plan: {type(err).__name__}: {_line(err)}"
        return row
    row["measured"] = {}
    for attention in attentions:
        try:
            m = measure_step(name, precision, pred["checkpoint"], attention, batch, seq)
        except Exception as err:  # noqa: BLE001
            row["measured"][attention] = {"error": f"{type(err).__name__}: {_line(err)}"}
            row.setdefault("error", f"measure ({attention}): {type(err).__name__}: {_line(err)}")
            continue
        m["ratio"] = pred["peak_bytes"] / m["peak_bytes"] if m["peak_bytes"] else None
        row["measured"][attention] = m
    default = row["measured"].get("default", {})
    if default.get("ratio") is not None:
        row["ratio"] = default["ratio"]
        row["within_tolerance"] = abs(default["ratio"] - 1.0) <= TOLERANCE
    return row


def _line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else ""


_RECOMPUTE_NAME = {v: k for k, v in RECOMPUTE.items()}


def _mb(x: Any) -> str:
    return f"{x / 1e6:,.1f}" if isinstance(x, (int, float)) else "-"


def print_table(rows: list[dict[str, Any]]) -> None:
    head = (f"{'model':<10} {'b x s':>9} {'precision':<10} {'recompute':>9} {'ckpt':>4} {'pred MB':>11} "
            f"{'meas MB':>11} {'ratio':>6} {'math MB':>11} {'ratio':>6}  verdict")
    print(head)
    print("-" * len(head))
    for r in rows:
        pred = r.get("predicted", {})
        meas = r.get("measured", {})
        d, m = meas.get("default", {}), meas.get("math", {})
        ck = len(pred.get("checkpoint", [])) if pred else "-"
        verdict = ("PASS" if r.get("within_tolerance") else "FAIL") if "ratio" in r else "ERROR"
        ratio = f"{r['ratio']:.2f}" if "ratio" in r else "-"
        mratio = f"{m['ratio']:.2f}" if m.get("ratio") is not None else "-"
        print(f"{r['model']:<10} {r['batch_size']:>4}x{r['seq_len']:<4} {r['precision']:<10} "
              f"{_RECOMPUTE_NAME[r['recompute']]:>9} {ck!s:>4} {_mb(pred.get('peak_bytes')):>11} {_mb(d.get('peak_bytes')):>11} "
              f"{ratio:>6} {_mb(m.get('peak_bytes')):>11} {mratio:>6}  {verdict}")
        if "error" in r:
            print(f"    error: {r['error']}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", choices=sorted(MODELS),
                    help="models to measure (default: all; --quick: gpt-tiny)")
    ap.add_argument("--precisions", nargs="+", choices=PRECISIONS, default=list(PRECISIONS))
    ap.add_argument("--recompute", nargs="+", choices=sorted(RECOMPUTE), default=["off", "on"],
                    help="checkpointing of the plans: off (no layer), on (every layer), "
                         "auto (the solver's choice); default off on")
    ap.add_argument("--quick", action="store_true", help="gpt-tiny only")
    ap.add_argument("--no-fake", action="store_true", help="leave out the FakeTensorMode model")
    ap.add_argument("--no-math", action="store_true",
                    help="measure with the default attention kernel only")
    ap.add_argument("--fake-batch", type=int, default=None, help="batch of the fake model")
    ap.add_argument("--fake-seq", type=int, default=None, help="sequence length of the fake model")
    ap.add_argument("--time-limit", type=float, default=30.0, help="ILP time limit, seconds")
    ap.add_argument("--out", default=DEFAULT_OUT, help="result JSON")
    args = ap.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1") or 1))

    names = args.models or (["gpt-tiny"] if args.quick else list(MODELS))
    if args.no_fake:
        names = [n for n in names if not MODELS[n][5]]
    attentions = ["default"] if args.no_math else ["default", "math"]
    load_before = load_average()
    start = time.perf_counter()
    rows: list[dict[str, Any]] = []
    for name in names:
        _, _, batch, seq, _, fake = MODELS[name]
        if fake:
            batch = args.fake_batch or batch
            seq = args.fake_seq or seq
        for precision in args.precisions:
            for recompute in (RECOMPUTE[k] for k in args.recompute):
                row = run_case(name, precision, recompute, attentions, batch, seq,
                               args.time_limit)
                rows.append(row)
                print(f"  {name} {precision} recompute={recompute}: "
                      + (f"ratio {row['ratio']:.3f}" if "ratio" in row else
                         row.get("error", "no ratio")), flush=True)
    print()
    print_table(rows)
    measured = [r for r in rows if "ratio" in r]
    result = {
        "benchmark": "memory_fidelity",
        "definition": ("predicted = plan.predicted['memory_bytes_per_device']['total'] of "
                       "planner.plan(mesh (1,), precision, recompute, memory budget 1e15); "
                       "measured = MemTracker peak of the 2nd step of benchmarks.plain_loop "
                       "(AdamW foreach, the plan's checkpoint layers), real tensors on CPU or "
                       "FakeTensorMode; ratio = predicted / measured (default SDPA kernel)"),
        "tolerance": TOLERANCE,
        "machine": machine_block(load_before, after=True),
        "rows": rows,
        "summary": {"cases": len(rows), "measured": len(measured),
                    "within_tolerance": sum(bool(r["within_tolerance"]) for r in measured),
                    "errors": sum("error" in r for r in rows)},
        "wall_s": round(time.perf_counter() - start, 1),
    }
    write_results(args.out, result)
    print(f"\n{result['summary']['within_tolerance']} of {len(rows)} cases within "
          f"±{TOLERANCE:.0%}; {result['summary']['errors']} errors")
    print(wrote_message(args.out, result))
    return 1 if result["summary"]["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
