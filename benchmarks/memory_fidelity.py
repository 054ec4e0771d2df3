"""Predicted peak memory against torch's own count of the same training step.

    python benchmarks/memory_fidelity.py --no-math        # the whole grid, ~8 min on 2 cores
    python benchmarks/memory_fidelity.py --quick          # gpt-tiny only
    python benchmarks/memory_fidelity.py --no-fake        # the real CPU models only
    python benchmarks/memory_fidelity.py --plan-only --plans DIR   # plans to carry to a GPU
    python benchmarks/memory_fidelity.py --device cuda --plans DIR # on the GPU (see below)

For every precision (``fp32``, ``bf16``, ``bf16-mixed``) and with and without
activation checkpointing (``recompute=False`` / ``True``: no layer / every layer):

* predicted: ``planner.plan(..., mesh_shape=(1,), precision=p, recompute=r)`` on one
  device, ``plan.predicted["memory_bytes_per_device"]["peak"]`` (bytes). The plan
  gets an unbounded memory budget (1e15 bytes), so that a forced ``recompute``
  always has a plan: only its prediction is read.
* measured on the CPU: one steady-state step of :class:`benchmarks.plain_loop.PlainLoop`
  (the same model, precision and the *plan's* ``checkpoint`` layers), counted by
  torch's ``torch.distributed._tools.mem_tracker.MemTracker`` (live tensor storages,
  bytes). The step is the second: a first, untracked step allocates the AdamW
  states, so the count covers parameters, buffers, inputs and optimizer states held
  before the step, plus everything forward, backward, ``optimizer.step()`` and
  ``zero_grad`` allocate: the steady state the planner's memory model prices.
* measured with ``--device cuda``: ``torch.cuda.max_memory_allocated`` of a
  steady-state step of the plain loop and of the plan's executor (what ``planner
  run`` runs on a rank), on one GPU (:mod:`benchmarks.cuda_memory`); the plain loop
  gives the verdict. The GPU image has no OR-Tools: make the plans here with
  ``--plan-only --plans DIR`` and carry DIR. ``--measured-from`` prices an earlier
  result's measurements again with this checkout's planner.

Models (:data:`MODELS`): real ones run on this CPU (``gpt-tiny``, 8 x 32, and a
4-layer 256-wide GPT, 4 x 256), priced on ``local-cpu:1``; and the grid of issue
40 under ``FakeTensorMode`` on the CPU (nothing is allocated; MemTracker counts the
fake storages), priced on one H100: gpt2, gpt3-350m, gpt3-1.3b, gpt3-2.7b, llama3-8b
with 4 layers, moe-8x with 2, deepseek-v3 with a dense and a MoE layer, each at its
full width and vocabulary.

On the CPU each step is measured with torch's default
``scaled_dot_product_attention`` kernel (what a user's loop runs; the verdict) and,
unless ``--no-math``, with the math kernel forced (``SDPBackend.MATH``: the s x s
scores the capture records), so that a gap can be put on attention or elsewhere.
Verdict: predicted / measured within [1 - :data:`UNDER`, 1 + :data:`TOLERANCE`]
(3 % under, 5 % over).

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
from typing import Any, Callable, Iterator

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from benchmarks.common import load_average, machine_block, write_results, wrote_message
from benchmarks.plain_loop import PlainLoop, plan_one_device, predicted_of, tracked_peak_memory

PRECISIONS = ("fp32", "bf16", "bf16-mixed")
#: the verdict: predicted / measured at most TOLERANCE over and UNDER under 1
TOLERANCE = 0.05
UNDER = 0.03
UNBOUNDED_BYTES = 1e15
RECOMPUTE = {"off": False, "on": True, "auto": None}
DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                           "memory_fidelity.json")


def _cpu_small_config() -> Any:
    from models.zoo import GPTConfig

    return GPTConfig(n_layer=4, n_embd=256, n_head=8, vocab_size=2048, block_size=256)


def _cut(zoo_name: str, layers: int, **more: int) -> Any:
    """A config factory: the zoo model ``zoo_name`` with only ``layers`` layers
    (its full width and vocabulary) and the ``more`` fields replaced."""
    def config() -> Any:
        import dataclasses

        from models import zoo
        cfg = zoo.config(zoo_name)
        field = "n_layer" if hasattr(cfg, "n_layer") else "n_layers"
        return dataclasses.replace(cfg, **{field: layers}, **more)
    return config


#: name -> (zoo name or None, config factory or None, batch, seq, cluster, fake).
#: The fake models (FakeTensorMode on CPU, priced on one H100) are the grid the
#: GPU run measures too, at the same shapes: each fits an 80 GB GPU in fp32
#: without checkpointing.
MODELS: dict[str, tuple[str | None, Any, int, int, str, bool]] = {
    "gpt-tiny": ("gpt-tiny", None, 8, 32, "local-cpu:1", False),
    "gpt-4x256": (None, _cpu_small_config, 4, 256, "local-cpu:1", False),
    "gpt2": ("gpt2", None, 8, 1024, "h100:1", True),
    "gpt3-350m": ("gpt3-350m", None, 4, 2048, "h100:1", True),
    "gpt3-1.3b": ("gpt3-1.3b", None, 4, 2048, "h100:1", True),
    "gpt3-2.7b": ("gpt3-2.7b", None, 1, 2048, "h100:1", True),
    "llama3-8b-4l": (None, _cut("llama3-8b", 4), 2, 2048, "h100:1", True),
    "moe-8x-2l": (None, _cut("moe-8x", 2), 2, 2048, "h100:1", True),
    # one dense layer and one of 256 experts, as the model's layers are (too big for
    # one GPU in fp32: measured on fake tensors only)
    "deepseek-v3-2l": (None, _cut("deepseek-v3", 2, n_dense_layers=1), 1, 4096, "h100:1", True),
}
def _cluster(spec: str) -> Any:
    from costmodel.presets import load_cluster

    if spec == "h100:1":  # one H100: the dgx-h100 preset cut to one device
        return load_cluster("dgx-h100").sub_cluster(1, 1)
    return load_cluster(spec)


def _build(name: str, device: str, batch: int, seq: int) -> tuple[torch.nn.Module, tuple]:
    from models import zoo
    zoo_name, cfg, _, _, _, _ = MODELS[name]
    if zoo_name is not None:
        return zoo.build(zoo_name, device=device, batch_size=batch, seq_len=seq)
    return zoo.build_from_config(cfg(), device=device, batch_size=batch, seq_len=seq)


def _cpu_takes_math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
                    scale: float | None) -> bool:
    """Whether the CPU's ``scaled_dot_product_attention`` runs the math path for
    these head sizes and dtype: its own choice (``torch._fused_sdp_choice``, 0 is
    math) asked on small real tensors of the same dtype and head sizes (under
    FakeTensorMode the op answers math for any shape)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        small = [torch.zeros(1, 1, 8, t.shape[-1], dtype=t.dtype) for t in (q, k, v)]
        return int(torch._fused_sdp_choice(*small, None, 0.0, is_causal, scale=scale)) == 0


