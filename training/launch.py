"""Start a plan's ranks: ``planner run`` (:func:`launch`) and ``planner train``
(:func:`train`), on this node or one node of several.

Both run the one training job (:mod:`training.job`), its settings
(:class:`training.config.TrainConfig`) handed over as JSON: on one node, its
ranks are started by torch's elastic agent in this process and forked from a
preloaded forkserver (:mod:`training.local_agent`; a script that calls these
functions needs Python's ``if __name__ == "__main__":`` guard, as for any
multiprocessing); over several nodes, by ``torchrun ... -m training.job`` on
each node.
:func:`launch` runs ``planner run``'s job (``report="run"``: a constant
learning rate, the ``--check`` hook, :mod:`training.run_check`) and returns
rank 0's result JSON:

    >>> result = launch("plan.json", steps=2, check=True)
    >>> result["passed"], result["max_rel_grad_err"]

:func:`train` checks what a training job needs before any rank starts
(:func:`training.job.prepare`: plan, data, checkpoints, export folder), then
runs it with ``--max-restarts R``. The ranks' output goes to a log file; rank
0's progress lines are shown as they come (a rich progress bar on a terminal).
A failure is reported in one line with the log's path.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, TextIO

from ir.node import draws_random
from plan.format import load_plan
from training.config import CONFIG_ENV, TrainConfig
from training.local_agent import run_local_ranks
from training.torchrun import (LaunchError, Nodes, cpu_fallback_note, end_group,
                               first_error_line, keep_log, output_tail, rank_env,
                               rank_failure_line, run_ranks, runnable_world, timeout_error,
                               torchrun_placement)

__all__ = ["TrainOutcome", "launch", "train"]

_STEP_LINE = re.compile(r"^step (\d+)/(\d+)\b")
_ERROR_LINE = re.compile(r"^\[rank \d+\] error: ")


@dataclass(frozen=True)
class TrainOutcome:
    """How a launched job ended."""

    returncode: int  # torchrun's exit status (0: every rank finished)
    log_path: str  # the ranks' whole output
    error: str | None  # the ranks' first one-line error, if any
    bad_input: bool  # a rank refused its input (exit status 2)


def _log_path(config: TrainConfig) -> str:
    """Where the ranks' output is kept: beside ``--log``, in the checkpoint
    directory, or in a new temporary file."""
    if config.log:
        os.makedirs(os.path.dirname(os.path.abspath(config.log)), exist_ok=True)
        return config.log + ".ranks.log"
    if config.checkpoint_dir:
        os.makedirs(config.checkpoint_dir, exist_ok=True)
        return os.path.join(config.checkpoint_dir, "train-ranks.log")
    fd, path = tempfile.mkstemp(prefix="planner-train-", suffix=".log")
    os.close(fd)
    return path


def _torchrun_args(world: int, nodes: Nodes | None, max_restarts: int, plan_path: str
                   ) -> list[str]:
    return [*torchrun_placement(world, nodes, plan_path), f"--max-restarts={int(max_restarts)}"]


class _Progress:
    """Shows rank 0's step lines: a rich bar on a terminal, else the lines."""

    def __init__(self, out: TextIO):
        self.out = out
        self.bar: Any = None
        self.task: Any = None

    def __enter__(self) -> "_Progress":
        if self.out.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

            self.bar = Progress(TextColumn("training"), BarColumn(), MofNCompleteColumn(),
                                TextColumn("{task.description}"), transient=False)
            self.bar.start()
        return self

    def line(self, text: str) -> None:
        match = _STEP_LINE.match(text)
        if match is None:
            if _ERROR_LINE.match(text):
                self._print(text)
            return
        if self.bar is None:
            self._print(text)
            return
        done, total = int(match.group(1)), int(match.group(2))
        if self.task is None:
            self.task = self.bar.add_task(text, total=total)
        self.bar.update(self.task, completed=done, description=text.split("  ", 1)[-1])

    def _print(self, text: str) -> None:
        if self.bar is not None:
            self.bar.console.print(text, markup=False, highlight=False)
        else:
            print(text, file=self.out, flush=True)

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.stop()


