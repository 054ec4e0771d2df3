"""What a ZeRO-1 pipeline stage holds, by torch's MemTracker, against the price.

Each case plans a small GPT on ``local-cpu:4`` with
:func:`planner.api.pipeline_plan` (ZeRO-1 over the stage mesh's axis 0, a
Megatron data-parallel layout pinned: every parameter replicated on that axis),
then runs it under torchrun (4 CPU ranks, gloo, one OpenMP thread) as
``planner run`` does (:meth:`codegen.pipeline.PipelineRuntime.build` of the
model built on the CPU with seed 0, :meth:`PipelineRuntime.make_optimizer`
with AdamW). One warm-up step creates Adam's moments; the second step runs
under ``torch.distributed._tools.mem_tracker.MemTracker`` (live tensor
storages, bytes; :func:`_step_tracker`), which is given the stage modules (their parameters:
``Parameter``), the optimizer (its moments: ``Optstate``) and the tensors the
optimizer steps (the master slices: ``Other``) before the step. Per rank:

* ``params``: MemTracker's ``Parameter`` bytes (the parameters forward reads);
* ``grads``: when the last micro-batch's backward has run, MemTracker's bytes
  of the main gradients' storages (its record of each storage; they are made
  in the backward, so it files them as ``Temp``): whole, in the reduction
  dtype. Without a mixed precision, MemTracker's ``Gradient`` bytes then (the
  parameters' own ``grad``). ``other_live_after_backward`` is the rest of
  what the step added by then (the schedule's kept outputs and losses, a
  first stage's input gradient): not training state;
* ``optimizer``: ``Optstate`` + ``Other`` (Adam's two moments and the master
  slices the optimizer steps; without a mixed precision the slices alias the
  parameters and add nothing);
* ``predicted``: :func:`costmodel.memory.training_state_bytes` of the rank's
  stage parameters at ``zero_stage=1`` over the ZeRO axis's ranks, and the
  plan's own per-stage prediction (``stage.predicted.memory_bytes_per_device``).

Also recorded: MemTracker's peak of the step, the dtypes of the parameters and
of the stepped tensors, and the first steps' losses. Before this layout (before
commit d218d47) a bf16-mixed ZeRO-1 rank held fp32
parameters whole, their fp32 gradients whole and a bf16 copy per forward: 10 +
8/d bytes per parameter against the 6 + 12/d priced.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/zero1_memory.py     # ~1 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "zero1_memory.json")
MODEL = "gpt-tiny"
WORLD = 4
#: name -> (precision, pp, stage mesh, Megatron (tp, dp) layout, micro-batches)
CASES: dict[str, tuple[str, int, tuple[int, ...], tuple[int, int], int]] = {
    "bf16-mixed pp2 d2": ("bf16-mixed", 2, (2,), (1, 2), 2),
    "bf16-mixed pp1 d4": ("bf16-mixed", 1, (4,), (1, 4), 2),
    "fp32 pp2 d2": ("fp32", 2, (2,), (1, 2), 2),
}


def make_plan(case: str, path: str) -> None:
    from models.source import build_model
    from ir.trace import trace
    from planner.api import pipeline_plan
    from planner.megatron_layout import MegatronConfig, megatron_layout

    precision, pp, stage_mesh, layout, micro = CASES[case]
    model, inputs = build_model(MODEL, device="meta")
    fixed = megatron_layout(trace(model, inputs), MegatronConfig(*layout))
    plan = pipeline_plan(model, f"local-cpu:{WORLD}", example_inputs=inputs, pp=pp,
                         stage_mesh=stage_mesh, schedule="1f1b", num_microbatches=micro,
                         zero_stage=1, model_source=MODEL, time_limit_s=10.0, fixed=fixed,
                         precision=precision)
    plan.save(path)


def _storage_bytes(tensors: list[Any]) -> int:
    """Bytes of the distinct storages under ``tensors`` (DTensors: their local ones)."""
    from torch.distributed.tensor import DTensor

    seen: dict[int, int] = {}
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        storage = local.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _step_tracker() -> Any:
    """torch's MemTracker, letting a stage module run once per micro-batch (it
    refuses a root module's second forward as a next iteration; its per-module
    statistics, which this benchmark does not read, restart instead)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    class StepTracker(MemTracker):
        def _pre_fw_hook(self, module: Any, inputs: Any) -> None:
            if module in self.memory_tracking and not self._mod_tracker.is_bw:
                del self.memory_tracking[module]
            super()._pre_fw_hook(module, inputs)

    return StepTracker()


