"""No rank holds the whole model: ``planner train``'s peak memory per rank on 4
CPU ranks, against the plan's prediction and against one whole fp32 copy.

The model is the zoo's ``gpt3-1.3b`` (1.42 B parameters, 5.7 GB in fp32; 11.3 GB
with its gradients) at a small step, batch 4 x 64 tokens, so that the CPU
compute stays short. Each plan is trained for 2 steps with SGD (lr 1e-4) by the
command a user types, ``planner train PLAN.json --data TOKENS.bin ...``
(torchrun, gloo, 4 ranks on ``local-cpu:4``, ``OMP_NUM_THREADS=1``). The
runtime (:func:`codegen.parallel_model.parallelize`) builds the model on the
meta device and each rank allocates only its own shards
(:mod:`codegen.deferred_init`); the job's result JSON gives every rank's peak
resident set (``ru_maxrss``) and its resident set when the job started
(``baseline_bytes``, before any model is built). Plans:

* ``2x2``: :func:`planner.api.plan` with ``mesh_shape=(2, 2)`` and
  ``optimizer="sgd"`` (what ``planner plan --mesh 2x2`` gives, but that
  command has no optimizer option and plans for Adam);
* ``zero3``: :func:`planner.api.pipeline_plan` with ``pp=1``, stage mesh
  ``(4,)``, 1F1B over 2 micro-batches, ``zero_stage=3``: FSDP2 over the 4
  ranks, each layer, the embeddings, the final norm and the head a unit of
  its own (:mod:`codegen.zero3_units`), the shards materialised one
  parameter at a time. Planned at the preset's budget (24 GiB / 4 ranks less
  a 10% reserve); where the planner finds no such plan that fits, it is
  planned again without a budget to record what it would need, and it is
  trained only where the 4 ranks' predicted total fits this machine's
  available memory (``--margin``: the slack each rank is allowed);
* on request (``--plans``): ``zero3-dtensor``, ZeRO-3 written as DTensor
  placements (the stand-in before ZeRO-3 ran unit by unit):
  :func:`planner.api.pipeline_plan` with ``pp=1``, stage mesh ``(4,)``, 2
  micro-batches of 4 sequences (batch 8 x 64), every weight matrix and both
  inputs fixed to ``Shard(0)``: each rank holds a quarter of every weight, its
  gradient and optimizer state, computes its quarter of the batch, and the
  planned reshards gather each weight where it is used; and ``zero3-gpt2``,
  the FSDP2 ZeRO-3 plan of the zoo's ``gpt2``.

Every job runs with glibc's malloc giving every block of 1 MiB or more its own
mapping (``MALLOC_MMAP_THRESHOLD_=1048576``), so that a rank's resident set
follows its live tensors; the runtime's own allocator setting
(:mod:`costmodel.host_allocator`) keeps freed blocks, and would measure the
heap's high mark instead.

Every plan records: each rank's peak and baseline, the plan's predicted peak
and total bytes per device (``predicted.memory_bytes_per_device``), ``(peak -
baseline) / predicted`` (the check: within 20% of the predicted peak), the
whole model's fp32 parameters and gradients for comparison, the losses, the
wall time, and the ranks' resident sets sampled every second from outside
(their sum, the machine's available memory, and when each rank peaked). A
watchdog kills the job (the processes it started) if the machine's available
memory falls under 1.5 GiB; a run starts only when 90% of the available memory
holds 4 x (1.3 x the predicted total + 0.6 GiB), waiting up to ``--wait``
seconds for other jobs on the machine to free it.

The build probe runs :func:`codegen.parallel_model.parallelize` of the 2x2
plan alone on 4 ranks and records each rank's resident set right after it, and
again after glibc's ``malloc_trim(0)``, beside the bytes of its shards.

The old runtime's figure (``planner run``'s ``codegen/rank_main.py`` built the
whole fp32 model on every rank before cutting it) is measured in one process:
``models.source.build_model("gpt3-1.3b", device="cpu", seed=0, ...)`` and its peak
resident set; 4 ranks would each hold that before any training.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/train_memory.py --margin 1.1   # ~12 min on 2 idle cores
    .venv/bin/python benchmarks/train_memory.py --plans 2x2 --workdir /tmp/tm

The ranks' output goes to the temporary file ``planner train`` makes, here in
the run's folder (``TMPDIR``).

Writes ``benchmarks/results/train_memory.json`` (machine, settings, the old
runtime's figure and every plan's numbers); work files (plans, tokens, the
ranks' logs, result JSONs) go to ``--workdir`` (default: a new temporary folder).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.common import RESULTS_DIR, file_tail, git_commit, job_env, load_average  # noqa: E402
from benchmarks.common import machine_block, read_results, write_results, wrote_message  # noqa: E402
from benchmarks.rank_memory_watch import gib, run_watched, wait_for_memory  # noqa: E402
from benchmarks.train_job import CLUSTER, RANKS, doc_tokens, planner_argv, read_result  # noqa: E402

MODEL = "gpt3-1.3b"
STEP = {"batch_size": 4, "seq_len": 64}
#: glibc's malloc with every block of 1 MiB or more its own mapping, returned
#: to the system when freed (no dynamic threshold): every job's allocator
MMAP_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
#: plan name -> (zoo model, kind, extra environment of the job)
PLANS: dict[str, tuple[str, str, dict[str, str]]] = {
    "zero3": (MODEL, "zero3", MMAP_ENV),
    "zero3-dtensor": (MODEL, "zero3-dtensor", MMAP_ENV),
    "2x2": (MODEL, "2x2", MMAP_ENV),
    "zero3-gpt2": ("gpt2", "zero3", MMAP_ENV),
}
#: the plans run without --plans (zero3-dtensor and zero3-gpt2 on request: see the docstring)
DEFAULT_PLANS = ("zero3", "2x2")
#: the ZeRO-3 in DTensor placements splits each micro-batch of 4 sequences over the 4 ranks
DTENSOR_STEP = {"batch_size": 8, "seq_len": 64}
TRAIN = {"steps": 2, "optimizer": "sgd", "lr": 1e-4}
TOLERANCE = 0.20  # (peak - baseline) within 20% of the predicted peak
TEXT_BYTES = 1_000_000
#: a run is started only if its ranks' predicted total, times this margin, plus
#: the process's own bytes, fits 90% of the machine's available memory
MARGIN = 1.3
RANK_OVERHEAD_BYTES = 600 << 20


# ------------------------------------------------------------- the old runtime
_OLD_BUILD = r"""
import json, resource, sys, time
import torch
from codegen.rank_process import resident_bytes as rss
from models.source import build_model

