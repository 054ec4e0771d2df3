"""Where one training step's time goes: the device's kernels against the cost model.

For each case (zoo model, batch x seq, precision; no checkpointing) this script

* **measures** (``--measure``) the plain eager loop of :mod:`benchmarks.plain_loop`
  under ``torch.profiler``: per aten op and input shapes, the device time of the
  kernels the op launched itself (CUDA; on CPU the op's own CPU time), its calls,
  and its host (CPU) time, each per step; the sum of all kernels' time per step
  and the step's wall time (CUDA events, without the profiler), whose difference
  is the time the GPU waited for the host;
* **predicts** (``--predict CLUSTER``) the same step with the cost model
  (:class:`costmodel.strategy_cost.IntraOpCost` on mesh ``(1,)``): every captured
  op's forward and backward seconds, each parameter's casts and optimizer update;

and sums both by category (matmul, attention, norm, loss, optimizer, copy,
embedding, elementwise) so that the two can be laid side by side
(``--compare MEASURED.json``).

Units: seconds (JSON), ms in the printed tables.

    python3 benchmarks/op_breakdown.py --measure --out OUT               # on the GPU
    python -m benchmarks.op_breakdown --predict CLUSTER.json --compare OUT/op_breakdown.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from collections import defaultdict
from typing import Any

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

import torch  # noqa: E402

from benchmarks.gpu_single import SHAPES  # noqa: E402  (the one-GPU cases' batch x seq)

CATEGORIES = ("matmul", "attention", "norm", "loss", "optimizer", "copy", "embedding",
              "elementwise")
_MATMUL = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "_addmm_activation"}


def base_name(op: str) -> str:
    """``aten::addmm`` / ``aten.addmm.default`` -> ``addmm``."""
    name = op.split("::", 1)[1] if "::" in op else op
    if name.startswith("aten."):
        name = name[len("aten."):]
    return name.split(".", 1)[0]


def category(op: str) -> str:
    """The category of an aten op name (profiler key or captured node target)."""
    base = base_name(op)
    if "attention" in base or "flash" in base:
        return "attention"
    if base in _MATMUL:
        return "matmul"
    if "layer_norm" in base or "rms_norm" in base:
        return "norm"
    if "softmax" in base or "nll_loss" in base or "cross_entropy" in base:
        return "loss"
    if base.startswith("_foreach") or "adam" in base:
        return "optimizer"
    if base in ("_to_copy", "copy_", "to", "clone", "contiguous"):
        return "copy"
    if "embedding" in base:
        return "embedding"
    return "elementwise"


def _by_category(rows: list[dict[str, Any]], key: str) -> dict[str, float]:
    out = {c: 0.0 for c in CATEGORIES}
    for r in rows:
        out[r["category"]] += r[key]
    return out


# --- measured -----------------------------------------------------------------------

def measure_case(model: str, batch: int, seq: int, precision: str, device: str,
                 warmup: int, steps: int) -> dict[str, Any]:
    """The plain loop's wall time and its per-op profile (see the module docstring)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.plain_loop import PlainLoop, time_steps

    loop = PlainLoop.from_zoo(model, precision=precision, device=device, batch_size=batch,
                              seq_len=seq)
    try:
        wall = time_steps(loop, warmup=warmup, steps=steps)
        cuda = device == "cuda"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities, record_shapes=True) as prof:
            for _ in range(steps):
                loop.step()
            if cuda:
                torch.cuda.synchronize()
        rows, kernel_us = [], 0.0
        for e in prof.key_averages(group_by_input_shape=True):
            dev_us = float(getattr(e, "self_device_time_total", 0.0)
                           or getattr(e, "self_cuda_time_total", 0.0) or 0.0)
            if e.device_type != DeviceType.CPU:  # a kernel's own row
                kernel_us += dev_us
                continue
            own_us = dev_us if cuda else float(e.self_cpu_time_total)
            if own_us <= 0 or not e.key.startswith("aten::"):
                continue
            rows.append({"op": e.key, "shapes": str(e.input_shapes), "category": category(e.key),
                         "calls": e.count / steps, "device_s": own_us / 1e6 / steps,
                         "host_s": float(e.self_cpu_time_total) / 1e6 / steps})
    finally:
        del loop
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    rows.sort(key=lambda r: -r["device_s"])
    ops_s = sum(r["device_s"] for r in rows)
    return {"model": model, "batch_size": batch, "seq_len": seq, "precision": precision,
            "device": device, "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name(0) if device == "cuda" else None,
            "wall_s": wall["median_s"], "wall": wall,
            "kernels_s": kernel_us / 1e6 / steps if device == "cuda" else ops_s,
            "ops_s": ops_s, "by_category": _by_category(rows, "device_s"), "ops": rows}


# --- predicted ----------------------------------------------------------------------

