"""Start a training job: ``planner train`` on this node (or one node of several).

:func:`train` checks what the job needs before any rank starts
(:func:`training.job.prepare`: plan, data, checkpoints, export folder), then
runs ``torchrun [--max-restarts R] -m training.job ...``. The ranks' output goes
to a log file; rank 0's progress lines are shown as they come (a rich progress
bar on a terminal). A failure is reported in one line with the log's path.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Any, TextIO

from codegen.launch import (Nodes, cpu_fallback_note, end_group, first_error_line, rank_env,
                            runnable_world, torchrun_placement)
from training.config import CONFIG_ENV, TrainConfig

__all__ = ["TrainOutcome", "train"]

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
    :func:`training.job.prepare`, and :class:`codegen.launch.LaunchError` for
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
    # the config goes to the ranks in the environment: torchrun's own parser would
    # take some of the job's flags (--log) for abbreviations of its options
    cmd = [sys.executable, "-m", "torch.distributed.run",
           *_torchrun_args(job.plan.world_size, nodes, max_restarts, config.plan),
           "-m", "training.job"]
    env = {**(env or {}), CONFIG_ENV: json.dumps(config.as_dict())}
    log_path = _log_path(config)
    text: list[str] = []
    with open(log_path, "a") as log, _Progress(out) as progress:
        proc = subprocess.Popen(cmd, env=rank_env(env), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            for line in proc.stdout:
                log.write(line)
                log.flush()
                text.append(line)
                progress.line(line.rstrip("\n"))
            proc.wait()
        except BaseException:
            end_group(proc)
            raise
    output = "".join(text)
    error = first_error_line(output) if proc.returncode else None
    bad_input = proc.returncode != 0 and bool(re.search(r"exitcode\s*:\s*2\b", output))
    return TrainOutcome(proc.returncode, log_path, error, bad_input)