def train(config: TrainConfig, *, nodes: Nodes | None = None, max_restarts: int = 0,
          env: dict[str, str] | None = None, out: TextIO | None = None) -> TrainOutcome:
    """Check ``config`` (raises the job's one-line input errors, see
    :func:`training.job.prepare`, and :class:`training.torchrun.LaunchError` for
    a plan this runtime cannot run), then run the job under torchrun and wait.

    Args:
        nodes: this node's part of a job over several nodes; None: all ranks here.
        max_restarts: torchrun restarts the ranks this many times after a
            failure; they resume from the newest finished checkpoint.
        env: extra environment variables for the ranks.
        out: where progress and notes go (default: standard error).
    """
    from training.job import prepare

    out = out or sys.stderr
    job = prepare(config)
    runnable_world(job.plan, config.plan, None)
    note = cpu_fallback_note(job.plan, config.plan)
    if note:
        print(f"note: {note}", file=out, flush=True)
    log_path = _log_path(config)
    with open(log_path, "a") as log, _Progress(out) as progress:
        def show(line: str) -> None:
            log.write(line)
            log.flush()
            progress.line(line.rstrip("\n"))

        if nodes is None:  # every rank here: the elastic agent in this process
            run = run_local_ranks(job.plan.world_size, json.dumps(config.as_dict()),
                                  rank_env(env), on_cpu=_on_cpu(job.plan),
                                  max_restarts=max_restarts, on_line=show)
            log.write(run.agent_log)  # the ranks' lines went to the log as they came
            returncode, output = run.returncode, run.output
        else:
            returncode, output = _train_on_nodes(config, job.plan.world_size, nodes, max_restarts,
                                                  env, show)
    error = first_error_line(output) if returncode else None
    bad_input = returncode != 0 and bool(re.search(r"exitcode\s*:\s*2\b", output))
    return TrainOutcome(returncode, log_path, error, bad_input)


def _on_cpu(plan: Any) -> bool:
    """Whether the plan's ranks run on the CPU here (:func:`codegen.rank_process.runtime_device`)."""
    from codegen.rank_process import runtime_device

    return runtime_device(plan.cluster, 0)[1].type == "cpu"