baseline = rss()
t0 = time.perf_counter()
model, inputs = build_model(sys.argv[1], device="cpu", seed=0, batch_size=int(sys.argv[2]),
                            seq_len=int(sys.argv[3]))
build_s = time.perf_counter() - t0
params = sum(p.numel() * p.element_size() for p in model.parameters())
print(json.dumps({"baseline_bytes": baseline, "after_build_rss_bytes": rss(),
                  "peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "param_bytes": params, "build_s": round(build_s, 2)}))
"""


def old_runtime_figure(model: str) -> dict[str, Any]:
    """The peak resident set of one process building the whole fp32 model on
    the CPU, as every rank of the old runtime did before cutting it."""
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", _OLD_BUILD, model, str(STEP["batch_size"]),
                           str(STEP["seq_len"])], cwd=ROOT, env=job_env(), capture_output=True,
                          text=True, timeout=900)
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["?"])[-1], "model": model}
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    got.update(model=model, wall_s=round(time.perf_counter() - t0, 1),
               peak_minus_baseline_bytes=got["peak_bytes"] - got["baseline_bytes"],
               how=f"one process: models.source.build_model({model!r}, device='cpu', seed=0, "
                   f"batch_size={STEP['batch_size']}, seq_len={STEP['seq_len']}); "
                   "peak = ru_maxrss, baseline = RSS after importing torch, models.source and "
                   "codegen.parallel_model",
               note=f"the old runtime (codegen/rank_main.py, `planner run`) built this whole "
                    f"fp32 model on every rank before cutting it: on {RANKS} ranks, {RANKS} x "
                    f"this in host memory before any training step")
    return got


# --------------------------------------------------------------- data, plans
def make_tokens(workdir: str) -> tuple[str, dict[str, Any]]:
    """README.md and docs/design.md, repeated to about :data:`TEXT_BYTES`
    bytes, as a uint16 byte-token file (ids < 256 < GPT-3's 50257;
    :func:`benchmarks.train_job.doc_tokens`)."""
    path, info = doc_tokens(workdir, TEXT_BYTES)
    return path, {k: info[k] for k in ("sources", "repeats", "tokens")}


def _fp32_bytes(model: Any) -> dict[str, int]:
    params = sum(p.numel() for p in model.parameters())
    return {"num_parameters": params, "fp32_param_bytes": 4 * params,
            "fp32_params_and_grads_bytes": 8 * params}


def make_plan(name: str, workdir: str) -> dict[str, Any]:
    """Plan ``name`` (:data:`PLANS`); its path, how it was made, its predicted
    memory, and what the plan records of the model and the step. A ZeRO-3
    plan the planner finds no fitting plan for is planned again without a
    budget (``fits_budget`` False)."""
    from models.source import build_model
    from planner.api import pipeline_plan, plan as search_plan
    from planner.request import PlanningError, default_memory_budget
    from costmodel.presets import load_cluster

    model_name, kind, _ = PLANS[name]
    step = DTENSOR_STEP if kind == "zero3-dtensor" else STEP
    path = os.path.join(workdir, f"{name}.json")
    model, inputs = build_model(model_name, device="meta", seed=0, **step)
    common = dict(model_source=model_name, zoo_kwargs=dict(step), optimizer=TRAIN["optimizer"])
    budget = default_memory_budget(load_cluster(CLUSTER))
    row: dict[str, Any] = {"model": model_name, "kind": kind, "path": path,
                           "budget_bytes_per_device": budget, **_fp32_bytes(model)}
    t0 = time.perf_counter()
    if kind == "zero3":
        args = dict(pp=1, stage_mesh=(4,), schedule="1f1b", num_microbatches=2, zero_stage=3)
        row["how"] = (f"planner.api.pipeline_plan(build_model({model_name!r}, device='meta', "
                      f"batch_size=4, seq_len=64), {CLUSTER!r}, pp=1, stage_mesh=(4,), "
                      f"schedule='1f1b', num_microbatches=2, zero_stage=3, "
                      f"model_source={model_name!r}, zoo_kwargs={STEP}, optimizer='sgd')")
        try:
            plan = pipeline_plan(model, CLUSTER, example_inputs=inputs, **args, **common)
            row["fits_budget"] = True
        except PlanningError as err:
            row.update(fits_budget=False, planning_error=str(err).splitlines()[0])
            print(f"[{name}] planner: {row['planning_error']}; planning again without a "
                  f"budget to see what it needs", flush=True)
            plan = pipeline_plan(model, CLUSTER, example_inputs=inputs, **args, **common,
                                 memory_budget=float(1 << 50))
            row["how"] += "; again with memory_budget=2**50 (no budget) for the prediction"
    elif kind == "zero3-dtensor":
        from torch.distributed.tensor import Shard

        fixed = {fqn: (Shard(0),) for fqn, p in model.named_parameters()
                 if p.dim() >= 2 and p.shape[0] % RANKS == 0}
        fixed.update({name_: (Shard(0),) for name_ in ("idx", "targets")})
        row["how"] = (f"planner.api.pipeline_plan(build_model({model_name!r}, device='meta', "
                      f"batch_size=8, seq_len=64), {CLUSTER!r}, pp=1, stage_mesh=(4,), "
                      f"schedule='1f1b', num_microbatches=2, zero_stage=0, fixed=every weight "
                      f"matrix and the inputs Shard(0), model_source={model_name!r}, "
                      f"zoo_kwargs={step}, optimizer='sgd')")
        plan = pipeline_plan(model, CLUSTER, example_inputs=inputs, pp=1, stage_mesh=(4,),
                             schedule="1f1b", num_microbatches=2, zero_stage=0, fixed=fixed,
                             **common)
        row["fits_budget"] = True
    else:
        row["how"] = (f"planner.api.plan(build_model({model_name!r}, device='meta', "
                      f"batch_size=4, seq_len=64), {CLUSTER!r}, mesh_shape=(2, 2), "
                      f"model_source={model_name!r}, zoo_kwargs={STEP}, optimizer='sgd')")
        plan = search_plan(model, CLUSTER, example_inputs=inputs, mesh_shape=(2, 2), **common)
        row["fits_budget"] = True
    row["plan_s"] = round(time.perf_counter() - t0, 1)
    plan.save(path)
    with open(path) as f:
        saved = json.load(f)
    memory = saved["predicted"]["memory_bytes_per_device"]
    row.update(mesh=list(plan.mesh_shape), precision=plan.precision.name,
               plan_source=saved["model"].get("source"),
               plan_zoo_kwargs=saved["training"].get("zoo_kwargs"),
               plan_optimizer=saved["training"].get("optimizer"),
               predicted_step_s=saved["predicted"].get("step_time_s"),
               predicted_memory_bytes_per_device=memory)
    if plan.pipeline is not None:
        row.update(pp=plan.pipeline.pp, schedule=plan.pipeline.schedule,
                   num_microbatches=plan.pipeline.num_microbatches,
                   zero_stages=[st.zero_stage for st in plan.pipeline.stages])
    if row["plan_source"] != model_name or row["plan_zoo_kwargs"] != step:
        raise RuntimeError(f"{name}: the plan records model.source={row['plan_source']!r}, "
                           f"training.zoo_kwargs={row['plan_zoo_kwargs']}, not {model_name!r} "
                           f"{step}: planner train could not rebuild it")
    print(f"[{name}] planned in {row['plan_s']} s: mesh {row['mesh']}, predicted peak "
          f"{gib(memory.get('peak'))} GiB, total {gib(memory.get('total'))} GiB per device",
          flush=True)
    return row


# ------------------------------------------------------------------ training
def train(name: str, plan_path: str, tokens: str, workdir: str, timeout_s: float,
          extra_env: dict[str, str]) -> dict[str, Any]:
    """``planner train`` of one plan for :data:`TRAIN`'s steps, watched."""
    folder = os.path.join(workdir, "runs", name)
    os.makedirs(folder, exist_ok=True)
    result = os.path.join(folder, "result.json")
    if os.path.exists(result):
        os.remove(result)
    args = ["train", plan_path, "--data", tokens, "--steps", str(TRAIN["steps"]),
            "--optimizer", TRAIN["optimizer"], "--lr", str(TRAIN["lr"]), "--log-every", "1",
            "--result-json", result]
    log = os.path.join(folder, "planner.log")
    env_words = "".join(f"{k}={v} " for k, v in extra_env.items())
    print(f"[{name}] {env_words}OMP_NUM_THREADS=1 planner {' '.join(args)}", flush=True)
    t0 = time.perf_counter()
    with open(log, "w") as f:
        # the ranks' output goes to a temporary file, here made in the run's folder (TMPDIR)
        rc, _, timed_out, watch = run_watched(
            planner_argv(args), cwd=ROOT,
            env={**job_env(), **extra_env, "TMPDIR": folder}, stdout=f, timeout_s=timeout_s)
    wall = round(time.perf_counter() - t0, 1)
    out: dict[str, Any] = {"command": f"{env_words}OMP_NUM_THREADS=1 planner " + " ".join(args),
                           "returncode": rc, "wall_s": wall, "timed_out": timed_out,
                           "killed": watch.killed, "sampled": watch.summary(),
                           "result": read_result(result)}
    ranks_log = sorted(glob.glob(os.path.join(folder, "planner-train-*.log")),
                       key=os.path.getmtime)
    out["ranks_log"] = ranks_log[-1] if ranks_log else None
    out["step_lines"] = [line for line in file_tail(out["ranks_log"], 400)
                         if line.startswith("step ")] if ranks_log else []
    if rc != 0 or out["result"] is None:
        out["error_tail"] = file_tail(log, 8) + (file_tail(out["ranks_log"], 12)
                                                 if ranks_log else [])
        # the exceptions the ranks raised, each once (the tail shows only the last)
        causes = [line.split("]: ", 1)[1] for line in (file_tail(out["ranks_log"], 2000)
                                                        if ranks_log else [])
                  if line.startswith("[rank") and "]: " in line
                  and re.match(r"[\w.]*(Error|Exception): ", line.split("]: ", 1)[1])]
        out["error_causes"] = list(dict.fromkeys(causes))[:6]
    print(f"[{name}] exit {rc} in {wall:.0f} s", flush=True)
    return out


def _memory_rows(plan: dict[str, Any], res: dict[str, Any]) -> dict[str, Any]:
    """Per rank: peak, baseline, peak - baseline and its ratio to the
    predicted peak and total; the verdict; the comparison with one whole fp32
    copy of parameters and gradients."""
    memory = plan["predicted_memory_bytes_per_device"]
    peak_pred, total_pred = memory.get("peak"), memory.get("total")
    whole = plan["fp32_params_and_grads_bytes"]
    ranks = []
    for r in sorted(res.get("ranks", []), key=lambda x: x["rank"]):
        used = r["peak_bytes"] - r["baseline_bytes"]
        ranks.append({"rank": r["rank"], "peak_bytes": r["peak_bytes"],
                      "baseline_bytes": r["baseline_bytes"], "peak_kind": r.get("peak_kind"),
                      "peak_minus_baseline_bytes": used,
                      "ratio_to_predicted_peak": round(used / peak_pred, 4),
                      "ratio_to_predicted_total": round(used / total_pred, 4),
                      "peak_over_whole_fp32_params_and_grads": round(r["peak_bytes"] / whole, 4),
                      "within_20pct_of_predicted_peak":
                          abs(r["peak_bytes"] - (r["baseline_bytes"] + peak_pred))
                          <= TOLERANCE * (r["baseline_bytes"] + peak_pred),
                      "within_20pct_of_predicted_total":
                          abs(r["peak_bytes"] - (r["baseline_bytes"] + total_pred))
                          <= TOLERANCE * (r["baseline_bytes"] + total_pred)})
    return {"predicted_peak_bytes_per_device": peak_pred,
            "predicted_total_bytes_per_device": total_pred,
            "whole_model_fp32_params_and_grads_bytes": whole, "ranks": ranks,
            "max_peak_bytes": max((r["peak_bytes"] for r in ranks), default=None),
            "all_within_20pct": bool(ranks) and all(r["within_20pct_of_predicted_peak"]
                                                    for r in ranks),
            "all_within_20pct_of_total": bool(ranks) and all(
                r["within_20pct_of_predicted_total"] for r in ranks),
            "every_peak_below_whole_fp32_params_and_grads":
                bool(ranks) and all(r["peak_bytes"] < whole for r in ranks),
            "losses": [[e["step"], e["loss"]] for e in res.get("losses", [])]}


def _need_bytes(predicted_total: float, margin: float = MARGIN) -> int:
    """What :data:`RANKS` ranks of a plan predicted to hold ``predicted_total``
    bytes per device are allowed to need (``margin`` times the prediction each)."""
    return int(RANKS * (margin * predicted_total + RANK_OVERHEAD_BYTES))


def run_plan(name: str, workdir: str, tokens: str, timeout_s: float, wait_s: float,
             margin: float = MARGIN) -> dict[str, Any]:
    """Plan, check that it fits the machine (waiting up to ``wait_s`` seconds
    for other jobs to free memory where it fits the machine's total), train,
    and compare."""
    try:
        plan = make_plan(name, workdir)
    except Exception as err:  # noqa: BLE001 - recorded, the others go on
        print(f"[{name}] planning failed: {type(err).__name__}: {err}", flush=True)
        return {"error": f"planning: {type(err).__name__}: {str(err)[:400]}"}
    row: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M"), "plan": plan}
    total = plan["predicted_memory_bytes_per_device"].get("total") or 0
    need = _need_bytes(total, margin)
    memory, waited, fits_machine = wait_for_memory(name, need, wait_s)
    available = memory["MemAvailable"]
    row["machine_fit"] = {"ranks": RANKS, "predicted_total_bytes_per_device": total,
                          "overhead_bytes_per_rank": RANK_OVERHEAD_BYTES, "needs_bytes": need,
                          "machine_bytes": memory["MemTotal"], "available_bytes": available,
                          "waited_s": waited, "fits": need <= 0.9 * available}
    if not row["machine_fit"]["fits"]:
        row["not_run"] = (f"{RANKS} ranks x ({margin} x {gib(total)} GiB predicted + "
                          f"{gib(RANK_OVERHEAD_BYTES)} GiB process) = {gib(need)} GiB > 90% of "
                          f"the {gib(available)} GiB available"
                          + ("" if fits_machine else
                             f" (and of this machine's {gib(memory['MemTotal'])} GiB)")
                          + ": not started")
        print(f"[{name}] {row['not_run']}", flush=True)
        return row
    run = train(name, plan["path"], tokens, workdir, timeout_s, PLANS[name][2])
    row["run"] = run
    if run["result"] is not None:
        row["memory"] = _memory_rows(plan, run["result"])
        for r in row["memory"]["ranks"]:
            print(f"[{name}] rank {r['rank']}: peak {gib(r['peak_bytes'])} GiB, baseline "
                  f"{gib(r['baseline_bytes'])} GiB, (peak - baseline) / predicted peak "
                  f"{r['ratio_to_predicted_peak']}", flush=True)
    return row


_PROBE = r"""
import ctypes, gc, json, resource, sys, time
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from codegen.rank_process import resident_bytes as rss

baseline = rss()
from codegen.parallel_model import parallelize
t0 = time.perf_counter()
model = parallelize(sys.argv[1])
out = {"rank": dist.get_rank(), "baseline_bytes": baseline,
       "build_s": round(time.perf_counter() - t0, 1), "after_build_rss_bytes": rss(),
       "build_peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
       "local_param_bytes": sum((p.to_local() if isinstance(p, DTensor) else p)
                                .untyped_storage().nbytes() for p in model.parameters())}
gc.collect()
ctypes.CDLL("libc.so.6").malloc_trim(0)
out["after_malloc_trim_rss_bytes"] = rss()
print("PROBE " + json.dumps(out), flush=True)
dist.barrier()
dist.destroy_process_group()
"""


def build_probe(plan_path: str, predicted_total: float, workdir: str, timeout_s: float,
                wait_s: float) -> dict[str, Any]:
    """Each rank's resident set right after :func:`parallelize` (no step) of
    ``plan_path``, then after glibc's ``malloc_trim(0)`` gives back the freed
    heap: how much of it is the shards, how much memory the allocator keeps
    from the build's whole tensors (4 ranks under torchrun, watched)."""
    need = _need_bytes(predicted_total)
    memory, waited, _ = wait_for_memory("build probe", need, wait_s)
    if need > 0.9 * memory["MemAvailable"]:
        print(f"[build probe] not started: {gib(need)} GiB needed, "
              f"{gib(memory['MemAvailable'])} GiB available", flush=True)
        return {"plan": plan_path, "not_run": f"{gib(need)} GiB needed, "
                f"{gib(memory['MemAvailable'])} GiB available", "waited_s": waited}
    script = os.path.join(workdir, "build_probe.py")
    with open(script, "w") as f:
        f.write(_PROBE)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={RANKS}", script, plan_path]
    print(f"[build probe] {' '.join(cmd[1:])}", flush=True)
    t0 = time.perf_counter()
    returncode, output, _, watch = run_watched(cmd, cwd=ROOT, env=job_env(),
                                               stdout=subprocess.PIPE, timeout_s=timeout_s)
    ranks = sorted((json.loads(line.split("PROBE ", 1)[1]) for line in output.splitlines()
                    if "PROBE {" in line), key=lambda r: r["rank"])
    for r in ranks:
        r["retained_by_allocator_bytes"] = (r["after_build_rss_bytes"]
                                            - r["after_malloc_trim_rss_bytes"])
        r["after_trim_minus_baseline_minus_params_bytes"] = (
            r["after_malloc_trim_rss_bytes"] - r["baseline_bytes"] - r["local_param_bytes"])
    out = {"plan": plan_path, "command": " ".join(cmd[1:]), "returncode": returncode,
           "wall_s": round(time.perf_counter() - t0, 1), "killed": watch.killed, "ranks": ranks}
    if returncode != 0 or not ranks:
        out["error_tail"] = output.splitlines()[-12:]
    for r in ranks:
        print(f"[build probe] rank {r['rank']}: after build {gib(r['after_build_rss_bytes'])} "
              f"GiB, after malloc_trim {gib(r['after_malloc_trim_rss_bytes'])} GiB, shards "
              f"{gib(r['local_param_bytes'])} GiB", flush=True)
    return out


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """One line of numbers per plan (GiB; ratios of (peak - baseline) to the
    predicted peak and total), the old runtime's figure and the build probe's
    memory kept by the allocator."""
    out: dict[str, Any] = {"unit": "GiB"}
    old = result.get("old_runtime_build_peak_bytes_per_rank")
    if old:
        out["old_runtime_build_peak_per_rank"] = gib(old)
        out["old_runtime_build_peak_4_ranks"] = gib(RANKS * old)
    for name, row in result["plans"].items():
        plan, line = row.get("plan", {}), {}
        memory = plan.get("predicted_memory_bytes_per_device", {})
        line.update(model=plan.get("model"), predicted_peak=gib(memory.get("peak")),
                    predicted_total=gib(memory.get("total")),
                    whole_fp32_params_and_grads=gib(plan.get("fp32_params_and_grads_bytes")))
        if "memory" in row:
            ranks = row["memory"]["ranks"]
            line.update(
                peak_per_rank=[gib(r["peak_bytes"]) for r in ranks],
                baseline_per_rank=[gib(r["baseline_bytes"]) for r in ranks],
                ratio_to_predicted_peak=[r["ratio_to_predicted_peak"] for r in ranks],
                ratio_to_predicted_total=[r["ratio_to_predicted_total"] for r in ranks],
                within_20pct_of_predicted_peak=row["memory"]["all_within_20pct"],
                within_20pct_of_predicted_total=row["memory"]["all_within_20pct_of_total"],
                losses=[loss for _, loss in row["memory"]["losses"]])
        if "run" in row:
            line.update(returncode=row["run"]["returncode"], wall_s=row["run"]["wall_s"])
            if row["run"].get("error_tail"):
                line["error"] = next((x for x in row["run"]["error_tail"] if "error" in x),
                                     row["run"]["error_tail"][-1])
                line["error_causes"] = row["run"].get("error_causes", [])
        if "not_run" in row:
            line["not_run"] = row["not_run"]
        if not plan.get("fits_budget", True):
            line["planner"] = plan.get("planning_error")
        out[name] = line
    probe = result.get("build_probe_2x2", {}).get("ranks")
    if probe:
        out["2x2_after_build"] = {
            "rss": [gib(r["after_build_rss_bytes"]) for r in probe],
            "rss_after_malloc_trim": [gib(r["after_malloc_trim_rss_bytes"]) for r in probe],
            "shards": [gib(r["local_param_bytes"]) for r in probe],
            "kept_by_allocator": [gib(r["retained_by_allocator_bytes"]) for r in probe],
            "build_peak": [gib(r["build_peak_bytes"]) for r in probe]}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plans", nargs="+", default=list(DEFAULT_PLANS), choices=list(PLANS))
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per training run")
    ap.add_argument("--wait", type=float, default=900.0,
                    help="seconds a run waits for other jobs to free the memory it needs")
    ap.add_argument("--no-old-runtime", action="store_true",
                    help="skip the old runtime's whole-model build")
    ap.add_argument("--no-probe", action="store_true",
                    help="skip the build probe (RSS after parallelize, before and after "
                         "malloc_trim) of the 2x2 plan")
    ap.add_argument("--margin", type=float, default=MARGIN,
                    help="a run starts only if 4 x (MARGIN x the predicted bytes per device + "
                         "the process) fit 90%% of the available memory")
    ap.add_argument("--out", default=os.path.join(RESULTS_DIR, "train_memory.json"))
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    load_before = load_average()
    t0 = time.perf_counter()
    workdir = args.workdir or tempfile.mkdtemp(prefix="train-memory-")
    os.makedirs(workdir, exist_ok=True)
    tokens, data = make_tokens(workdir)
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"), "git_commit": git_commit(),
        "settings": {"model": MODEL, "step": STEP, "cluster": CLUSTER, "ranks": RANKS,
                     **TRAIN, "omp_num_threads": 1, "tolerance": TOLERANCE,
                     "criterion": "peak_bytes within 20% of baseline_bytes + the plan's "
                                  "predicted peak (memory_bytes_per_device.peak)"},
        "data": data, "workdir": workdir}
    if not args.no_old_runtime:
        print(f"[old runtime] building {MODEL} whole in fp32 in one process", flush=True)
        result["old_runtime"] = old_runtime_figure(MODEL)
        result["old_runtime_build_peak_bytes_per_rank"] = result["old_runtime"].get("peak_bytes")
        print(f"[old runtime] peak {gib(result['old_runtime_build_peak_bytes_per_rank'])} GiB "
              f"per rank", flush=True)
    partial = args.no_old_runtime or args.no_probe or set(args.plans) != set(DEFAULT_PLANS)
    before = read_results(args.out) if partial else {}
    if partial and before:  # a run of some parts keeps the others' results
        for key in ("old_runtime", "old_runtime_build_peak_bytes_per_rank", "build_probe_2x2"):
            if key in before and key not in result:
                result[key] = before[key]
        result["kept_from_earlier_run"] = {"date": before.get("date"),
                                           "git_commit": before.get("git_commit")}
    result["plans"] = dict(before.get("plans", {})) if partial else {}
    for name in args.plans:  # one after the other: never two jobs at once
        result["plans"][name] = run_plan(name, workdir, tokens, args.timeout, args.wait,
                                         args.margin)
    planned = result["plans"].get("2x2", {}).get("plan", {})
    if not args.no_probe and planned and "2x2" in args.plans:
        result["build_probe_2x2"] = build_probe(
            planned["path"], planned["predicted_memory_bytes_per_device"]["total"], workdir,
            args.timeout, args.wait)
    result["summary"] = summarize(result)
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    result["machine"] = machine_block(load_before, after=True)
    write_results(args.out, result)
    print(wrote_message(args.out, result))
    ran = [p for p in result["plans"].values() if "memory" in p]
    return 0 if ran and all(p["memory"]["all_within_20pct"] for p in ran) else 1


if __name__ == "__main__":
    sys.exit(main())
