"""Launch a plan under torchrun and read back rank 0's result.

    >>> result = launch("plan.json", steps=2, check=True)
    >>> result["passed"], result["max_rel_grad_err"]

Runs ``python -m torch.distributed.run --standalone --nproc_per_node N -m
codegen.rank_main PLAN.json ...`` with N the plan's world size (gloo for a CPU
cluster's plan, NCCL for a GPU cluster's) and ``OMP_NUM_THREADS=1``.

On several nodes, each node calls ``launch(..., nodes=Nodes(K, R, HOST, PORT))``
(``planner run --nnodes K --node-rank R --master-addr HOST --master-port PORT``):
torchrun's static rendezvous, world / K ranks per node, global rank 0 on node 0
(whose call returns the result; the others return their exit status).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass
from typing import Any, Sequence

from ir.node import draws_random
from codegen.runnable import unrunnable_reason
from plan.format import load_plan, placement_error

__all__ = ["LaunchError", "Nodes", "REPO_ROOT", "cpu_fallback_note", "end_group",
           "first_error_line", "launch", "rank_env", "rank_failure_line", "runnable_world",
           "torchrun_placement"]

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class LaunchError(RuntimeError):
    """The ranks did not produce a result; the message ends with their output's tail.

    Attributes:
        first_line: the one line ``planner run`` prints: the ranks' own error
            where they printed one, what to do, and where their whole output is.
        user_error: the ranks refused the plan or the model (a plan of another
            program, mesh or world size: ``codegen.rank_main`` exit status 2 or 3),
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


def _tail(text: str, lines: int = 40) -> str:
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


def _keep_log(output: str, prefix: str = "planner-run-") -> str:
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


def launch(plan_path: str | os.PathLike, *, nproc: int | None = None, steps: int = 1,
           check: bool = False, record: str | os.PathLike | None = None,
           optimizer: str = "sgd", lr: float = 1e-3, rtol: float | None = None,
           timeout_s: float = 300.0, extra_args: Sequence[str] = (),
           env: dict[str, str] | None = None, cwd: str | os.PathLike | None = None,
           nodes: "Nodes | None" = None) -> dict[str, Any]:
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
        cwd: working directory of the ranks (default: this process's), against
            which a relative ``file.py:factory`` model source resolves; the repo
            root is put on ``PYTHONPATH`` so the packages import from anywhere.
        nodes: this node's part of a run over several nodes (:class:`Nodes`);
            None runs every rank here. On a node other than 0 the result is
            ``{"node_rank", "returncode", "output"}``.

    Raises:
        LaunchError: the mesh size and ``nproc`` disagree, the ranks timed out, or
            they exited without a result (the message starts with the ranks' own
            one-line error where there is one, and ends with their output's tail).
    """
    plan_path = os.fspath(plan_path)
    plan = load_plan(plan_path)
    world = runnable_world(plan, plan_path, nproc)
    if check:
        _refuse_random_check(plan, plan_path)
    where = torchrun_placement(world, nodes, plan_path)
    with tempfile.TemporaryDirectory(prefix="codegen-launch-") as tmp:
        result_path = os.path.join(tmp, "result.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", *where, "-m", "codegen.rank_main",
               os.path.abspath(plan_path), "--steps", str(int(steps)),
               "--result-json", result_path, "--optimizer", optimizer, "--lr", repr(lr)]
        if rtol is not None:  # else the plan's precision decides (codegen.reference.check_tolerance)
            cmd += ["--rtol", repr(rtol)]
        if check:
            cmd.append("--check")
        if record is not None:
            cmd += ["--record", os.path.abspath(os.fspath(record))]
        cmd += list(extra_args)
        returncode, stdout, stderr = _run_ranks(cmd, cwd, rank_env(env), timeout_s,
                                                plan_path, world)
        if nodes is not None and nodes.node_rank != 0:
            return _node_status(nodes.node_rank, returncode, stdout, stderr, plan_path, world)
        return _read_result(result_path, returncode, stdout, stderr, plan_path, world)


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


def _node_status(node_rank: int, returncode: int, stdout: str, stderr: str, plan_path: str,
                 world: int) -> dict[str, Any]:
    """What a node other than 0 reports: its ranks' exit status (node 0 holds the
    result); a :class:`LaunchError` when they failed."""
    if returncode != 0:
        output = stdout + stderr
        log_path = _keep_log(output)
        line = f"node {node_rank}: {rank_failure_line(output, returncode, log_path)}"
        raise LaunchError(f"{line}\n--- output tail ({plan_path}, {world} ranks, node "
                          f"{node_rank}) ---\n{_tail(output)}", first_line=line,
                          log_path=log_path)
    return {"node_rank": node_rank, "returncode": returncode, "output": _tail(stdout, 20)}


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


def _refuse_random_check(plan: Any, plan_path: str) -> None:
    """Refuse ``--check`` (:class:`LaunchError`, a user error) for a program that
    draws random numbers: the ranks draw other numbers than one process (each
    its own shard of a dropout mask), so losses and gradients would differ by
    chance, and no tolerance could tell that from a wrong plan."""
    drawn = Counter(node.op for node in plan.nodes.values() if draws_random(node.op))
    if drawn:
        ops = ", ".join(f"{n} x {op}" for op, n in sorted(drawn.items()))
        message = (f"plan {plan_path}: --check cannot compare this model with one process: "
                   f"its program draws random numbers ({ops}), which a distributed run draws "
                   f"differently; set its dropout to 0 for the check (for a Hugging Face "
                   f"config: attn_pdrop, resid_pdrop, embd_pdrop or attention_dropout, "
                   f"hidden_dropout) and re-plan, or run without --check")
        raise LaunchError(message, first_line=message, user_error=True)


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


def _run_ranks(cmd: list[str], cwd: str | os.PathLike | None, run_env: dict[str, str],
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
        log_path = _keep_log(stdout + stderr)
        line = (f"plan {plan_path} did not finish within {timeout_s:.0f} s on {world} ranks "
                f"(ended); the ranks' whole output: {log_path}")
        raise LaunchError(f"{line}\noutput tail:\n{_tail(stdout + stderr)}", first_line=line,
                          log_path=log_path) from None
    except BaseException:
        end_group(proc)
        raise
    return proc.returncode, stdout, stderr


def _read_result(result_path: str, returncode: int, stdout: str, stderr: str,
                 plan_path: str, world: int) -> dict[str, Any]:
    """Rank 0's result, with the exit status and the output's tail; a
    :class:`LaunchError` where the ranks refused the plan or wrote no result."""
    output = stdout + stderr
    where = f"{plan_path}, {world} ranks"
    if os.path.exists(result_path):
        with open(result_path) as f:
            result = json.load(f)
        if "refused" in result:  # the ranks refused the plan (codegen.rank_main._refuse)
            raise LaunchError(f"{result['refused']}\n--- output tail ({where}) ---\n"
                              f"{_tail(output)}", first_line=result["refused"], user_error=True)
        result["returncode"] = returncode
        result["output"] = _tail(stdout, 20)
        return result
    log_path = _keep_log(output)
    line = rank_failure_line(output, returncode, log_path)
    raise LaunchError(f"{line}\n--- output tail ({where}) ---\n{_tail(output)}",
                      first_line=line, log_path=log_path)
