"""One node's ranks started from this process by torch's elastic agent.

torchrun is torch's elastic agent run as its own program, starting each rank as
a fresh Python that imports torch and the job again (several seconds of CPU a
rank). :func:`run_local_ranks` runs the same agent
(:func:`torch.distributed.launcher.api.elastic_launch`: the same rendezvous, rank
environment, failure records and restarts) inside this process. Ranks on the
CPU fork from a forkserver that imported torch and the job once
(:data:`PRELOADED`; the forkserver lives as long as this process, so later
launches reuse it). Ranks on GPUs start as fresh interpreters (``spawn``), as
torchrun's do: CUDA does not survive a fork of a process that touched it, and
nothing here proves torch's imports never do. Each rank runs :func:`rank_main`, which is
``python -m training.job`` as a function; its output goes to files, read back
as torchrun's would have printed it.

Runs over several nodes keep torchrun (:mod:`training.torchrun`), started on
each node by the user.
"""

from __future__ import annotations

import contextlib
import glob
import io
import logging
import multiprocessing
import os
import signal
import sys
import tempfile
import threading
import uuid
from dataclasses import dataclass
from typing import Callable, Iterator

__all__ = ["PRELOADED", "LocalRun", "rank_main", "run_local_ranks"]

#: what the forkserver imports once for every rank it forks: torch, its export
#: and compile machinery, and the job with the runtime it drives
PRELOADED = ("torch", "torch.distributed", "torch.export", "torch._dynamo", "torch._refs",
             "training.job", "training.run_check", "training.reference",
             "codegen.parallel_model", "codegen.pipeline", "codegen.capture", "models.source")

_PID_FOLDER = "pids"
#: what the agent itself sets in each rank's environment
_AGENT_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                    "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME",
                    "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_")


def rank_main(config_json: str, env: dict[str, str], cwd: str | None, pid_dir: str) -> None:
    """One rank: the job (:func:`training.job.main`) with ``env`` in its
    environment and ``cwd`` its working directory; a non-zero exit status of
    the job is the rank's."""
    os.environ.update(env)
    if cwd:
        os.chdir(cwd)
    with open(os.path.join(pid_dir, os.environ["RANK"]), "w") as f:
        f.write(str(os.getpid()))
    import torch

    from training.config import CONFIG_ENV
    from training.job import main

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    os.environ[CONFIG_ENV] = config_json
    code = main([])
    sys.stdout.flush()
    sys.stderr.flush()
    if code:
        sys.exit(code)


def _rank_logs(log_dir: str, stream: str, rank: int | None = None) -> list[str]:
    """The ranks' ``stream`` files (stdout or stderr) under ``log_dir``, by
    attempt and then rank."""
    pattern = os.path.join(log_dir, "*", "attempt_*", "*" if rank is None else str(rank),
                           f"{stream}.log")

    def order(path: str) -> tuple[int, int]:
        parts = path.split(os.sep)
        return int(parts[-3].split("_")[1]), int(parts[-2])

    return sorted(glob.glob(pattern), key=order)


def _read_all(paths: list[str]) -> str:
    text = []
    for path in paths:
        with open(path, errors="replace") as f:
            text.append(f.read())
    return "".join(text)


class _Follower(threading.Thread):
    """Hands each line a rank writes (to either stream) to ``on_line`` as it
    comes, over every attempt (whole lines, file by file)."""

    def __init__(self, log_dir: str, on_line: Callable[[str], None]):
        super().__init__(daemon=True)
        self.log_dir, self.on_line = log_dir, on_line
        self.done = threading.Event()
        self.offsets: dict[str, int] = {}

    def run(self) -> None:
        while not self.done.is_set():
            self.read_new()
            self.done.wait(0.2)
        self.read_new()

    def read_new(self) -> None:
        for path in _rank_logs(self.log_dir, "stdout") + _rank_logs(self.log_dir, "stderr"):
            with open(path, "rb") as f:  # bytes: an offset stays exact past any odd byte
                f.seek(self.offsets.get(path, 0))
                chunk = f.read()
            complete = chunk[:chunk.rfind(b"\n") + 1]
            self.offsets[path] = self.offsets.get(path, 0) + len(complete)
            for line in complete.decode(errors="replace").splitlines(keepends=True):
                self.on_line(line)


def _end_ranks(pid_dir: str) -> None:
    """Kill the ranks that wrote their pid to ``pid_dir``."""
    for name in os.listdir(pid_dir):
        try:
            with open(os.path.join(pid_dir, name)) as f:
                os.kill(int(f.read()), signal.SIGKILL)
        except (OSError, ValueError):
            continue