def predict_case(model_name: str, batch: int, seq: int, precision: str,
                 cluster: Any) -> dict[str, Any]:
    """The cost model's seconds of the same step, by op and category (mesh ``(1,)``)."""
    from costmodel.presets import load_cluster
    from costmodel.strategy_cost import IntraOpCost
    from models import zoo
    from ir.graph import OP, PARAM
    from ir.precision import compute_copy, get_precision
    from ir.trace import trace
    from planner.ilp.strategies import build_strategies

    if isinstance(cluster, str):
        cluster = load_cluster(cluster)
    prec = get_precision(precision)
    model, inputs = zoo.build(model_name, device="meta", batch_size=batch, seq_len=seq)
    model, inputs = compute_copy(model, tuple(inputs), prec)
    graph = trace(model, tuple(inputs))
    cost = IntraOpCost(graph, cluster, (1,), precision)
    rows: dict[tuple[str, str], dict[str, float]] = defaultdict(
        lambda: {"forward_s": 0.0, "backward_s": 0.0, "calls": 0})
    for ns in build_strategies(graph, (1,)):
        node, s = ns.node, ns.strategies[0]
        if node.kind == OP:
            b, w = cost.backward_times(node, s)
            row = rows[(node.target, category(node.target))]
            row["forward_s"] += cost.forward_time(node, s)
            row["backward_s"] += b + w
            row["calls"] += 1
        elif node.kind == PARAM:
            rows[("parameter casts", "copy")]["forward_s"] += cost.cast_time(node, s)
            rows[("optimizer update", "optimizer")]["forward_s"] += cost.optimizer_time(node, s)
    out = [{"op": op, "category": cat, **v, "device_s": v["forward_s"] + v["backward_s"]}
           for (op, cat), v in rows.items()]
    out.sort(key=lambda r: -r["device_s"])
    total = sum(r["device_s"] for r in out)
    return {"model": model_name, "batch_size": batch, "seq_len": seq, "precision": precision,
            "cluster": cluster.name, "host_overhead_s": cluster.device.host_overhead,
            "kernel_overhead_s": cluster.device.kernel_overhead,
            "total_s": total, "by_category": _by_category(out, "device_s"), "ops": out}


# --- report -------------------------------------------------------------------------

def print_case(measured: dict[str, Any] | None, predicted: dict[str, Any] | None) -> None:
    head = measured or predicted
    print(f"\n{head['model']} {head['batch_size']}x{head['seq_len']} {head['precision']}")
    if measured:
        print(f"  measured: wall {measured['wall_s'] * 1e3:.1f} ms, kernels "
              f"{measured['kernels_s'] * 1e3:.1f} ms, ops {measured['ops_s'] * 1e3:.1f} ms")
    if predicted:
        print(f"  predicted: {predicted['total_s'] * 1e3:.1f} ms")
    print(f"  {'category':<12} {'measured ms':>12} {'predicted ms':>13} {'ratio':>6}")
    for c in CATEGORIES:
        m = measured["by_category"][c] if measured else None
        p = predicted["by_category"][c] if predicted else None
        ratio = f"{p / m:.2f}" if m and p is not None else "-"
        print(f"  {c:<12} {m * 1e3 if m is not None else float('nan'):>12.2f} "
              f"{p * 1e3 if p is not None else float('nan'):>13.2f} {ratio:>6}")
    if measured:
        print("  top measured ops (ms per step, calls):")
        for r in measured["ops"][:14]:
            print(f"    {r['device_s'] * 1e3:8.3f} {r['calls']:5.0f}  {r['op']} {r['shapes'][:90]}")


def _cases(models: list[str], precisions: list[str]) -> list[tuple[str, int, int, str]]:
    from models import zoo
    out = []
    for m in models:
        d = zoo.describe(m)
        b, s = SHAPES.get(m, (d["batch_size"], d["seq_len"]))
        out += [(m, b, s, p) for p in precisions]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["gpt2", "gpt3-350m"])
    ap.add_argument("--precisions", nargs="+", default=["bf16", "bf16-mixed"])
    ap.add_argument("--measure", action="store_true", help="profile the plain loop here")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--predict", metavar="CLUSTER", help="price the step on this cluster")
    ap.add_argument("--compare", metavar="JSON", help="an earlier --measure's op_breakdown.json")
    ap.add_argument("--out", default=os.path.join(REPO_ROOT, "benchmarks", "results"),
                    help="folder for op_breakdown.json")
    args = ap.parse_args(argv)
    if args.measure and args.device == "cuda" and not torch.cuda.is_available():
        print("op_breakdown: error: no CUDA GPU; use --device cpu", file=sys.stderr)
        return 2
    earlier: dict[tuple, dict[str, Any]] = {}
    if args.compare:
        with open(args.compare) as f:
            for rec in json.load(f)["cases"]:
                if rec.get("measured"):
                    m = rec["measured"]
                    earlier[(m["model"], m["batch_size"], m["seq_len"], m["precision"])] = m
    records = []
    for case in _cases(args.models, args.precisions):
        rec: dict[str, Any] = {}
        if args.measure:
            rec["measured"] = measure_case(*case, args.device, args.warmup, args.steps)
        elif case in earlier:
            rec["measured"] = earlier[case]
        if args.predict:
            rec["predicted"] = predict_case(*case, args.predict)
        if rec:
            print_case(rec.get("measured"), rec.get("predicted"))
            records.append(rec)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "op_breakdown.json")
    with open(path, "w") as f:
        json.dump({"benchmark": "op_breakdown", "cases": records}, f, indent=1)
        f.write("\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