def rank_main(plan_path: str, out_dir: str) -> None:
    """One rank: two steps, the second under MemTracker; writes rank_<r>.json."""
    import torch
    import torch.distributed as dist
    from codegen.pipeline import PipelineRuntime
    from codegen.plan_model import build_plan_model
    from plan.format import load_plan

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    device = torch.device("cpu")
    plan = load_plan(plan_path)
    model, inputs = build_plan_model(plan, "cpu")
    runtime = PipelineRuntime.build(plan, model, inputs, device)
    del model
    opt = runtime.make_optimizer(lambda ts: torch.optim.AdamW(ts, lr=1e-3))
    losses = []

    def finish_step(mb_losses: Any) -> None:
        opt.step()
        opt.zero_grad(set_to_none=True)
        if mb_losses:
            losses.append(sum(float(x) for x in mb_losses) / len(mb_losses))

    finish_step(runtime.step(inputs))  # warm-up: Adam's moments exist from here on
    tracked = _tracked_step(runtime, opt, inputs, finish_step, device)
    row = {"rank": rank, **_memory_row(plan, runtime, tracked), "losses": losses}
    with open(os.path.join(out_dir, f"rank_{rank}.json"), "w") as f:
        json.dump(row, f, indent=1)
    dist.destroy_process_group()


def _tracked_step(runtime: Any, opt: Any, inputs: Any, finish_step: Callable[[Any], None],
                  device: Any) -> dict[str, Any]:
    """One step of ``runtime`` under MemTracker: its snapshots (bytes by kind)
    before the step, after the backward, after the optimizer step and at the
    peak; the main gradients' bytes as MemTracker tracks them and as counted
    here, and what of them is left after the step; the stepped dtypes."""
    modules = runtime.modules
    shards = runtime.zero1_shards()
    masters = [t for z in shards for t in z.tensors()]
    torch_optimizers = [o for group in opt.optimizers
                        for o in getattr(group, "optimizers", [group])]
    tracker = _step_tracker()
    # without a mixed precision the slices alias the parameters (tracked with them)
    tracker.track_external(*modules, *torch_optimizers,
                           *[t for z in shards if z.mixed for t in z.tensors()])
    dev = device

    def snap(kind: str = "current") -> dict[str, int]:
        return {getattr(k, "value", str(k)): int(v)
                for k, v in tracker.get_tracker_snapshot(kind)[dev].items()}

    def main_grads() -> tuple[int, int]:
        """(MemTracker's bytes of the main gradients' storages, our own count)."""
        grads = [e.main_grad for z in shards for e in z.entries if e.main_grad is not None]
        storages = {id(g.untyped_storage()): g.untyped_storage() for g in grads}
        records = [tracker._WINFO.get(st, (None, None))[0] for st in storages.values()]
        return sum(w.mem_consumed for w in records if w is not None), _storage_bytes(grads)

    with tracker:
        before = snap()
        mb_losses = runtime.step(inputs)
        after_backward = snap()
        tracked_main, counted_main = main_grads()
        finish_step(mb_losses)
        after_step = snap()
    peak = snap("peak")
    return {"before": before, "after_backward": after_backward, "after_step": after_step,
            "peak": peak, "tracked_main": tracked_main, "counted_main": counted_main,
            "main_grads_left": main_grads()[1],
            "stepped_dtypes": sorted({str(t.dtype) for t in masters})}


