"""Predicted peak memory against torch's own count of the same training step.

    python benchmarks/memory_fidelity.py --no-math        # the whole grid, ~8 min on 2 cores
    python benchmarks/memory_fidelity.py --quick          # gpt-tiny only
    python benchmarks/memory_fidelity.py --no-fake        # the real CPU models only
    python benchmarks/memory_fidelity.py --plan-only --plans DIR   # plans to carry to a GPU
    python benchmarks/memory_fidelity.py --device cuda --plans DIR # on the GPU (see below)
    python benchmarks/memory_fidelity.py --ranks          # per-rank table, 4 CPU ranks (~10 min)

For every precision (``fp32``, ``bf16``, ``bf16-mixed``) and with and without
activation checkpointing (``recompute=False`` / ``True``: no layer / every layer):

* predicted: ``planner.plan(..., mesh_shape=(1,), precision=p, recompute=r)`` on one
  device, ``plan.predicted["memory_bytes_per_device"]["peak"]`` (bytes). The plan
  gets an unbounded memory budget (1e15 bytes), so that a forced ``recompute``
  always has a plan: only its prediction is read.
* measured on the CPU, the verdict: one steady-state step of the plan's own
  runtime on one rank (:func:`measure_executor_step`: ``parallelize(plan)``, what
  ``planner run`` and ``planner train`` build, the training job's step, AdamW
  foreach), every tensor storage counted from before the build
  (:class:`LiveStorages`), so that anything the runtime holds beyond what is
  priced shows (``--no-executor`` leaves it out);
* measured on the CPU beside it: one steady-state step of :class:`benchmarks.plain_loop.PlainLoop`
  (the same model, precision and the *plan's* ``checkpoint`` layers), counted by
  torch's ``torch.distributed._tools.mem_tracker.MemTracker`` (live tensor storages,
  bytes). The step is the second: a first, untracked step allocates the AdamW
  states, so the count covers parameters, buffers, inputs and optimizer states held
  before the step, plus everything forward, backward, ``optimizer.step()`` and
  ``zero_grad`` allocate: the steady state the planner's memory model prices.
* measured with ``--device cuda``: ``torch.cuda.max_memory_allocated`` of a
  steady-state step of the planner's own runtime (``parallelize(plan)``, what
  ``planner run`` and ``planner train`` build on a rank; the verdict), of the plain
  loop and of the plan's executor given a built model, on one GPU
  (:mod:`benchmarks.cuda_memory`). The GPU image has no OR-Tools: make the plans here with
  ``--plan-only --plans DIR`` and carry DIR. ``--measured-from`` prices an earlier
  result's measurements again with this checkout's planner.

Models (:data:`benchmarks.memory_models.MODELS`): real ones run on this CPU
(``gpt-tiny``, 8 x 32, and a 4-layer 256-wide GPT, Llama and MoE, 4 x 256),
priced on ``local-cpu:1``; and the grid of issue 40 under ``FakeTensorMode`` on the CPU (nothing is allocated; MemTracker counts the
fake storages), priced on one H100: gpt2, gpt3-350m, gpt3-1.3b, gpt3-2.7b, llama3-8b
with 4 layers, moe-8x with 2, deepseek-v3 with a dense and a MoE layer, each at its
full width and vocabulary.

On the CPU each step is measured with torch's default
``scaled_dot_product_attention`` kernel (what a user's loop runs; the verdict) and,
unless ``--no-math``, with the math kernel forced (``SDPBackend.MATH``: the s x s
scores the capture records), so that a gap can be put on attention or elsewhere.
A model made from a config has a factory
(:data:`benchmarks.memory_models.FACTORIES`) that its plans name as their
source, so that the runtime builds it as it builds any plan's model.
Verdict (on the executor where measured, else the plain loop): predicted /
measured within [1 - :data:`UNDER`, 1 + :data:`TOLERANCE`]
(3 % under, 5 % over).

``--ranks``: instead of the grid, a per-rank table (:func:`ranks_main`) of a small
model (``--rank-model``, default ``llama-4x256``, in ``--rank-precision``, default
bf16-mixed) under four plans on ``local-cpu:4`` (:data:`RANK_PLANS`: the 2 x 2
search, two 1F1B pipeline stages of 2 ranks, ZeRO-3 over 4 ranks, context
parallelism of 2), each run by torchrun (gloo, 4 CPU ranks); on every rank the
2nd step of ``parallelize(plan)`` counted as :func:`measure_executor_step` counts
it, against the plan's predicted peak per device. Writes
``benchmarks/results/memory_fidelity_ranks.json`` (or ``--ranks-out``).

Writes ``benchmarks/results/memory_fidelity.json`` (or ``--out``) and prints the
table. Units: bytes (the table shows MB = 1e6 bytes).
Exit status: 0 every case measured, 1 some case failed (its error is in the JSON),
2 ``--device cuda`` without a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import sys
import time
import warnings
from typing import Any, Callable

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from benchmarks.common import load_average, machine_block, write_results, wrote_message
from benchmarks.live_storages import LiveStorages, one_rank_group
from benchmarks.memory_fidelity_ranks import (DEFAULT_RANKS_OUT, RANK_PLANS, RANK_WORLD, TOLERANCE,
                                              UNDER, mb, one_line, ranks_main)
from benchmarks.memory_models import MODELS, attention_kernel, build, cluster_of, model_source
from benchmarks.plain_loop import PlainLoop, plan_one_device, predicted_of, tracked_peak_memory
from ir.torch_compat.fake import fake_tensor_mode_type

PRECISIONS = ("fp32", "bf16", "bf16-mixed")
UNBOUNDED_BYTES = 1e15
RECOMPUTE = {"off": False, "on": True, "auto": None}
DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                           "memory_fidelity.json")


def measure_step(name: str, precision: str, checkpoint: list[str], attention: str,
                 batch: int, seq: int) -> dict[str, Any]:
    """MemTracker's peak of one steady-state step (bytes), real or fake per ``MODELS``."""
    fake = MODELS[name][5]
    t0 = time.perf_counter()
    mode: Any = contextlib.nullcontext()
    if fake:
        mode = fake_tensor_mode_type()()
    with mode as fake_mode, attention_kernel(attention, fake_mode):
        model, inputs = build(name, "cpu", batch, seq)
        loop = PlainLoop(model, inputs, precision=precision, checkpoint=checkpoint)
        out = tracked_peak_memory(loop, warmup=1)
        del loop, model, inputs
    gc.collect()
    out["wall_s"] = round(time.perf_counter() - t0, 2)
    return out