#: the loggers the agent and torch's process starter report through (a rank's
#: failure with its traceback, the peers it ends), which torchrun printed to its
#: own output
_AGENT_LOGGERS = ("torch.distributed.elastic", "torch.distributed.launcher",
                  "torch.multiprocessing")


@contextlib.contextmanager
def _agent_records() -> Iterator[io.StringIO]:
    """Collect what the agent logs while it runs, instead of printing it to this
    process's standard error: it belongs with the ranks' output."""
    records = io.StringIO()
    handler = logging.StreamHandler(records)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    loggers = [logging.getLogger(name) for name in _AGENT_LOGGERS]
    kept = [logger.propagate for logger in loggers]
    for logger in loggers:
        logger.addHandler(handler)
        logger.propagate = False
    try:
        yield records
    finally:
        for logger, propagate in zip(loggers, kept):
            logger.removeHandler(handler)
            logger.propagate = propagate


def _quiet_resource_tracker() -> None:
    """Start multiprocessing's resource tracker, which this process shares with
    every rank it forks, with its standard error on the null device. A rank the
    agent ends (a peer failed) leaves the semaphores it held to the tracker, which
    frees them and, when this process exits, warns of them on the user's terminal,
    after the one line that reported the failure. The ranks' own output is kept
    in their log; the tracker's note is about its cleaning, not the run."""
    from multiprocessing import resource_tracker

    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            resource_tracker.ensure_running()
    finally:
        os.dup2(saved, 2)
        os.close(saved)


@dataclass(frozen=True)
class LocalRun:
    """How one node's ranks ended (:func:`run_local_ranks`)."""

    returncode: int  # 0: every rank finished; 1 otherwise, as torchrun's
    stdout: str  # the ranks' standard output, rank by rank
    stderr: str  # the ranks' standard error, rank by rank
    agent_log: str  # what the agent logged, then its record of a failure, as torchrun prints it
    timed_out: bool  # the timeout passed first and the ranks were killed

    @property
    def output(self) -> str:
        """Everything, as torchrun's output would hold it."""
        return self.stdout + self.stderr + self.agent_log


def run_local_ranks(world: int, config_json: str, env: dict[str, str], *, on_cpu: bool,
                    cwd: str | None = None, timeout_s: float | None = None,
                    max_restarts: int = 0, on_line: Callable[[str], None] | None = None
                    ) -> LocalRun:
    """Run ``world`` ranks of the job configured by ``config_json`` on this node
    and wait: torch's elastic agent in this process, ranks forked from the
    preloaded forkserver where they run ``on_cpu`` (else spawned), restarted
    up to ``max_restarts`` times after a
    failure. ``on_line`` gets each line the ranks write as it comes (rank
    0's progress lines, any rank's error line)."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    env = {k: v for k, v in env.items() if not k.startswith(_AGENT_VARIABLES)}
    _quiet_resource_tracker()
    if on_cpu:
        multiprocessing.set_forkserver_preload(list(PRELOADED))
    with tempfile.TemporaryDirectory(prefix="planner-ranks-") as log_dir:
        pid_dir = os.path.join(log_dir, _PID_FOLDER)
        os.makedirs(pid_dir)
        config = LaunchConfig(
            min_nodes=1, max_nodes=1, nproc_per_node=world, run_id=str(uuid.uuid4()),
            rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=max_restarts,
            start_method="forkserver" if on_cpu else "spawn",
            logs_specs=DefaultLogsSpecs(log_dir=log_dir, redirects=Std.ALL))
        timed_out = threading.Event()

        def expire() -> None:
            timed_out.set()
            _end_ranks(pid_dir)

        timer = threading.Timer(timeout_s, expire) if timeout_s else None
        follower = _Follower(log_dir, on_line) if on_line else None
        for thread in (timer, follower):
            if thread is not None:
                thread.start()
        failure = ""
        try:
            with _agent_records() as records:
                try:
                    elastic_launch(config, rank_main)(config_json, env, cwd, pid_dir)
                    returncode = 0
                except ChildFailedError as err:
                    failure = err.format_msg()
                    returncode = 1
        finally:
            if timer is not None:
                timer.cancel()
            if follower is not None:
                follower.done.set()
                follower.join()
        return LocalRun(returncode, _read_all(_rank_logs(log_dir, "stdout")),
                        _read_all(_rank_logs(log_dir, "stderr")), records.getvalue() + failure,
                        timed_out.is_set())

