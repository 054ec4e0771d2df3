"""Starting a plan's ranks under torchrun, and reading how they ended.

The parts :mod:`training.launch` (``planner run`` and ``planner train``) starts
ranks with: which plans and worlds can run here (:func:`runnable_world`,
:func:`cpu_fallback_note`), torchrun's placement of the ranks on one node or
several (:func:`torchrun_placement`, :class:`Nodes`), their environment
(:func:`rank_env`), running and ending them (:func:`run_ranks`,
:func:`end_group`), and the one line a failure is reported in
(:class:`LaunchError`, :func:`first_error_line`, :func:`rank_failure_line`).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import tempfile
from dataclasses import dataclass
from typing import Any

from codegen.runnable import unrunnable_reason
from plan.format import placement_error

__all__ = ["LaunchError", "Nodes", "REPO_ROOT", "cpu_fallback_note", "end_group",
           "first_error_line", "keep_log", "output_tail", "rank_env", "rank_failure_line",
           "run_ranks", "runnable_world", "timeout_error", "torchrun_placement"]

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

class LaunchError(RuntimeError):
    """The ranks did not produce a result; the message ends with their output's tail.

    Attributes:
        first_line: the one line ``planner run`` prints: the ranks' own error
            where they printed one, what to do, and where their whole output is.
        user_error: the ranks refused the plan or the model (a plan of another
            program, mesh or world size: the job's exit status 2 or 3),
            which the user fixes, rather than failing while running it.
        log_path: the file holding the ranks' whole output (None where no rank ran).
    """

    def __init__(self, message: str, first_line: str | None = None, user_error: bool = False,
                 log_path: str | None = None):
        super().__init__(message)
        self.first_line = first_line or (message.strip().splitlines() or [""])[0]
        self.user_error = user_error
        self.log_path = log_path


def end_group(proc: subprocess.Popen) -> None:
    """Terminate the launched torchrun and its ranks (their own process group)."""
    for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def output_tail(text: str, lines: int = 40) -> str:
    """The last ``lines`` lines of the ranks' ``text``."""
    return "\n".join(text.strip().splitlines()[-lines:])


_ERROR_RE = re.compile(r"\[rank (\d+)\] error: (.*?)(?=\[rank \d+\] error: |$)", re.M)
# A rank whose peer died fails in its next collective: that error is a
# consequence, not the cause, and is named only when no rank said more.
_PEER_GONE = re.compile(r"Connection (closed|reset) by peer|Broken pipe|NCCL (error|communicator)"
                        r"|ProcessGroup\w* is (aborted|shut ?down)|recvBytes|sendBytes"
                        r"|Socket Timeout|watchdog", re.I)
# torchrun's record of a rank ended by a signal: "exitcode  : -9 (pid: ...)"
_KILLED_RE = re.compile(r"exitcode\s*:\s*-(9|6|11)\b")


def first_error_line(text: str) -> str | None:
    """The ranks' one-line error that says most: the first rank's, passing over
    a rank that only lost its peer (ranks' lines may be interleaved)."""
    errors = [m.group(2).strip() for m in _ERROR_RE.finditer(text)]
    causes = [e for e in errors if not _PEER_GONE.search(e)]
    return (causes or errors or [None])[0]


def rank_failure_line(output: str, returncode: int, log_path: str | None) -> str:
    """One line for ranks that failed while running a plan: the failing rank's
    own error (the op and the reason), what to do, and where the whole output
    is (``log_path``)."""
    error = first_error_line(output)
    killed = _KILLED_RE.search(output)
    if killed and (error is None or _PEER_GONE.search(error)):
        sig = {"9": "SIGKILL", "6": "SIGABRT", "11": "SIGSEGV"}[killed.group(1)]
        error = f"a rank was ended by {sig}"
        advice = ("most likely the machine ran out of memory: plan for more devices or a "
                  "smaller --batch-size, or give the ranks more memory"
                  if sig == "SIGKILL" else "a crash inside torch; report it with the plan")
    elif error is None:
        error = f"the ranks exited with status {returncode} without saying why"
        advice = "report it with the plan"
    elif re.search(r"DTensor|\bview\b|stride|Redistribut|placement|shard", error, re.I):
        advice = ("DTensor cannot run the plan's placements there: re-plan with this "
                  "planner (it plans only placements DTensor runs), or plan a data-parallel "
                  "mesh (--mesh N); report it with the plan if it persists")
    else:
        advice = "the plan or the runtime is at fault, not the model: report it with the plan"
    where = f"; the ranks' whole output: {log_path}" if log_path else ""
    return f"{error.rstrip('. ')}. {advice[0].upper()}{advice[1:]}{where}"


def keep_log(output: str, prefix: str = "planner-run-") -> str:
    """The ranks' whole output written to a new file that outlives the launch; its path."""
    fd, path = tempfile.mkstemp(prefix=prefix, suffix=".log")
    with os.fdopen(fd, "w") as f:
        f.write(output)
    return path


def cpu_fallback_note(plan: Any, plan_path: str) -> str | None:
    """One line saying that a GPU plan's ranks will run on this machine's CPU
    (it has no CUDA), or None where they run where the plan says."""
    import torch

    if plan.cluster.get("backend") == "gloo" or torch.cuda.is_available():
        return None
    return (f"plan {plan_path} is for {plan.cluster.get('name', 'a GPU cluster')}, but this "
            f"machine has no CUDA device: its {plan.world_size} ranks run on the CPU with gloo "
            f"(to try the plan, not to time it)")


def torchrun_placement(world: int, nodes: "Nodes | None", plan_path: str) -> list[str]:
    """torchrun's arguments that start ``world`` ranks: all on this node
    (standalone), or this node's part of ``nodes``."""
    if nodes is not None:
        return nodes.torchrun_args(world, plan_path)
    return ["--standalone", f"--nproc_per_node={world}"]


@dataclass(frozen=True)
class Nodes:
    """One node's part of a run over ``nnodes`` nodes: torchrun's static
    rendezvous at ``master_addr:master_port`` (node 0's address and a free port
    there), this node being ``node_rank``."""

    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int

    def torchrun_args(self, world: int, plan_path: str) -> list[str]:
        """torchrun's arguments for this node; :class:`LaunchError` (a user error)
        when the nodes cannot hold the plan's ranks evenly or the numbers are off."""
        problem = None
        if self.nnodes < 1 or world % self.nnodes:
            problem = (f"plan {plan_path} has {world} ranks, which {self.nnodes} nodes cannot "
                       f"share evenly; use a number of nodes that divides {world}")
        elif not 0 <= self.node_rank < self.nnodes:
            problem = f"--node-rank must be in 0..{self.nnodes - 1}, got {self.node_rank}"
        elif not 0 < self.master_port < 65536:
            problem = f"--master-port must be a TCP port (1-65535), got {self.master_port}"
        elif not self.master_addr:
            problem = "--master-addr must name node 0 (a host name or address)"
        if problem:
            raise LaunchError(problem, first_line=problem, user_error=True)
        return [f"--nnodes={self.nnodes}", f"--node-rank={self.node_rank}",
                f"--master-addr={self.master_addr}", f"--master-port={self.master_port}",
                f"--nproc_per_node={world // self.nnodes}"]


def runnable_world(plan: Any, plan_path: str, nproc: int | None) -> int:
    """The plan's world size, after refusing (:class:`LaunchError`) a plan this
    runtime cannot run or ``nproc`` ranks cannot run, before any rank starts."""
    wrong = placement_error(plan)
    if wrong:
        message = f"plan {plan_path}: {wrong}; regenerate it with `planner plan`"
        raise LaunchError(message, first_line=message, user_error=True)
    reason = unrunnable_reason(plan)
    if reason:
        message = f"plan {plan_path}: {reason}"
        raise LaunchError(message, first_line=message, user_error=True)
    world = plan.world_size
    if nproc is not None and int(nproc) != world:
        raise LaunchError(
            f"plan {plan_path} is for a mesh of {world} devices {list(plan.mesh_shape)} "
            f"but nproc={nproc}; launch it with nproc={world} or re-plan for {nproc} devices")
    return world


def rank_env(env: dict[str, str] | None) -> dict[str, str]:
    """The ranks' environment: this one, one OpenMP thread, the repo root on
    ``PYTHONPATH``, then ``env``."""
    run_env = dict(os.environ)
    run_env["OMP_NUM_THREADS"] = "1"
    run_env["PYTHONPATH"] = os.pathsep.join(
        p for p in (REPO_ROOT, run_env.get("PYTHONPATH", "")) if p)
    if env:
        run_env.update(env)
    return run_env


def timeout_error(plan_path: str, timeout_s: float, world: int, output: str) -> LaunchError:
    """The error of ranks that ran past ``timeout_s`` seconds and were ended."""
    log_path = keep_log(output)
    line = (f"plan {plan_path} did not finish within {timeout_s:.0f} s on {world} ranks "
            f"(ended); the ranks' whole output: {log_path}")
    return LaunchError(f"{line}\noutput tail:\n{output_tail(output)}", first_line=line,
                       log_path=log_path)


def run_ranks(cmd: list[str], cwd: str | os.PathLike | None, run_env: dict[str, str],
              timeout_s: float, plan_path: str, world: int) -> tuple[int, str, str]:
    """Run torchrun's ``cmd`` (plan ``plan_path`` on ``world`` ranks); its exit
    status, stdout and stderr. Past ``timeout_s`` its ranks are ended and
    :class:`LaunchError` raised."""
    # torchrun and its ranks get their own process group, so that a timeout
    # ends all of them (and nothing else).
    proc = subprocess.Popen(cmd, cwd=os.fspath(cwd) if cwd else None, env=run_env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        end_group(proc)
        stdout, stderr = proc.communicate()
        raise timeout_error(plan_path, timeout_s, world, stdout + stderr) from None
    except BaseException:
        end_group(proc)
        raise
    return proc.returncode, stdout, stderr
