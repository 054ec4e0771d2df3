"""Helpers the benchmark scripts share: what machine a result came from, its load,
and writing the result JSON.

    from benchmarks.common import load_average, machine_block, write_results, wrote_message

    load_before = load_average()
    ...                                               # measure
    result = {"machine": machine_block(load_before), ..., "wall_s": wall}
    write_results(path, result)
    print(wrote_message(path, result))                # "wrote PATH (12 s)"

A script run as ``python benchmarks/NAME.py`` puts the repository root on
``sys.path`` before importing this module (``benchmarks`` is not an installed
package).
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import time
from typing import Any, Callable, Sequence

from costmodel.profiling.machine import load_average

__all__ = ["BRIEF_MACHINE_KEYS", "RESULTS_DIR", "machine_info", "machine_block", "load_average",
           "load_average_1min", "cpu_pair_probe", "cpu_speed_probe", "git_commit", "median",
           "torch_speed_probe",
           "read_results", "write_results", "wrote_message"]

#: The folder the benchmarks write their result JSON (and plots) to: ``benchmarks/results``.
RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")

#: The keys of ``machine_info(brief=True)``, in order (the benchmarks' short machine record).
BRIEF_MACHINE_KEYS = ("platform", "python", "torch", "cpus", "processor")


def machine_info(*, brief: bool = False) -> dict[str, Any]:
    """This machine: ``costmodel.profiling.machine_info()`` (platform, python,
    processor, cpus, torch, memory_bytes, loadavg and, with CUDA, gpu and gpus).

    ``brief``: only platform, python, torch, cpus and processor (no load, memory or GPU).
    """
    from costmodel.profiling import machine_info as full_machine_info

    info = full_machine_info()
    if brief:
        return {k: info[k] for k in BRIEF_MACHINE_KEYS}
    return info


def load_average_1min() -> float | None:
    """The 1 minute load average, rounded to 0.01 (None where the platform has none)."""
    loads = load_average()
    return loads[0] if loads else None


def cpu_speed_probe(repeats: int = 3) -> float:
    """Seconds one core takes for a fixed pure-Python workload (the fastest of
    ``repeats``): the same machine type runs up to 2.3 times slower in
    some hours than in others, so a planning time is read next to this figure
    (0.14 s on a fast hour of the 2-core development machine)."""
    import time

    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        total = 0
        for i in range(3_000_000):
            total += i * i % 7
        best = min(best, time.perf_counter() - t0)
    return best


def cpu_pair_probe(repeats: int = 3) -> float:
    """Seconds of :func:`cpu_speed_probe` when two processes run it at the
    same time (the slower of the two): the planner's search runs on two
    cores, and on some hosts the second core is shared with other guests
    (2026-11-25: 0.21 s alone, 0.21 and 0.32 s side by side). Equals the
    one-core probe where there is one CPU or no fork."""
    import multiprocessing

    from planner.search.forked_workers import can_fork  # the search's own test for a second core

    if not can_fork():
        return cpu_speed_probe(repeats)
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(1) as pool:
        there = pool.apply_async(cpu_speed_probe, (repeats,))
        here = cpu_speed_probe(repeats)
        return max(here, there.get())


def torch_speed_probe(repeats: int = 20) -> dict[str, float]:
    """What one thread of this machine's CPU does now, by torch: ``gemm_gflops``
    (a 512 x 512 float32 matmul, GFLOP/s) and ``copy_gb_s`` (a 64 MiB copy,
    bytes read plus written, GB/s), each the median of ``repeats``. The 2-core
    development machine runs both up to twice as slowly in some hours as in
    others, and the load average does not show it; a step time is read next
    to these figures (taken where it ran: a rank's own are alike)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(512, 512), torch.randn(512, 512)
        src = torch.empty(16 * 2**20)
        dst = torch.empty_like(src)

        def seconds(fn: Callable[[], Any]) -> float:
            fn()
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                fn()
                times.append(time.perf_counter() - start)
            return statistics.median(times)

        gemm_s = seconds(lambda: a @ b)
        copy_s = seconds(lambda: dst.copy_(src))
    finally:
        torch.set_num_threads(threads)
    return {"gemm_gflops": round(2 * 512**3 / gemm_s / 1e9, 1),
            "copy_gb_s": round(2 * src.numel() * src.element_size() / copy_s / 1e9, 1)}


def machine_block(loadavg_before: list[float] | None, *, after: bool = False,
                  speed_before: dict[str, float] | None = None) -> dict[str, Any]:
    """A result's ``"machine"`` entry: :func:`machine_info` plus ``loadavg_before``
    (:func:`load_average` taken when the run started), ``speed_before``
    (:func:`torch_speed_probe` then, where given), ``speed_after``
    (:func:`torch_speed_probe` now) and, with ``after``, ``loadavg_after``
    (the load average now)."""
    block = {**machine_info(), "loadavg_before": loadavg_before}
    if speed_before is not None:
        block["speed_before"] = speed_before
    block["speed_after"] = torch_speed_probe()
    if after:
        block["loadavg_after"] = load_average()
    return block


def median(values: Sequence[float]) -> float | None:
    """The median of ``values``; None when there are none."""
    return statistics.median(values) if values else None


def time_alternating(steps: dict[str, Callable[[], Any]], *, warmup: int, rounds: int,
                     each: int) -> dict[str, list[float]]:
    """Seconds of each of ``steps``' steps (name -> one step), timed in
    ``rounds`` rounds of ``each`` steps of every one in turn after ``warmup``
    steps of each (which compile, allocate, warm caches), so that load
    elsewhere on the machine falls on all alike."""
    for fn in steps.values():
        for _ in range(warmup):
            fn()
    timed: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, fn in steps.items():
            for _ in range(each):
                t0 = time.perf_counter()
                fn()
                timed[name].append(time.perf_counter() - t0)
    return timed


def training_step(model: Any, inputs: Sequence[Any], optimizer: Any,
                  losses: list[float]) -> Callable[[], None]:
    """One training step of ``model`` (a :class:`codegen.parallel_model.ParallelModel`:
    forward and backward on ``inputs``, then ``optimizer``'s update, gradients
    dropped) as a call that appends the step's loss to ``losses``."""
    def step() -> None:
        losses.append(float(model.step(*inputs)))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def check_fields(result: dict[str, Any]) -> dict[str, Any]:
    """What a benchmark row records of a ``training.launch.launch(..., check=True)``
    result: the verdict, the loss and gradient errors against one process, the
    placements check, the step times (seconds; ``step_s`` the last, the first
    being a warm-up) and the ops that ran replicated."""
    times = result.get("step_times_s") or []
    keys = ("loss", "reference_loss", "loss_rel_err", "max_loss_rel_err", "max_rel_grad_err",
            "worst_param", "num_params_checked", "missing_grads", "observed_match", "rtol",
            "fallback_ops", "returncode")
    return {"passed": bool(result.get("passed")), **{k: result.get(k) for k in keys},
            "step_times_s": times, "step_s": times[-1] if times else None}


def read_results(path: str) -> dict[str, Any]:
    """The results a script wrote to ``path`` before (an empty dict when there
    are none), so that a run of some cases keeps the others."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        return {}


def write_results(path: str, result: dict[str, Any], *, indent: int = 1) -> None:
    """Write ``result`` to ``path`` as JSON (``indent`` spaces, a final newline),
    making its folder first when it is missing."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=indent)
        f.write("\n")


def wrote_message(path: str, result: dict[str, Any] | None = None) -> str:
    """``wrote PATH (N s)``, with the run's ``result["wall_s"]``; ``wrote PATH``
    when there is no wall time."""
    if result is not None and "wall_s" in result:
        return f"wrote {path} ({result['wall_s']:.0f} s)"
    return f"wrote {path}"


def report_results(path: str, result: dict[str, Any], lines: Sequence[str]) -> int:
    """Write ``result`` to ``path`` (:func:`write_results`), print ``lines``
    (the run's summary) and where it wrote; 0, a benchmark's exit status."""
    write_results(path, result)
    for line in lines:
        print(line)
    print(wrote_message(path, result))
    return 0


def add_timing_args(ap: Any, *, steps: int, out: str) -> None:
    """The timing flags of a benchmark that alternates its cases in rounds
    (:func:`time_alternating`): ``--warmup`` and ``--rounds`` (counts),
    ``--steps`` (steps a case a round) and ``--out`` (its JSON)."""
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--out", default=out)


def git_commit(tree: str | None = None) -> str | None:
    """The short git commit of the checkout ``tree`` (default: this one's), or
    None outside a git checkout."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True,
                              cwd=tree or os.path.dirname(os.path.abspath(__file__))
                              ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def file_tail(path: str, lines: int) -> list[str]:
    """The last ``lines`` lines of text file ``path`` (each cut to 300
    characters); none where it cannot be read."""
    try:
        with open(path, errors="replace") as f:
            return [line.rstrip("\n")[:300] for line in f.readlines()[-lines:]]
    except OSError:
        return []


def compile_lines(log_path: str) -> list[str]:
    """The ``compile:`` lines rank 0 of a ``planner train`` or ``planner run``
    job printed into its ranks' log (``log_path``; torchrun's ``[rank0]:``
    prefix left out): each region's compile time and what the caches held."""
    with open(log_path) as f:
        return re.findall(r"^(?:\[rank0\]:)?(compile: .*)$", f.read(), flags=re.M)