def measure_executor_step(name: str, precision: str, plan: Any, attention: str,
                          batch: int, seq: int) -> dict[str, Any]:
    """The peak of one steady-state step of the plan's own runtime, on one CPU
    rank: :func:`codegen.parallel_model.parallelize` of the plan (what ``planner
    run`` and ``planner train`` build on a rank: the plan's model source built on
    meta, each tensor materialised alone; a fake model is built here, handed
    over and dropped, as the meta build's capture cannot run under a second
    fake mode), ``ParallelModel.optimizer(AdamW, foreach=True)``, and per
    step ``step()``, ``opt.step()``, ``zero_grad(set_to_none=True)`` (the
    training job's step, :mod:`training.job`). Counted by :class:`LiveStorages`
    from before the build: what the runtime holds before the step (``before_step_bytes``:
    parameters, buffers, inputs, optimizer states, and anything else it keeps)
    plus what the step allocates. The step is the second, as for the plain loop."""
    from codegen.parallel_model import parallelize

    fake = MODELS[name][5]
    t0 = time.perf_counter()
    mode: Any = contextlib.nullcontext()
    if fake:
        mode = fake_tensor_mode_type()()
    with mode as fake_mode, attention_kernel(attention, fake_mode), one_rank_group(), \
            warnings.catch_warnings(), LiveStorages(fake_mode if fake else None) as live, \
            contextlib.ExitStack() as steps:
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        model, inputs = build(name, "cpu", batch, seq)
        if not fake and plan.model.get("source") == model_source(name):
            del model  # the runtime builds the plan's model itself, on meta
            runtime = parallelize(plan)
        else:  # fake tensors (the meta build captures under a fake mode of its own)
            runtime = parallelize(plan, model, inputs)
            del model
        steps.enter_context(attention_kernel(attention, fake_mode, runtime=True))
        held = live.reset_peak()
        opt = runtime.optimizer(torch.optim.AdamW, lr=1e-4, foreach=True)

        def step() -> None:
            runtime.step(*inputs)
            opt.step()
            opt.zero_grad(set_to_none=True)

        step()
        before = live.reset_peak()
        step()
        peak = live.peak
    return {"peak_bytes": int(peak), "before_step_bytes": int(before),
            "built_bytes": int(held), "kind": "live_storages",
            "wall_s": round(time.perf_counter() - t0, 2)}