@contextlib.contextmanager
def _target_attention() -> Iterator[None]:
    """Fake models are priced on an H100: where the CPU has no fused attention
    kernel for a shape (DeepSeek-V3's value heads of 128 beside query/key heads
    of 192: CPU's flash kernel needs equal head sizes) and would take the math
    path (an s x s score matrix, in fp32 for bf16 inputs), which no GPU runs,
    ``F.scaled_dot_product_attention`` runs CUDA's memory-efficient kernel
    instead, what SDPA picks there for unequal head sizes (flash needs them
    equal), through its meta kernels on the fake tensors. It saves what the
    planner prices for the fused node: q, k, v, the output and a float32
    log-sum-exp. Shapes the CPU runs fused are left alone (CPU's flash kernel
    saves what CUDA's does). The function is replaced for the duration, not
    hooked through a mode, so that a checkpointed layer's recomputation (run
    by the autograd engine) calls the same kernel."""
    import torch.nn.functional as F

    original = F.scaled_dot_product_attention

    def sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
             is_causal: bool = False, scale: float | None = None,
             enable_gqa: bool = False) -> torch.Tensor:
        if (attn_mask is None and not dropout_p and not enable_gqa and query.dim() == 4
                and query.shape[-1] % 8 == 0 and value.shape[-1] % 8 == 0
                and _cpu_takes_math(query, key, value, is_causal, scale)):
            grad = any(t.requires_grad for t in (query, key, value))
            return torch.ops.aten._scaled_dot_product_efficient_attention(
                query, key, value, None, grad, 0.0, is_causal, scale=scale)[0]
        return original(query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
                        enable_gqa=enable_gqa)

    F.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