def _memory_row(plan: Any, runtime: Any, tracked: dict[str, Any]) -> dict[str, Any]:
    """This rank's measured training state (bytes) beside the ZeRO-1 formula's
    and the plan's stage predictions (:func:`_tracked_step`'s snapshots)."""
    from costmodel.memory import training_state_bytes

    modules = runtime.modules
    before, after_backward = tracked["before"], tracked["after_backward"]
    zero = [st for st in runtime.stage_plans]
    d = runtime.stage_mesh.size(zero[0].zero_axis) if runtime.stage_mesh.ndim > 1 \
        else runtime.stage_mesh.size()
    numel = sum(p.numel() for m in modules for p in m.parameters())  # global shapes
    precision = plan.precision
    measured = {
        "params": before.get("Parameter", 0),
        "grads": tracked["tracked_main"] if precision.mixed else after_backward.get("Gradient", 0),
        "optimizer": before.get("Optstate", 0) + before.get("Other", 0),
    }
    measured["total"] = sum(measured.values())
    # what else the step leaves live after the backward (the schedule's kept
    # outputs and losses, a first stage's input gradient): not training state
    others = after_backward["Total"] - before["Total"] - measured["grads"]
    formula = training_state_bytes(numel, precision=precision, optimizer="adam",
                                   zero_stage=1, dp_size=d)
    planned = {k: 0 for k in ("params", "grads", "optimizer")}
    for st in zero:
        for k in planned:
            planned[k] += int(st.predicted["memory_bytes_per_device"][k])
    planned["total"] = sum(planned.values())
    return {
        "stages": [st.index for st in zero], "zero_ranks": d,
        "stage_params": numel,
        "param_dtypes": sorted({str(p.dtype) for m in modules for p in m.parameters()}),
        "stepped_dtypes": tracked["stepped_dtypes"],
        "memtracker": {"before_step": before, "after_backward": after_backward,
                       "after_step": tracked["after_step"], "peak": tracked["peak"]},
        "measured": measured,
        "measured_bytes_per_param": {k: v / numel for k, v in measured.items()},
        "predicted_training_state_bytes": {k: int(v) for k, v in formula.items()},
        "predicted_plan_stage": planned,
        "ratio_total": measured["total"] / formula["total"],
        "main_grad_bytes_counted": tracked["counted_main"],
        "other_live_after_backward": others,
        "main_grads_left_after_step": tracked["main_grads_left"],
    }


def run_case(case: str, workdir: str) -> dict[str, Any]:
    from benchmarks.common import job_env

    plan_path = os.path.join(workdir, f"{case.replace(' ', '_')}.json")
    make_plan(case, plan_path)
    out_dir = tempfile.mkdtemp(dir=workdir)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={WORLD}", os.path.abspath(__file__), "--rank-main", plan_path,
           out_dir]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=job_env(), capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        first = proc.stderr.find("Traceback")
        raise RuntimeError(f"{case}: ranks exited {proc.returncode}\n"
                           f"{proc.stderr[max(first, 0):][:3000]}")
    ranks = [json.load(open(os.path.join(out_dir, f"rank_{r}.json"))) for r in range(WORLD)]
    precision, pp, stage_mesh, layout, micro = CASES[case]
    return {"case": case, "precision": precision, "pp": pp, "stage_mesh": list(stage_mesh),
            "megatron_tp_dp": list(layout), "num_microbatches": micro,
            "wall_s": round(time.perf_counter() - t0, 1), "ranks": ranks}


def _kib(x: float) -> str:
    return f"{x / 1024:9.1f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank-main", nargs=2, metavar=("PLAN", "OUT_DIR"),
                        help=argparse.SUPPRESS)
    parser.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    parser.add_argument("-o", "--output", default=RESULTS)
    args = parser.parse_args(argv)
    if args.rank_main:
        rank_main(*args.rank_main)
        return 0
    from benchmarks.common import git_commit, load_average, machine_block, write_results, \
        wrote_message

    load_before = load_average()
    t0 = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory(prefix="zero1-memory-") as workdir:
        for case in args.cases:
            rows.append(run_case(case, workdir))
    print(f"{'case':20} rank  {'params':>9} {'grads':>9} {'optim':>9} {'total':>9}  "
          f"{'predicted':>9}  ratio  (KiB; MemTracker vs training_state_bytes)")
    for row in rows:
        for r in row["ranks"]:
            m, p = r["measured"], r["predicted_training_state_bytes"]
            print(f"{row['case']:20} {r['rank']:4}  {_kib(m['params'])} {_kib(m['grads'])} "
                  f"{_kib(m['optimizer'])} {_kib(m['total'])}  {_kib(p['total'])}  "
                  f"{r['ratio_total']:.4f}")
    result = {"model": MODEL, "world": WORLD, "commit": git_commit(),
              "method": __doc__, "machine": machine_block(load_before, after=True),
              "cases": rows, "wall_s": round(time.perf_counter() - t0, 1)}
    write_results(args.output, result)
    print(wrote_message(args.output, result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