def _plan_file(plans_dir: str, name: str, precision: str, recompute: bool | None,
               batch: int, seq: int) -> str:
    return os.path.join(plans_dir, f"{name}-{batch}x{seq}-{precision}-"
                                   f"{_RECOMPUTE_NAME[recompute]}.json")


def make_plan(name: str, precision: str, recompute: bool | None, batch: int, seq: int,
              time_limit_s: float, plans_dir: str | None = None) -> tuple[Any, bool]:
    """The row's one-device plan (unbounded memory budget), and whether it was
    loaded: from ``plans_dir`` when it holds the row's plan, else planned here
    (and saved there when given)."""
    from plan.format import load_plan

    path = _plan_file(plans_dir, name, precision, recompute, batch, seq) if plans_dir else None
    if path and os.path.exists(path):
        return load_plan(path), True
    model, inputs = build(name, "meta", batch, seq)
    plan = plan_one_device(model, inputs, cluster_of(MODELS[name][4]), precision=precision,
                           recompute=recompute, model_source=model_source(name),
                           zoo_kwargs={"batch_size": batch, "seq_len": seq},
                           memory_budget=UNBOUNDED_BYTES, time_limit_s=time_limit_s)
    if path:
        os.makedirs(plans_dir, exist_ok=True)
        plan.save(path)
    return plan, False


def within(ratio: float) -> bool:
    """The verdict: predicted / measured in [1 - UNDER, 1 + TOLERANCE]."""
    return 1.0 - UNDER <= ratio <= 1.0 + TOLERANCE


def measure_fake_or_cpu(name: str, precision: str, plan: Any, attentions: list[str],
                        batch: int, seq: int, executor: bool = True) -> dict[str, Any]:
    """The peaks of the plan's runtime (``executor``, the verdict's side, with
    the default attention kernel: :func:`measure_executor_step`) and of the
    plain loop per attention kernel (MemTracker), CPU or fake."""
    out: dict[str, Any] = {}
    if executor:
        try:
            out["executor"] = measure_executor_step(name, precision, plan, "default",
                                                    batch, seq)
        except Exception as err:  # noqa: BLE001 - the plain loop is still measured
            out["executor"] = {"error": f"{type(err).__name__}: {one_line(err)}"}
    for attention in attentions:
        out[attention] = measure_step(name, precision, list(plan.checkpoint), attention,
                                      batch, seq)
    return out


def measure_cuda(name: str, precision: str, plan: Any, mesh: Any, batch: int, seq: int,
                 breakdown: bool) -> dict[str, Any]:
    """``max_memory_allocated`` of the planner's own runtime (the verdict's side),
    the plain loop and the plan's executor given a built model."""
    from benchmarks.cuda_memory import executor_peaks, plain_peaks, runtime_peaks

    device = torch.device("cuda", torch.cuda.current_device())

    def build_model() -> tuple[torch.nn.Module, tuple]:
        return build(name, device, batch, seq)

    from_source = plan.model.get("source") == model_source(name)
    out: dict[str, Any] = {}
    for kind, fn in (("runtime", lambda: runtime_peaks(build_model, plan, device,
                                                       from_source=from_source,
                                                       breakdown=breakdown)),
                     ("plain", lambda: plain_peaks(build_model, precision, list(plan.checkpoint),
                                                   device, breakdown=breakdown)),
                     ("executor", lambda: executor_peaks(build_model, plan, mesh, device,
                                                         breakdown=breakdown))):
        try:
            out[kind] = fn()
        except Exception as err:  # noqa: BLE001 - the other side is still measured
            out[kind] = {"error": f"{type(err).__name__}: {one_line(err)}"}
            torch.cuda.empty_cache()
    return out


