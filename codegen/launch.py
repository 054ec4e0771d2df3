"""Launch a plan under torchrun and read back rank 0's result.

    >>> result = launch("plan.json", steps=2, check=True)
    >>> result["passed"], result["max_rel_grad_err"]

Runs ``python -m torch.distributed.run --standalone --nproc_per_node N -m
codegen.rank_main PLAN.json ...`` with N the plan's world size (gloo on CPU, NCCL
when CUDA is available) and ``OMP_NUM_THREADS=1``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from typing import Any, Sequence

from planner.plan import load_plan

__all__ = ["LaunchError", "REPO_ROOT", "launch"]

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class LaunchError(RuntimeError):
    """The ranks did not produce a result; the message ends with their output's tail."""


def _tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


_ERROR_RE = re.compile(r"\[rank \d+\] error: (.*?)(?=\[rank \d+\] error: |$)", re.M)


def _first_error_line(text: str) -> str | None:
    """The first rank's one-line error (ranks' lines may be interleaved)."""
    m = _ERROR_RE.search(text)
    return m.group(1).strip() if m else None


def launch(plan_path: str | os.PathLike, *, nproc: int | None = None, steps: int = 1,
           check: bool = False, record: str | os.PathLike | None = None,
           optimizer: str = "sgd", lr: float = 1e-3, rtol: float = 1e-5,
           timeout_s: float = 300.0, extra_args: Sequence[str] = (),
           env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run a plan on ``nproc`` local processes and return rank 0's result JSON.

    Args:
        plan_path: a plan.json.
        nproc: number of ranks; must equal the plan's mesh size (default: that size).
        steps: training steps.
        check: compare step 1 against one process and the plan's placements; the
            returned dict's ``passed`` says whether it did (a failed check is still
            returned, not raised).
        record: where to write the plan with the observed placements.
        optimizer, lr, rtol: see ``python -m codegen.rank_main --help``.
        timeout_s: wall-clock limit for the whole launch.
        extra_args: more rank_main arguments.
        env: extra environment variables for the ranks.

    Raises:
        LaunchError: the mesh size and ``nproc`` disagree, the ranks timed out, or
            they exited without a result (the message starts with the ranks' own
            one-line error where there is one, and ends with their output's tail).
    """
    plan_path = os.fspath(plan_path)
    plan = load_plan(plan_path)
    world = plan.world_size
    if nproc is not None and int(nproc) != world:
        raise LaunchError(
            f"plan {plan_path} is for a mesh of {world} devices {list(plan.mesh_shape)} "
            f"but nproc={nproc}; launch it with nproc={world} or re-plan for {nproc} devices")
    with tempfile.TemporaryDirectory(prefix="codegen-launch-") as tmp:
        result_path = os.path.join(tmp, "result.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={world}", "-m", "codegen.rank_main",
               os.path.abspath(plan_path), "--steps", str(int(steps)),
               "--result-json", result_path, "--optimizer", optimizer, "--lr", repr(lr),
               "--rtol", repr(rtol)]
        if check:
            cmd.append("--check")
        if record is not None:
            cmd += ["--record", os.path.abspath(os.fspath(record))]
        cmd += list(extra_args)
        run_env = dict(os.environ)
        run_env["OMP_NUM_THREADS"] = "1"
        run_env["PYTHONPATH"] = os.pathsep.join(
            p for p in (REPO_ROOT, run_env.get("PYTHONPATH", "")) if p)
        run_env.setdefault("TORCHELASTIC_ERROR_FILE", os.path.join(tmp, "error.json"))
        if env:
            run_env.update(env)
        try:
            proc = subprocess.run(cmd, cwd=REPO_ROOT, env=run_env, capture_output=True,
                                  text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired as err:
            out = (err.stdout or "") + (err.stderr or "")
            if isinstance(out, bytes):
                out = out.decode(errors="replace")
            raise LaunchError(f"plan {plan_path} did not finish within {timeout_s:.0f} s on "
                              f"{world} ranks; output tail:\n{_tail(out)}") from None
        output = proc.stdout + proc.stderr
        if os.path.exists(result_path):
            with open(result_path) as f:
                result = json.load(f)
            result["returncode"] = proc.returncode
            result["output"] = _tail(proc.stdout, 20)
            return result
        first = _first_error_line(output)
        head = first or f"ranks exited with status {proc.returncode} and no result"
        raise LaunchError(f"{head}\n--- output tail ({plan_path}, {world} ranks) ---\n"
                          f"{_tail(output)}")