@contextlib.contextmanager
def _attention(kind: str, fake: bool = False) -> Iterator[None]:
    """``default``: the kernel SDPA picks (for ``fake`` models, the target GPU's
    where the CPU would take the math path: :func:`_target_attention`);
    ``math``: the math kernel forced."""
    if kind == "default":
        with _target_attention() if fake else contextlib.nullcontext():
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
    with mode, _attention(attention, fake):
        model, inputs = _build(name, "cpu", batch, seq)
        loop = PlainLoop(model, inputs, precision=precision, checkpoint=checkpoint)
        out = tracked_peak_memory(loop, warmup=1)
        del loop, model, inputs
    gc.collect()
    out["wall_s"] = round(time.perf_counter() - t0, 2)
    return out


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
    model, inputs = _build(name, "meta", batch, seq)
    plan = plan_one_device(model, inputs, _cluster(MODELS[name][4]), precision=precision,
                           recompute=recompute, model_source=MODELS[name][0],
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
                        batch: int, seq: int) -> dict[str, Any]:
    """MemTracker's peaks of the plain loop, per attention kernel (CPU or fake)."""
    out: dict[str, Any] = {}
    for attention in attentions:
        out[attention] = measure_step(name, precision, list(plan.checkpoint), attention,
                                      batch, seq)
    return out


def measure_cuda(name: str, precision: str, plan: Any, mesh: Any, batch: int, seq: int,
                 breakdown: bool) -> dict[str, Any]:
    """``max_memory_allocated`` of the plain loop and of the plan's executor."""
    from benchmarks.cuda_memory import executor_peaks, plain_peaks

    device = torch.device("cuda", torch.cuda.current_device())

    def build() -> tuple[torch.nn.Module, tuple]:
        return _build(name, device, batch, seq)

    out: dict[str, Any] = {}
    for kind, fn in (("plain", lambda: plain_peaks(build, precision, list(plan.checkpoint),
                                                    device, breakdown=breakdown)),
                     ("executor", lambda: executor_peaks(build, plan, mesh, device,
                                                         breakdown=breakdown))):
        try:
            out[kind] = fn()
        except Exception as err:  # noqa: BLE001 - the other side is still measured
            out[kind] = {"error": f"{type(err).__name__}: {_line(err)}"}
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
        row["error"] = f"plan: {type(err).__name__}: {_line(err)}"
        return row
    try:
        row["measured"] = measure(name, precision, plan, batch, seq)
    except Exception as err:  # noqa: BLE001
        row["error"] = f"measure: {type(err).__name__}: {_line(err)}"
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


def _line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else ""


_RECOMPUTE_NAME = {v: k for k, v in RECOMPUTE.items()}


def _mb(x: Any) -> str:
    return f"{x / 1e6:,.1f}" if isinstance(x, (int, float)) else "-"


def print_table(rows: list[dict[str, Any]]) -> None:
    """Predicted against each measured side (CPU: default and math attention;
    CUDA: plain loop and executor), in MB."""
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
            cells.append(f"{_mb(m.get('peak_bytes')):>11} {ratio:>6}")
        print(f"{r['model']:<14} {r['batch_size']:>4}x{r['seq_len']:<4} {r['precision']:<10} "
              f"{_RECOMPUTE_NAME[r['recompute']]:>9} {ck!s:>4} {_mb(pred.get('peak_bytes')):>11} "
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
    "cpu": ("measured = MemTracker peak of the 2nd step of benchmarks.plain_loop (AdamW "
            "foreach, the plan's checkpoint layers), real tensors on CPU or FakeTensorMode; "
            "ratio = predicted / measured with the default SDPA kernel (math: the math "
            "kernel forced)"),
    "cuda": ("measured = torch.cuda.max_memory_allocated of one steady-state step (after "
             "one) of benchmarks.plain_loop (plain) and of codegen.executor.PlanExecutor "
             "(executor: what planner run runs on a rank), AdamW foreach, on one GPU "
             "(benchmarks.cuda_memory); ratio = predicted / measured, the verdict on plain"),
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
        return measure_fake_or_cpu(name, precision, plan, attentions, batch, seq)

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