def run_case(name: str, precision: str, recompute: bool | None, batch: int, seq: int,
             time_limit_s: float, measure: Callable[[str, str, Any, int, int], dict[str, Any]],
             plans_dir: str | None = None) -> dict[str, Any]:
    """One row: the plan's prediction and the measured peaks (``measure(name,
    precision, plan, batch, seq)`` -> ``{side: {"peak_bytes", ...}}``; the first
    side is the verdict's); errors recorded, not raised."""
    _, _, _, _, cluster_spec, fake = MODELS[name]
    row: dict[str, Any] = {"model": name, "batch_size": batch, "seq_len": seq,
                           "precision": precision, "recompute": recompute,
                           "cluster": cluster_spec, "fake": fake}
    try:
        t0 = time.perf_counter()
        plan, loaded = make_plan(name, precision, recompute, batch, seq, time_limit_s,
                                 plans_dir)
        row["plan_s"] = round(time.perf_counter() - t0, 2)
        row["plan_loaded"] = loaded
        pred = predicted_of(plan)
        row["predicted"] = pred
        row["plan_precision"] = pred["precision"]
    except Exception as err:  # noqa: BLE001 - one case's failure is recorded
        row["error"] = f"plan: {type(err).__name__}: {one_line(err)}"
        return row
    try:
        row["measured"] = measure(name, precision, plan, batch, seq)
    except Exception as err:  # noqa: BLE001
        row["error"] = f"measure: {type(err).__name__}: {one_line(err)}"
        return row
    for side, m in row["measured"].items():
        if "error" in m:
            row.setdefault("error", f"measure ({side}): {m['error']}")
        elif m.get("peak_bytes"):
            m["ratio"] = pred["peak_bytes"] / m["peak_bytes"]
    first = next(iter(row["measured"].values()), {})
    if first.get("ratio") is not None:
        row["ratio"] = first["ratio"]
        row["within_tolerance"] = within(first["ratio"])
    return row


_RECOMPUTE_NAME = {v: k for k, v in RECOMPUTE.items()}


def print_table(rows: list[dict[str, Any]]) -> None:
    """Predicted against each measured side (CPU: default and math attention;
    CUDA: runtime, plain loop and executor), in MB."""
    sides = list(dict.fromkeys(k for r in rows for k in r.get("measured", {})))
    head = (f"{'model':<14} {'b x s':>9} {'precision':<10} {'recompute':>9} {'ckpt':>4} "
            f"{'pred MB':>11} " + " ".join(f"{side[:8] + ' MB':>11} {'ratio':>6}"
                                           for side in sides) + "  verdict")
    print(head)
    print("-" * len(head))
    for r in rows:
        pred = r.get("predicted", {})
        ck = len(pred.get("checkpoint", [])) if pred else "-"
        verdict = ("PASS" if r.get("within_tolerance") else "FAIL") if "ratio" in r else "ERROR"
        cells = []
        for side in sides:
            m = r.get("measured", {}).get(side, {})
            ratio = f"{m['ratio']:.3f}" if m.get("ratio") is not None else "-"
            cells.append(f"{mb(m.get('peak_bytes')):>11} {ratio:>6}")
        print(f"{r['model']:<14} {r['batch_size']:>4}x{r['seq_len']:<4} {r['precision']:<10} "
              f"{_RECOMPUTE_NAME[r['recompute']]:>9} {ck!s:>4} {mb(pred.get('peak_bytes')):>11} "
              + " ".join(cells) + f"  {verdict}")
        if "error" in r:
            print(f"    error: {r['error']}")


def _earlier_rows(path: str) -> dict[tuple, dict[str, Any]]:
    """The measured rows of an earlier result, by (model, batch, seq, precision,
    checkpointed layers)."""
    import json

    with open(path) as f:
        rows = json.load(f)["rows"]
    return {(r["model"], r["batch_size"], r["seq_len"], r["precision"],
             tuple(r["predicted"]["checkpoint"])): r for r in rows if r.get("measured")}


