"""Every model family a user brings, planned, run and checked as a user would.

Tiny configs of ``transformers`` families (the library's defaults, dropout 0 so
that ``--check`` can compare with one process; Mixtral, Qwen2-MoE and
DeepSeek-V3 with their experts as transformers' grouped matmul, which plans
sharded: :mod:`ir.grouped_mm`) and a BatchNorm CNN of our own:
decoder-only LMs through ``--model hf:SPEC`` (:mod:`models.hf`), the others through
the factories of ``tests/coverage_models.py``. Each model is planned twice by
the ``planner`` command for ``local-cpu:4``, on a 2x2 mesh and with the
search's own choice, and each plan run by ``planner run --check`` in fp32 on 4
CPU ranks (gloo, one thread each). A row records, per mode, whether the plan,
the run and the check passed, the one-line error where one did not, the mesh
or pipeline chosen, the seconds, and whether a Python traceback reached the
terminal (it must not).

    OMP_NUM_THREADS=1 python -m benchmarks.model_coverage [--models bart vit] [--modes 2x2]

Writes ``benchmarks/results/model_coverage.json`` (models not run this time
keep their last row) and prints the table. Not part of ``make test``: about
30 minutes on the 2-core development machine.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

from benchmarks.common import git_commit, job_env, machine_info, read_results, write_results
from benchmarks.hf_models import MODELS as CAUSAL_LMS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results", "model_coverage.json")
FACTORIES = os.path.join(ROOT, "tests", "coverage_models.py")
CLUSTER = "local-cpu:4"
SEQ_LEN = 32  # of the hf: decoder-only LMs (the factories have their own)

#: name -> (family, --model source, extra `planner plan` arguments)
MODELS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "gpt2": ("decoder-only", CAUSAL_LMS["gpt2"], ("--seq-len", str(SEQ_LEN))),
    "llama": ("decoder-only", CAUSAL_LMS["llama"], ("--seq-len", str(SEQ_LEN))),
    "mistral": ("decoder-only", CAUSAL_LMS["mistral"], ("--seq-len", str(SEQ_LEN))),
    "qwen2": ("decoder-only", CAUSAL_LMS["qwen2"], ("--seq-len", str(SEQ_LEN))),
    "phi3": ("decoder-only", "hf:phi3,num_hidden_layers=2,hidden_size=64,intermediate_size=128,"
             "num_attention_heads=4,num_key_value_heads=2,vocab_size=256,pad_token_id=0,"
             "bos_token_id=1,eos_token_id=2", ("--seq-len", str(SEQ_LEN))),
    "mixtral": ("decoder-only, experts", CAUSAL_LMS["mixtral"], ("--seq-len", str(SEQ_LEN))),
    "qwen2-moe": ("decoder-only, experts", CAUSAL_LMS["qwen2_moe"], ("--seq-len", str(SEQ_LEN))),
    "deepseek-v3": ("decoder-only, experts", CAUSAL_LMS["deepseek_v3"],
                    ("--seq-len", str(SEQ_LEN))),
    "bert": ("encoder", f"{FACTORIES}:bert_mlm", ()),
    "deberta-v2": ("encoder", f"{FACTORIES}:deberta_v2_mlm", ()),
    "bart": ("encoder-decoder", f"{FACTORIES}:bart", ()),
    "vit": ("vision", f"{FACTORIES}:vit", ()),
    "resnet": ("vision, BatchNorm", f"{FACTORIES}:resnet", ()),
    "whisper": ("audio, encoder-decoder", f"{FACTORIES}:whisper", ()),
    "bn_cnn": ("ours, BatchNorm", f"{FACTORIES}:bn_cnn", ()),
}
#: mode -> its `planner plan` arguments
MODES = {"2x2": ("--mesh", "2x2"), "search": ()}


def _planner(args: list[str], timeout_s: float) -> tuple[int, str, str, float]:
    """``planner ARGS`` in a child process: exit status, stdout, stderr, seconds."""
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-m", "app.cli", *args], capture_output=True,
                              text=True, cwd=ROOT, env=job_env(), timeout=timeout_s)
    except subprocess.TimeoutExpired as err:
        out = err.stdout.decode() if isinstance(err.stdout, bytes) else (err.stdout or "")
        return 124, out, f"planner: error: did not finish within {timeout_s:.0f} s", timeout_s
    return proc.returncode, proc.stdout, proc.stderr, time.perf_counter() - t0


def _error_line(stderr: str) -> str | None:
    """The ``planner: error:`` line, without the prefix."""
    for line in stderr.splitlines():
        if line.startswith("planner: error: "):
            return line[len("planner: error: "):]
    return None


def run_mode(name: str, mode: str, workdir: str, timeout_s: float) -> dict[str, Any]:
    """Plan ``name`` in ``mode`` and run the plan with --check; a failure is
    recorded with its one-line reason, never raised."""
    _, source, extra = MODELS[name]
    path = os.path.join(workdir, f"{name}-{mode}.json")
    row: dict[str, Any] = {"plan": False, "run": False, "check": None, "error": None}
    code, out, err, secs = _planner(["plan", "--model", source, "--cluster", CLUSTER,
                                     *MODES[mode], *extra, "--quiet", "-o", path], timeout_s)
    row.update(plan_s=round(secs, 1), plan_exit=code, traceback="Traceback" in err)
    if code != 0:
        row["error"] = _error_line(err) or f"planner plan exited {code}: {err.strip()[-300:]}"
        return row
    from plan.format import load_plan

    plan = load_plan(path)
    row.update(plan=True, mesh=list(plan.mesh_shape),
               pipeline=None if plan.pipeline is None else {
                   "pp": plan.pipeline.pp, "schedule": plan.pipeline.schedule,
                   "microbatches": plan.pipeline.num_microbatches})
    code, out, err, secs = _planner(["run", path, "--check"], timeout_s)
    row.update(run_s=round(secs, 1), run_exit=code,
               traceback=row["traceback"] or "Traceback" in err)
    verdict = next((line for line in out.splitlines() if line.startswith("check ")), "")
    row["run"] = code in (0, 1) and bool(verdict)
    row["check"] = "PASSED" if verdict.startswith("check PASSED") else (
        "FAILED" if verdict else None)
    if row["check"] != "PASSED":
        row["error"] = _error_line(err) or verdict or f"planner run exited {code}"
    else:
        row["summary"] = verdict
    return row


def table(rows: dict[str, dict[str, Any]]) -> str:
    """The coverage table: model, family, then plan, run and check per mode, and
    the first error."""
    lines = [f"{'model':<11} {'family':<23} {'mode':<7} {'plan':<5} {'run':<4} {'check':<7} "
             f"error"]
    for name, row in rows.items():
        for mode, r in row["modes"].items():
            chosen = (f"pp{r['pipeline']['pp']}" if r.get("pipeline") else
                      "x".join(map(str, r["mesh"])) if r.get("mesh") else "")
            lines.append(f"{name:<11} {row['family']:<23} {mode:<7} "
                         f"{'ok' if r['plan'] else 'no':<5} {'ok' if r['run'] else 'no':<4} "
                         f"{r['check'] or '-':<7} {chosen + ' ' if chosen else ''}"
                         f"{r['error'] or ''}"[:400])
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import transformers

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--timeout", type=float, default=900, help="seconds per plan and per run")
    ap.add_argument("--out", default=RESULTS)
    args = ap.parse_args(argv)
    results = read_results(args.out)
    rows: dict[str, Any] = results.get("models", {})
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="model-coverage-") as tmp:
        for name in args.models:
            row = rows.get(name) if rows.get(name, {}).get("family") == MODELS[name][0] else None
            row = row or {"family": MODELS[name][0], "source": MODELS[name][1], "modes": {}}
            for mode in args.modes:
                row["modes"][mode] = run_mode(name, mode, tmp, args.timeout)
                r = row["modes"][mode]
                print(f"{name} {mode}: check {r['check']} {r['error'] or ''}", flush=True)
            row["passed"] = all(m["check"] == "PASSED" for m in row["modes"].values())
            row["git_commit"] = git_commit()
            rows[name] = row
    rows = {name: rows[name] for name in MODELS if name in rows}
    passed = sum(r["passed"] for r in rows.values())
    results.update(machine=machine_info(brief=True), git_commit=git_commit(),
                   transformers=transformers.__version__, cluster=CLUSTER,
                   precision="fp32", models=rows, passed=passed, total=len(rows),
                   pass_rate=round(passed / max(len(rows), 1), 3),
                   tracebacks=sorted(n for n, r in rows.items()
                                     if any(m.get("traceback") for m in r["modes"].values())),
                   wall_s=round(time.perf_counter() - t0, 1))
    write_results(args.out, results)
    print(table(rows))
    print(f"{passed}/{len(rows)} models pass --check on both plans "
          f"({100 * results['pass_rate']:.0f} %); wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