def job_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a ``planner`` job a benchmark starts: the ranks'
    (:func:`training.torchrun.rank_env`: one OpenMP thread, the repository on
    ``PYTHONPATH``) without a fault injection left set, then ``extra``."""
    from training.torchrun import rank_env

    env = rank_env(None)
    env.pop("PLANNER_TRAIN_FAULT", None)
    env.update(extra or {})
    return env


def text_token_file(out_dir: str, sources: Sequence[str], *, min_bytes: int = 0,
                    below: int = 256) -> tuple[str, dict[str, Any]]:
    """A byte-token file (uint16, one token per byte) of real text: the files
    ``sources`` (paths from the repository root) one after the other, bytes not
    below ``below`` left out (so that a vocabulary of ``below`` ids takes every
    token), repeated to at least ``min_bytes`` bytes. Written to
    ``out_dir/text.bin``; returns its path and ``{"sources", "kept_bytes",
    "dropped_bytes", "repeats", "tokens", "sha256"}``."""
    import hashlib

    import numpy as np

    from training.data import write_token_file

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    raw = np.concatenate([np.fromfile(os.path.join(root, f), dtype=np.uint8) for f in sources])
    kept = raw[raw < below]
    repeats = max(1, -(-min_bytes // len(kept)))
    path = os.path.join(out_dir, "text.bin")
    n = write_token_file(path, np.tile(kept, repeats).astype(np.uint16))
    with open(path, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    return path, {"sources": list(sources), "kept_bytes": int(kept.size),
                  "dropped_bytes": int(raw.size - kept.size), "repeats": repeats,
                  "tokens": n, "sha256": digest}