def _cuda_mesh() -> Any:
    """A one-rank NCCL group and its one-device mesh, for the executor."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29573")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    return init_device_mesh("cuda", (1,))


DEFINITIONS = {
    "cpu": ("measured, real tensors on CPU or FakeTensorMode: executor = peak of the 2nd "
            "step of the plan's runtime on one rank (codegen.parallel_model.parallelize of "
            "the plan, model built on meta by the runtime; ParallelModel.step, AdamW foreach "
            "step, zero_grad), every tensor storage alive counted from before the build "
            "(LiveStorages); default / math = MemTracker peak of the 2nd step of "
            "benchmarks.plain_loop (AdamW foreach, the plan's checkpoint layers) with the "
            "default SDPA kernel / the math kernel forced; ratio = predicted / measured, the "
            "verdict on the executor"),
    "cuda": ("measured = torch.cuda.max_memory_allocated of one steady-state step (after "
             "one), AdamW foreach, on one GPU (benchmarks.cuda_memory): runtime = "
             "codegen.parallel_model.parallelize of the plan (what planner run and planner "
             "train build on a rank: the plan's model source built on meta by the runtime) "
             "and the training job's step; plain = benchmarks.plain_loop; executor = "
             "codegen.executor.PlanExecutor of a model built beforehand; ratio = predicted / "
             "measured, the verdict on the runtime"),
}


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", choices=list(MODELS),
                    help="models to measure (default: all; --quick: gpt-tiny)")
    ap.add_argument("--precisions", nargs="+", choices=PRECISIONS, default=list(PRECISIONS))
    ap.add_argument("--recompute", nargs="+", choices=sorted(RECOMPUTE), default=["off", "on"],
                    help="checkpointing of the plans: off (no layer), on (every layer), "
                         "auto (the solver's choice); default off on")
    ap.add_argument("--quick", action="store_true", help="gpt-tiny only")
    ap.add_argument("--no-fake", action="store_true", help="leave out the FakeTensorMode models")
    ap.add_argument("--no-math", action="store_true",
                    help="measure with the default attention kernel only (CPU)")
    ap.add_argument("--no-executor", action="store_true",
                    help="CPU: measure the plain loop only (the verdict then on it)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cpu: MemTracker on CPU tensors or fake ones; cuda: "
                         "max_memory_allocated of the plain loop and the executor on one GPU")
    ap.add_argument("--plans", metavar="DIR",
                    help="load each row's plan from DIR when there, else plan and save it "
                         "there (the GPU machine has no ortools: plan here, carry DIR)")
    ap.add_argument("--plan-only", action="store_true",
                    help="make (and with --plans save) the plans, measure nothing")
    ap.add_argument("--measured-from", metavar="JSON",
                    help="take each row's measurements from this earlier result (e.g. a GPU "
                         "run) and price it again with this checkout's planner")
    ap.add_argument("--breakdown", nargs="*", default=[], metavar="MODEL",
                    help="CUDA: also list the allocations live at the peak for these models")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="rows that would start after this many seconds are skipped")
    ap.add_argument("--time-limit", type=float, default=30.0, help="ILP time limit, seconds")
    ap.add_argument("--out", default=DEFAULT_OUT, help="result JSON")
    ap.add_argument("--ranks", action="store_true",
                    help=f"instead of the grid: the multi-rank table ({RANK_WORLD} CPU ranks)")
    ap.add_argument("--rank-plans", nargs="+", choices=RANK_PLANS, default=list(RANK_PLANS))
    ap.add_argument("--rank-model", choices=list(MODELS), default="llama-4x256")
    ap.add_argument("--rank-precision", choices=PRECISIONS, default="bf16-mixed")
    ap.add_argument("--rank-timeout", type=float, default=600.0,
                    help="seconds each plan's torchrun job may take")
    ap.add_argument("--ranks-out", default=DEFAULT_RANKS_OUT, help="the table's result JSON")
    return ap


def _measurer(args: argparse.Namespace, mesh: Any
              ) -> Callable[[str, str, Any, int, int], dict[str, Any]]:
    """``measure(name, precision, plan, batch, seq)``: a row's measured bytes
    (nothing under ``--plan-only``; an earlier result's under
    ``--measured-from``; else measured on ``args.device``)."""
    attentions = ["default"] if args.no_math else ["default", "math"]
    earlier = _earlier_rows(args.measured_from) if args.measured_from else None

    def measure(name: str, precision: str, plan: Any, batch: int, seq: int) -> dict[str, Any]:
        if args.plan_only:
            return {}
        if earlier is not None:
            row = earlier.get((name, batch, seq, precision, tuple(plan.checkpoint)))
            if row is None:
                raise LookupError(f"{args.measured_from} has no row of {name} {batch}x{seq} "
                                  f"{precision} with these checkpointed layers")
            return {side: {k: v for k, v in m.items() if k != "ratio"}
                    for side, m in row["measured"].items()}
        if args.device == "cuda":
            return measure_cuda(name, precision, plan, mesh, batch, seq,
                                breakdown=name in args.breakdown)
        return measure_fake_or_cpu(name, precision, plan, attentions, batch, seq,
                                   executor=not args.no_executor)

    return measure


def _rows(names: list[str], args: argparse.Namespace,
          measure: Callable[[str, str, Any, int, int], dict[str, Any]],
          start: float) -> list[dict[str, Any]]:
    """One row per model, precision and recompute setting; rows that would
    start after ``args.budget_s`` seconds from ``start`` are skipped."""
    rows: list[dict[str, Any]] = []
    for name in names:
        _, _, batch, seq, _, _ = MODELS[name]
        for precision in args.precisions:
            for recompute in (RECOMPUTE[k] for k in args.recompute):
                if args.budget_s is not None and time.perf_counter() - start > args.budget_s:
                    rows.append({"model": name, "batch_size": batch, "seq_len": seq,
                                 "precision": precision, "recompute": recompute,
                                 "skipped": "time budget"})
                    continue
                row = run_case(name, precision, recompute, batch, seq, args.time_limit,
                               measure, args.plans)
                rows.append(row)
                print(f"  {name} {precision} recompute={recompute}: "
                      + (f"ratio {row['ratio']:.3f}" if "ratio" in row else
                         row.get("error", "planned" if args.plan_only else "no ratio")),
                      flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1") or 1))
    if args.ranks:
        return ranks_main(args)
    if args.device == "cuda" and not (args.plan_only or args.measured_from) \
            and not torch.cuda.is_available():
        print("memory_fidelity: error: --device cuda but torch sees no CUDA GPU",
              file=sys.stderr)
        return 2

    names = args.models or (["gpt-tiny"] if args.quick else list(MODELS))
    if args.no_fake:
        names = [n for n in names if not MODELS[n][5]]
    measuring_cuda = args.device == "cuda" and not (args.plan_only or args.measured_from)
    measure = _measurer(args, _cuda_mesh() if measuring_cuda else None)

    load_before = load_average()
    start = time.perf_counter()
    rows = _rows(names, args, measure, start)
    done = [r for r in rows if "skipped" not in r]
    print()
    print_table(done)
    measured = [r for r in done if "ratio" in r]
    result = {
        "benchmark": "memory_fidelity",
        "definition": ("predicted = plan.predicted['memory_bytes_per_device']['peak'] of "
                       "planner.plan(mesh (1,), precision, recompute, memory budget 1e15); "
                       + DEFINITIONS[args.device]),
        "tolerance": {"over": TOLERANCE, "under": UNDER},
        "machine": machine_block(load_before, after=True),
        "rows": rows,
        "summary": {"cases": len(rows), "measured": len(measured),
                    "within_tolerance": sum(bool(r["within_tolerance"]) for r in measured),
                    "errors": sum("error" in r for r in rows),
                    "skipped": sum("skipped" in r for r in rows)},
        "wall_s": round(time.perf_counter() - start, 1),
    }
    if args.measured_from:
        result["measured_from"] = os.path.relpath(args.measured_from)
    if measuring_cuda:
        result["machine"]["gpu"] = torch.cuda.get_device_name(0)
        result["machine"]["cuda"] = torch.version.cuda
    write_results(args.out, result)
    print(f"\n{result['summary']['within_tolerance']} of {len(rows)} cases within "
          f"-{UNDER:.0%}/+{TOLERANCE:.0%}; {result['summary']['errors']} errors, "
          f"{result['summary']['skipped']} skipped")
    print(wrote_message(args.out, result))
    return 1 if result["summary"]["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
