"""bf16-mixed plans checked against one process, on 2 and 4 CPU ranks.

    python -m benchmarks.precision_check                     # the whole grid (~30 launches)
    python -m benchmarks.precision_check --models gpt-tiny --worlds 2 --configs tp pp2

For every model of (gpt-tiny, llama-tiny, moe-tiny; deepseek-tiny on request),
world size of (2, 4) and parallel configuration below, makes a plan with
``precision="bf16-mixed"``,
saves it and runs it with ``training.launch.launch(path, steps=2, check=True)``
(torchrun, gloo, ``OMP_NUM_THREADS=1``): step 1's loss and every parameter
gradient against a one-process run in the same precision
(:func:`training.reference.train_one_process`), within
:func:`training.reference.check_tolerance` (5e-2 for bf16 compute), and the
placements each op produced against the plan's.

Configurations (N = world size); the layout is pinned, not searched, so each
row really is the parallelism it names:

* ``dp``: Megatron ``tp=1 dp=N`` (:func:`planner.baselines.megatron.megatron_plan`):
  parameters replicated on mesh (N,), the batch split; gradients all-reduced.
* ``tp``: Megatron ``tp=N dp=1``: column/row-parallel linears,
  vocabulary-parallel embedding and head on mesh (N,).
* ``2d``: on 4 ranks Megatron ``tp=2 dp=2`` on mesh (2, 2). On 2 ranks there
  is no 2-D mesh without a size-1 axis; the row runs the automatic planner
  (:func:`planner.api.plan`) on mesh (1, 2), which exercises a 2-D DeviceMesh
  and 2-D placements with one trivial axis.
* ``pp2``: Megatron ``pp=2`` with ``tp=1 dp=N/2``, micro-batches of 2
  sequences per data-parallel rank, 1F1B, the layers split evenly
  (:func:`planner.baselines.megatron.megatron_plan`), with Megatron's distributed
  optimizer: ZeRO-1 stages (:mod:`codegen.zero1`).
* ``zero3``: one stage on mesh (N,) with ZeRO-3 (FSDP2 ``fully_shard`` over
  the mesh, its ``MixedPrecisionPolicy`` all-gathering bf16 parameters and
  reduce-scattering fp32 gradients), accumulating the gradients of 2
  micro-batches (:func:`planner.api.pipeline_plan` with ``pp=1``,
  ``zero_stage=3`` and the data-parallel layout fixed): the single-stage
  ZeRO-3 path of the planner's search.
* ``zero2``: the same with ZeRO-2 (FSDP2 without resharding after forward).
* ``zero1``: the same with ZeRO-1 (optimizer states sharded over the mesh,
  gradients reduce-scattered and parameters all-gathered once per step).
* ``ep`` (models with experts): Megatron-Core ``tp=1 dp=N`` with
  ``expert_model_parallel_size=N``: each rank holds E/N experts, tokens moved
  to them and back by all-to-all.
* ``eptp`` (models with experts, 4 ranks): ``tp=2 dp=2`` with ``ep=2``: the
  expert-parallel group inside the tensor-parallel ranks' product.

Every case is guarded: a planning or launch failure is recorded (its first
error line) and the grid goes on. Writes ``benchmarks/results/precision_check.json``
with every row and ``max_passing_err``, the largest loss or gradient relative
error over the passing cases (what the 5e-2 tolerance has to hold).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import traceback
import warnings
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.common import (check_fields, load_average, machine_block,  # noqa: E402
                               write_results, wrote_message)

RESULTS = os.path.join(HERE, "results")
MODELS = ("gpt-tiny", "llama-tiny", "moe-tiny")
WORLDS = (2, 4)
CONFIGS = ("dp", "tp", "2d", "pp2", "zero3", "zero2", "zero1", "ep", "eptp")
# configurations only models with experts have, and those models
EXPERT_CONFIGS = ("ep", "eptp")
EXPERT_MODELS = ("moe-tiny", "deepseek-tiny")
PRECISION = "bf16-mixed"


def make_plan(model_name: str, world: int, config: str, *, precision: str = PRECISION,
              time_limit_s: float = 10.0) -> tuple[Any, str]:
    """The plan of one grid cell and a short description of how it was made."""
    from models.source import build_model
    from ir.trace import trace
    from planner.api import pipeline_plan, plan
    from planner.baselines.megatron import MegatronConfig, megatron_layout, megatron_plan

    model, inputs = build_model(model_name, device="meta")
    cluster = f"local-cpu:{world}"
    common = dict(example_inputs=inputs, model_source=model_name, precision=precision,
                  time_limit_s=time_limit_s)

    def megatron(cfg: MegatronConfig) -> tuple[Any, str]:
        return megatron_plan(model, cluster, cfg, **common), f"megatron {cfg.label()}"

    if config == "dp":
        return megatron(MegatronConfig(1, world))
    if config == "tp":
        return megatron(MegatronConfig(world, 1))
    if config == "2d":
        if world >= 4 and world % 2 == 0:
            return megatron(MegatronConfig(2, world // 2))
        return (plan(model, cluster, mesh_shape=(1, world), **common),
                f"auto ILP on mesh (1, {world})")
    if config == "pp2":
        return megatron(MegatronConfig(1, world // 2, pipeline_model_parallel_size=2,
                                       micro_batch_size=2))
    if config in ("zero3", "zero2", "zero1"):
        zero = int(config[-1])
        fixed = megatron_layout(trace(model, inputs), MegatronConfig(1, world))
        p = pipeline_plan(model, cluster, pp=1, stage_mesh=(world,), schedule="1f1b",
                          num_microbatches=2, zero_stage=zero, fixed=fixed, **common)
        return p, f"pipeline_plan pp=1 stage mesh ({world},) zero_stage={zero}, 2 micro-batches"
    if config == "ep":
        return megatron(MegatronConfig(1, world, expert_model_parallel_size=world))
    if config == "eptp":
        if world < 4 or world % 2:
            raise ValueError(f"eptp needs 4 or more ranks (tp=2, ep=2), got {world}")
        return megatron(MegatronConfig(2, world // 2, expert_model_parallel_size=2))
    raise ValueError(f"unknown configuration {config!r}; choose from {', '.join(CONFIGS)}")


def _plan_summary(p: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"mesh": list(p.mesh_shape), "precision": p.precision.name}
    if p.pipeline is not None:
        out.update(schedule=p.pipeline.schedule, pp=p.pipeline.pp,
                   num_microbatches=p.pipeline.num_microbatches,
                   stage_mesh=list(p.pipeline.stage_mesh["shape"]),
                   zero_stages=[st.zero_stage for st in p.pipeline.stages])
    return out


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0] if text else ''}"


def run_case(model_name: str, world: int, config: str, *, steps: int, workdir: str,
             timeout_s: float, precision: str = PRECISION) -> dict[str, Any]:
    """Plan and run one cell; never raises (a failure is recorded in the row)."""
    from training.launch import launch
    from training.torchrun import LaunchError

    row: dict[str, Any] = {"model": model_name, "world": world, "config": config,
                           "precision": precision, "passed": False}
    t0 = time.perf_counter()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            p, how = make_plan(model_name, world, config, precision=precision)
    except Exception as err:  # noqa: BLE001 - recorded, the grid goes on
        row.update(stage="plan", error=_first_line(err), traceback=traceback.format_exc()[-2000:],
                   plan_s=time.perf_counter() - t0)
        return row
    row.update(how=how, plan=_plan_summary(p), plan_s=time.perf_counter() - t0,
               plan_warnings=sorted({str(w.message).splitlines()[0][:200] for w in caught}))
    path = os.path.join(workdir, f"{model_name}-{world}-{config}.json")
    p.save(path)
    t1 = time.perf_counter()
    try:
        r = launch(path, nproc=world, steps=steps, check=True, timeout_s=timeout_s)
    except LaunchError as err:
        row.update(stage="run", error=str(err).splitlines()[0], output_tail=str(err)[-3000:],
                   run_s=time.perf_counter() - t1)
        return row
    except Exception as err:  # noqa: BLE001
        row.update(stage="run", error=_first_line(err), run_s=time.perf_counter() - t1)
        return row
    row.update(run_s=time.perf_counter() - t1, **check_fields(r))
    if not row["passed"]:
        row["stage"] = "check"
        row["error"] = _check_failure(r)
        row["output_tail"] = r.get("output", "")[-3000:]
    return row


def _check_failure(r: dict[str, Any]) -> str:
    """Why a run that produced a result failed its check, in one line."""
    why = []
    rtol = r.get("rtol")
    if rtol is not None and (r.get("max_loss_rel_err") or 0) > rtol:
        why.append(f"loss rel err {r['max_loss_rel_err']:.3g} > {rtol:g}")
    if rtol is not None and (r.get("max_rel_grad_err") or 0) > rtol:
        why.append(f"grad rel err {r['max_rel_grad_err']:.3g} ({r.get('worst_param')}) > {rtol:g}")
    if r.get("missing_grads"):
        why.append(f"missing grads {r['missing_grads'][:3]}")
    if not r.get("observed_match", True):
        first = (r.get("placement_diffs") or []) + (r.get("mismatches") or [])
        why.append(f"placements differ: {first[0] if first else '?'}")
    return "; ".join(why) or "check failed"


def _fmt(x: Any, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'model':<11} {'N':>2} {'config':<6} {'ok':<4} {'loss err':>9} {'grad err':>9} "
            f"{'step ms':>8}  how / error")
    lines = [head, "-" * len(head)]
    for r in rows:
        note = r.get("how", "") if r["passed"] else f"{r.get('stage', '?')}: {r.get('error', '')}"
        step = r.get("step_s")
        lines.append(f"{r['model']:<11} {r['world']:>2} {r['config']:<6} "
                     f"{'yes' if r['passed'] else 'NO':<4} {_fmt(r.get('max_loss_rel_err'), '9.2e')} "
                     f"{_fmt(r.get('max_rel_grad_err'), '9.2e')} "
                     f"{_fmt(step * 1e3 if step is not None else None, '8.1f')}  {note[:110]}")
    return "\n".join(lines)


def _applies(model_name: str, world: int, config: str) -> bool:
    """Whether the grid has this cell: expert parallelism only for models with
    experts, ep x tp only on 4 or more ranks."""
    if config in EXPERT_CONFIGS and model_name not in EXPERT_MODELS:
        return False
    return config != "eptp" or world >= 4


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--worlds", nargs="+", type=int, default=list(WORLDS))
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--timeout-s", type=float, default=300.0, help="per launch")
    ap.add_argument("--precision", default=PRECISION,
                    help="training precision of every plan (fp32 isolates bf16 rounding)")
    ap.add_argument("--out", default=os.path.join(RESULTS, "precision_check.json"))
    args = ap.parse_args(argv)

    load_before = load_average()
    t0 = time.perf_counter()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="precision-check-") as tmp:
        for model_name in args.models:
            for world in args.worlds:
                for config in args.configs:
                    if not _applies(model_name, world, config):
                        continue
                    row = run_case(model_name, world, config, steps=args.steps, workdir=tmp,
                                   timeout_s=args.timeout_s, precision=args.precision)
                    rows.append(row)
                    status = "passed" if row["passed"] else f"FAILED ({row.get('error', '')[:150]})"
                    print(f"{model_name} N={world} {config}: {status}", flush=True)
    passing = [r for r in rows if r["passed"]]
    errs = [(max(r["max_loss_rel_err"] or 0.0, r["max_rel_grad_err"] or 0.0), r) for r in passing]
    worst = max(errs, key=lambda e: e[0]) if errs else None
    result = {
        "machine": machine_block(load_before, after=True),
        "precision": args.precision,
        "steps": args.steps,
        "rtol": passing[0]["rtol"] if passing else None,
        "num_cases": len(rows),
        "num_passed": len(passing),
        "max_passing_err": worst[0] if worst else None,
        "max_passing_err_case": (f"{worst[1]['model']} N={worst[1]['world']} {worst[1]['config']}"
                                 if worst else None),
        "max_passing_loss_err": max((r["max_loss_rel_err"] or 0.0 for r in passing), default=None),
        "max_passing_grad_err": max((r["max_rel_grad_err"] or 0.0 for r in passing), default=None),
        "rows": rows,
        "wall_s": time.perf_counter() - t0,
    }
    write_results(args.out, result)
    print()
    print(table(rows))
    print(f"\n{len(passing)}/{len(rows)} passed; largest relative error over passing cases: "
          f"{_fmt(result['max_passing_err'], '.3g')} ({result['max_passing_err_case']}), "
          f"tolerance {result['rtol']}")
    print(wrote_message(args.out, result))
    return 0 if len(passing) == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