def _train_on_nodes(config: TrainConfig, world: int, nodes: Nodes, max_restarts: int,
                    env: dict[str, str] | None, show: Callable[[str], None]) -> tuple[int, str]:
    """This node's ranks of a job over several nodes, under torchrun, each line
    they write handed to ``show``; torchrun's exit status and the whole output."""
    # the config goes to the ranks in the environment: torchrun's own parser would
    # take some of the job's flags (--log) for abbreviations of its options
    cmd = [sys.executable, "-m", "torch.distributed.run",
           *_torchrun_args(world, nodes, max_restarts, config.plan),
           "-m", "training.job"]
    env = {**(env or {}), CONFIG_ENV: json.dumps(config.as_dict())}
    text: list[str] = []
    proc = subprocess.Popen(cmd, env=rank_env(env), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        for line in proc.stdout:
            text.append(line)
            show(line)
        proc.wait()
    except BaseException:
        end_group(proc)
        raise
    return proc.returncode, "".join(text)


def launch(plan_path: str | os.PathLike, *, nproc: int | None = None, steps: int = 1,
           check: bool = False, record: str | os.PathLike | None = None,
           optimizer: str = "sgd", lr: float = 1e-3, rtol: float | None = None,
           timeout_s: float = 300.0, env: dict[str, str] | None = None,
           cwd: str | os.PathLike | None = None, nodes: Nodes | None = None,
           compile: bool | None = None) -> dict[str, Any]:
    """Run ``planner run``'s job on a plan and return rank 0's result JSON.

    Args:
        plan_path: a plan.json.
        nproc: number of ranks; must equal the plan's mesh size (default: that size).
        steps: training steps, at the constant learning rate ``lr``.
        check: compare step 1 against one process and the plan's placements; the
            returned dict's ``passed`` says whether it did (a failed check is still
            returned, not raised).
        record: where to write the plan with the observed placements.
        optimizer, lr: sgd or adamw, and its learning rate.
        rtol: the check's tolerance (default: by the plan's precision,
            :func:`training.reference.check_tolerance`).
        timeout_s: wall-clock limit for the whole launch.
        env: extra environment variables for the ranks.
        cwd: working directory of the ranks (default: this process's), against
            which a relative ``file.py:factory`` model source resolves; the repo
            root is put on ``PYTHONPATH`` so the packages import from anywhere.
        nodes: this node's part of a run over several nodes (:class:`Nodes`);
            None runs every rank here. On a node other than 0 the result is
            ``{"node_rank", "returncode", "output"}``.
        compile: run the per-rank program through ``torch.compile`` (True),
            eager (False), or as the plan's ``training.compile`` says (None).

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
    with tempfile.TemporaryDirectory(prefix="planner-run-") as tmp:
        result_path = os.path.join(tmp, "result.json")
        config = TrainConfig(
            plan=os.path.abspath(plan_path), steps=int(steps), optimizer=optimizer,
            lr=float(lr), min_lr_ratio=1.0, report="run", check=bool(check), rtol=rtol,
            record=os.path.abspath(os.fspath(record)) if record is not None else None,
            result_json=result_path, compile=compile)
        if nodes is None:  # every rank here: the elastic agent in this process
            run = run_local_ranks(world, json.dumps(config.as_dict()), rank_env(env),
                                  on_cpu=_on_cpu(plan), cwd=os.fspath(cwd) if cwd else None,
                                  timeout_s=timeout_s)
            if run.timed_out:
                raise timeout_error(plan_path, timeout_s, world, run.output)
            return _read_result(result_path, run.returncode, run.stdout,
                                run.stderr + run.agent_log, plan_path, world)
        cmd = [sys.executable, "-m", "torch.distributed.run",
               *torchrun_placement(world, nodes, plan_path), "-m", "training.job"]
        run_env = rank_env({**(env or {}), CONFIG_ENV: json.dumps(config.as_dict())})
        returncode, stdout, stderr = run_ranks(cmd, cwd, run_env, timeout_s, plan_path, world)
        if nodes.node_rank != 0:
            return _node_status(nodes.node_rank, returncode, stdout, stderr, plan_path, world)
        return _read_result(result_path, returncode, stdout, stderr, plan_path, world)


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


def _node_status(node_rank: int, returncode: int, stdout: str, stderr: str, plan_path: str,
                 world: int) -> dict[str, Any]:
    """What a node other than 0 reports: its ranks' exit status (node 0 holds the
    result); a :class:`LaunchError` when they failed."""
    if returncode != 0:
        output = stdout + stderr
        log_path = keep_log(output)
        line = f"node {node_rank}: {rank_failure_line(output, returncode, log_path)}"
        raise LaunchError(f"{line}\n--- output tail ({plan_path}, {world} ranks, node "
                          f"{node_rank}) ---\n{output_tail(output)}", first_line=line,
                          log_path=log_path)
    return {"node_rank": node_rank, "returncode": returncode,
            "output": output_tail(stdout, 20)}


def _read_result(result_path: str, returncode: int, stdout: str, stderr: str,
                 plan_path: str, world: int) -> dict[str, Any]:
    """Rank 0's result, with the exit status and the output's tail; a
    :class:`LaunchError` where the ranks refused the plan or wrote no result."""
    output = stdout + stderr
    where = f"{plan_path}, {world} ranks"
    if os.path.exists(result_path):
        with open(result_path) as f:
            result = json.load(f)
        if "refused" in result:  # the ranks refused the plan (training.run_check.refuse)
            raise LaunchError(f"{result['refused']}\n--- output tail ({where}) ---\n"
                              f"{output_tail(output)}", first_line=result["refused"],
                              user_error=True)
        result["returncode"] = returncode
        result["output"] = output_tail(stdout, 20)
        return result
    log_path = keep_log(output)
    line = rank_failure_line(output, returncode, log_path)
    raise LaunchError(f"{line}\n--- output tail ({where}) ---\n{output_tail(output)}",
                      first_line=line, log_path=log_path)
