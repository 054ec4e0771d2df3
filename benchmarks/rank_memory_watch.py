"""Watching the memory of a job's ranks from outside, for the benchmarks that
start multi-rank jobs (:mod:`benchmarks.train_memory`).

* :class:`Watch` samples, every second, each rank's resident set (bytes) and
  the machine's available memory, and kills the job when that falls below
  :data:`MIN_AVAILABLE_BYTES`;
* :func:`run_watched` runs a command under a :class:`Watch`;
* :func:`wait_for_memory` waits until the machine has the memory a job needs;
* :func:`meminfo` reads ``/proc/meminfo`` in bytes, :func:`gib` formats bytes
  as GiB.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from typing import Any, Sequence

__all__ = ["GiB", "MIN_AVAILABLE_BYTES", "Watch", "gib", "meminfo", "run_watched",
           "wait_for_memory"]

GiB = 1 << 30
#: the watchdog kills a job when the machine's available memory falls below this
MIN_AVAILABLE_BYTES = int(1.5 * GiB)


def meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes."""
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, value = line.split(":", 1)
            parts = value.split()
            out[key] = int(parts[0]) * (1024 if len(parts) > 1 else 1)
    return out


def gib(n: float | None) -> float | None:
    """``n`` bytes in GiB, rounded to 0.001 (None stays None)."""
    return None if n is None else round(n / GiB, 3)


class Watch(threading.Thread):
    """Samples, every ``interval`` seconds, the resident set of each rank of
    the job started as process ``root`` (its descendants running training.job,
    by their RANK; torchrun starts them in sessions of their own) and the
    machine's available memory; kills the job's processes when the available
    memory falls below :data:`MIN_AVAILABLE_BYTES`."""

    def __init__(self, root: int, interval: float = 1.0):
        super().__init__(daemon=True)
        self.root, self.interval = root, interval
        self.t0 = time.perf_counter()
        self.samples: list[tuple[float, dict[int, int], int]] = []
        self.killed: str | None = None
        self._halt = threading.Event()

    def descendants(self) -> list[int]:
        """The processes ``root`` started, transitively (root first)."""
        children: dict[int, list[int]] = {}
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                with open(f"/proc/{pid}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(pid))
        out, todo = [], [self.root]
        while todo:
            pid = todo.pop()
            out.append(pid)
            todo.extend(children.get(pid, []))
        return out

    def kill(self) -> None:
        """SIGKILL the job's processes, the ranks first."""
        for pid in reversed(self.descendants()):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass

    def _ranks(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for pid in self.descendants()[1:]:
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if b"training.job" not in f.read():
                        continue
                with open(f"/proc/{pid}/environ", "rb") as f:
                    env = dict(x.split(b"=", 1) for x in f.read().split(b"\0") if b"=" in x)
                if b"RANK" not in env:  # torchrun itself
                    continue
                with open(f"/proc/{pid}/statm") as f:
                    rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
                out[int(env[b"RANK"])] = rss
            except (OSError, ValueError, IndexError):
                continue
        return out

    def run(self) -> None:
        while not self._halt.is_set():
            available = meminfo()["MemAvailable"]
            self.samples.append((round(time.perf_counter() - self.t0, 1), self._ranks(),
                                 available))
            if available < MIN_AVAILABLE_BYTES and self.killed is None:
                self.killed = (f"killed by the benchmark's watchdog: available memory "
                               f"{gib(available)} GiB < {gib(MIN_AVAILABLE_BYTES)} GiB")
                self.kill()
            self._halt.wait(self.interval)

    def stop(self) -> None:
        self._halt.set()
        self.join()

    def summary(self) -> dict[str, Any]:
        """Per rank: its largest sampled resident set and when; the largest sum
        over ranks; the smallest available memory; a timeline every ~5 s (MiB)."""
        ranks: dict[int, dict[str, Any]] = {}
        total_max, total_at, min_available = 0, None, None
        for t, rss, available in self.samples:
            for r, b in rss.items():
                if r not in ranks or b > ranks[r]["max_sampled_rss_bytes"]:
                    ranks[r] = {"max_sampled_rss_bytes": b, "at_s": t}
            if sum(rss.values()) > total_max:
                total_max, total_at = sum(rss.values()), t
            if min_available is None or available < min_available:
                min_available = available
        step = max(1, round(5.0 / self.interval))
        timeline = [[t, [rss.get(r, 0) >> 20 for r in sorted(ranks)], available >> 20]
                    for t, rss, available in self.samples[::step]]
        return {"interval_s": self.interval,
                "ranks": {str(r): v for r, v in sorted(ranks.items())},
                "max_sum_rss_bytes": total_max, "max_sum_at_s": total_at,
                "min_available_bytes": min_available,
                "timeline_mib": {"columns": ["t_s", "rss_per_rank", "machine_available"],
                                 "rows": timeline}}


def run_watched(cmd: Sequence[str], *, cwd: str, env: dict[str, str], stdout: Any,
                timeout_s: float) -> tuple[int, str | None, bool, Watch]:
    """Run ``cmd`` in a session of its own, its output (stdout and stderr) to
    ``stdout`` (a file, or ``subprocess.PIPE`` to return it as text), watched
    by a :class:`Watch`, which kills it after ``timeout_s`` seconds; (exit
    status, the output or None, whether it timed out, the stopped watch)."""
    proc = subprocess.Popen(list(cmd), cwd=cwd, env=env, stdout=stdout,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    watch = Watch(proc.pid)
    watch.start()
    try:
        output, _ = proc.communicate(timeout=timeout_s)
        timed_out = False
    except subprocess.TimeoutExpired:
        watch.kill()
        output, _ = proc.communicate()
        timed_out = True
    watch.stop()
    return proc.returncode, output, timed_out, watch


def wait_for_memory(name: str, need: int, wait_s: float) -> tuple[dict[str, int], float, bool]:
    """Wait up to ``wait_s`` seconds until 90% of the available memory holds
    ``need`` bytes (other jobs may share the machine), unless 90% of the
    machine's total cannot; (/proc/meminfo then, seconds waited, whether the
    machine's total could)."""
    memory = meminfo()
    fits_machine = need <= 0.9 * memory["MemTotal"]
    waited = 0.0
    while fits_machine and need > 0.9 * memory["MemAvailable"] and waited < wait_s:
        if not waited:
            print(f"[{name}] waiting for {gib(need)} GiB of free memory (other jobs hold "
                  f"some: {gib(memory['MemAvailable'])} GiB available)", flush=True)
        time.sleep(10)
        waited += 10
        memory = meminfo()
    return memory, waited, fits_machine
