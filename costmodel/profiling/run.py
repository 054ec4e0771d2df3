"""Running ``planner profile``'s measurement ranks and collecting their result.

:func:`measure` starts one ``python -m costmodel.profiling.worker`` process per
rank (see :mod:`costmodel.profiling.worker` for what each rank measures),
advances a progress bar on the ``step`` lines rank 0 prints, and returns the
result JSON rank 0 writes. Units: seconds.
"""

from __future__ import annotations

import json
import os
import queue as queue_mod
import subprocess
import sys
import tempfile
import threading
import time
from typing import IO, Any, Mapping

from costmodel.profiling.spec import ProfileError, require_rank_count
from costmodel.profiling.worker import count_steps

__all__ = ["measure"]


def _repository_root() -> str:
    """The folder ``costmodel`` sits in: the ranks' working directory and import root."""
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _make_progress(enabled: bool, total: int, description: str) -> Any:
    """A started ``rich`` progress bar of ``total`` steps, or None when not ``enabled``."""
    if not enabled:
        return None
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    prog = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), TextColumn("{task.fields[item]}"), transient=True)
    prog.start()
    prog.add_task(description, total=total, item="starting ranks")
    return prog


def _complete_spec(spec: Mapping[str, Any], ranks: int) -> dict[str, Any]:
    """A copy of ``spec`` with ``device`` and ``backend`` filled in when absent
    (CUDA and NCCL where a GPU is present, else CPU and gloo); raises
    :class:`ProfileError` when there are fewer GPUs than ``ranks``."""
    import torch

    spec = dict(spec)
    cuda = torch.cuda.is_available() if "device" not in spec else spec["device"] == "cuda"
    spec.setdefault("device", "cuda" if cuda else "cpu")
    spec.setdefault("backend", "nccl" if cuda else "gloo")
    if cuda and ranks > torch.cuda.device_count():
        raise ProfileError(f"{ranks} ranks need {ranks} GPUs, this machine has {torch.cuda.device_count()}")
    return spec


def _rank_environment(spec: Mapping[str, Any]) -> dict[str, str]:
    """This process's environment with ``OMP_NUM_THREADS`` = ``spec["threads"]``
    and the repository root first on ``PYTHONPATH``."""
    env = dict(os.environ, OMP_NUM_THREADS=str(spec.get("threads", 1)))
    root = _repository_root()
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _write_spec(spec: dict[str, Any], folder: str) -> str:
    """Add the ranks' rendezvous file and rank 0's result path under ``folder``
    to ``spec``, write it there as ``spec.json`` and return that path."""
    spec["init_method"] = f"file://{os.path.join(folder, 'store')}"
    spec["result_path"] = os.path.join(folder, "result.json")
    spec_path = os.path.join(folder, "spec.json")
    with open(spec_path, "w", encoding="utf-8") as f:
        json.dump(spec, f)
    return spec_path


def _start_ranks(procs: list[subprocess.Popen], spec_path: str, ranks: int, env: Mapping[str, str],
                 errs: list[IO[str]], worker: str) -> None:
    """Start the ``ranks`` worker processes, appending each to ``procs`` as it
    starts (so that a failed start still leaves the others to stop); rank 0's
    stdout is piped for its ``step`` lines, each rank's stderr goes to ``errs``."""
    for r in range(ranks):
        procs.append(subprocess.Popen(
            [sys.executable, "-m", worker, spec_path, str(r), str(ranks)],
            stdout=subprocess.PIPE if r == 0 else subprocess.DEVNULL, stderr=errs[r],
            stdin=subprocess.DEVNULL, env=env, cwd=_repository_root(), text=True))


def _pump_steps(stream: Any, steps: queue_mod.Queue[str]) -> None:
    """Put the label of every ``step <label>`` line of ``stream`` on ``steps``."""
    for line in stream:
        if line.startswith("step "):
            steps.put(line[5:].strip())


def _follow_ranks(procs: list[subprocess.Popen], errs: list[IO[str]], bar: Any, timeout_s: float) -> None:
    """Advance ``bar`` on rank 0's steps until every rank exits 0; raise
    :class:`ProfileError` when one fails or ``timeout_s`` seconds pass."""
    steps: queue_mod.Queue[str] = queue_mod.Queue()
    reader = threading.Thread(target=_pump_steps, args=(procs[0].stdout, steps), daemon=True)
    reader.start()
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            label = steps.get(timeout=0.1)
            if bar is not None:
                bar.update(bar.task_ids[0], advance=1, item=label)
            continue
        except queue_mod.Empty:
            pass
        codes = [p.poll() for p in procs]
        failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            raise ProfileError(f"profiling rank {failed[0]} failed: {_rank_error(errs[failed[0]])}")
        if all(c == 0 for c in codes):
            break
        if time.monotonic() > deadline:
            raise ProfileError(f"profiling did not finish within {timeout_s:.0f} s")
    reader.join(5)


def _read_result(path: str) -> dict[str, Any]:
    """Rank 0's result JSON; :class:`ProfileError` when it is missing or unreadable."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError):
        raise ProfileError("profiling ranks finished without a result") from None


def _stop_ranks(procs: list[subprocess.Popen]) -> None:
    """Terminate the ranks still running, wait for all (killing any that take
    over 10 seconds) and close rank 0's stdout pipe."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        if p.stdout is not None:
            p.stdout.close()


def measure(spec: Mapping[str, Any], ranks: int, *, progress: bool = True,
            description: str = "profiling", timeout_s: float = 600.0,
            worker: str = "costmodel.profiling.worker", steps: int | None = None) -> dict[str, Any]:
    """Run ``ranks`` processes of ``python -m <worker>`` and return rank 0's result.

    ``worker`` is :mod:`costmodel.profiling.worker` or another rank program of
    its protocol (:func:`costmodel.profiling.worker.serve`), which reports
    ``steps`` progress steps (default: the worker's :func:`count_steps`).
    ``spec`` holds the measurement lists (see :mod:`costmodel.profiling.worker`);
    ``device`` and ``backend`` are filled in when absent. Each rank runs with
    ``OMP_NUM_THREADS`` = ``spec["threads"]`` (default 1). The progress bar
    shows only when ``progress`` is true and stdout is a terminal. Raises
    :class:`ProfileError` when a rank fails or ``timeout_s`` passes (the ranks
    are then terminated).
    """
    require_rank_count(ranks)
    spec = _complete_spec(spec, ranks)
    total = count_steps(spec) if steps is None else steps
    show = progress and sys.stdout.isatty()
    env = _rank_environment(spec)
    with tempfile.TemporaryDirectory(prefix="planner-profile-") as tmp:
        spec_path = _write_spec(spec, tmp)
        procs: list[subprocess.Popen] = []
        errs = [open(os.path.join(tmp, f"rank{r}.err"), "w+", encoding="utf-8") for r in range(ranks)]
        bar = _make_progress(show, total, description)
        try:
            _start_ranks(procs, spec_path, ranks, env, errs, worker)
            _follow_ranks(procs, errs, bar, timeout_s)
            return _read_result(spec["result_path"])
        finally:
            _stop_ranks(procs)
            for e in errs:
                e.close()
            if bar is not None:
                bar.stop()


def _rank_error(err_file: IO[str]) -> str:
    """The last non-empty line a failed rank wrote to its stderr file."""
    err_file.flush()
    err_file.seek(0)
    return _last_line(err_file.read() or "no output")


def _last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1].strip() if lines else text
