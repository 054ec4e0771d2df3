"""Training progress: a JSON-lines log file, a console view and step times.

:class:`TrainingLog` is given every step; on logged steps it appends one JSON
object to the log file and shows the step on the console (a rich progress bar on
a terminal, one plain line per logged step otherwise). :class:`StepClock` times
the steps without making the host wait for the device at each one.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Any, TextIO

import torch

#: The keys of every JSON line, in order.
LOG_KEYS = ("step", "loss", "lr", "tokens_per_s", "mfu", "step_s", "grad_norm", "val_loss")


def _finite_or_none(value: Any) -> float | None:
    """``float(value)``, or None for None/NaN/inf (the log is strict JSON)."""
    if value is None:
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def step_record(step: int, loss: float | None, lr: float, step_s: float, grad_norm: float | None,
                *, tokens_per_step: int, flops_per_step: float | None,
                peak_flops: float | None, val_loss: float | None = None) -> dict[str, Any]:
    """The JSON record of one step.

    ``tokens_per_s = tokens_per_step / step_s`` (tokens per second) and
    ``mfu = flops_per_step / step_s / peak_flops`` (a fraction, not a percent;
    None when either FLOP figure is unknown or ``step_s <= 0``); ``val_loss``
    the held-out loss measured after the step (None where none was).
    """
    timed = step_s > 0
    mfu = None
    if timed and flops_per_step is not None and peak_flops:
        mfu = flops_per_step / step_s / peak_flops
    return {"step": int(step), "loss": _finite_or_none(loss), "lr": float(lr),
            "tokens_per_s": tokens_per_step / step_s if timed else None,
            "mfu": mfu, "step_s": float(step_s), "grad_norm": _finite_or_none(grad_norm),
            "val_loss": _finite_or_none(val_loss)}


def format_line(record: dict[str, Any], total_steps: int, loss: float | None = None) -> str:
    """One console line: ``step 10/200  loss 3.2145  lr 3.0e-04  1,234 tok/s  MFU 0.5%``.

    The step shown is ``record["step"] + 1`` (steps done); ``loss`` overrides the
    record's (which is None when not finite) so a NaN shows as ``nan``.
    """
    loss = record["loss"] if loss is None else loss
    parts = [f"step {record['step'] + 1}/{total_steps}",
             "loss ?" if loss is None else f"loss {loss:.4f}",
             f"lr {record['lr']:.1e}"]
    if record["tokens_per_s"] is not None:
        parts.append(f"{record['tokens_per_s']:,.0f} tok/s")
    if record["mfu"] is not None:
        parts.append(f"MFU {100.0 * record['mfu']:.1f}%")
    if record["grad_norm"] is not None:
        parts.append(f"gnorm {record['grad_norm']:.3g}")
    if record.get("val_loss") is not None:
        parts.append(f"val_loss {record['val_loss']:.4f}")
    return "  ".join(parts)


class TrainingLog:
    """Log training steps to a JSON-lines file and the console; a context manager.

    Args:
        log_path: JSON-lines file, appended to (a resumed job continues the same
            log); None for no file. One object per logged step, keys
            :data:`LOG_KEYS`: ``step`` (0-based step index), ``loss``, ``lr``,
            ``tokens_per_s`` (tokens/s), ``mfu`` (fraction of peak), ``step_s``
            (seconds), ``grad_norm`` (may be None), ``val_loss`` (the held-out
            loss after the step, None where not measured). Non-finite numbers
            are null.
        log_every: log steps whose ``(step + 1) % log_every == 0``, and the last.
        total_steps: steps of the whole job; the last step is ``total_steps - 1``.
        start_step: the first step this process runs (> 0 when resumed).
        tokens_per_step: tokens one training step consumes, whole cluster.
        flops_per_step: model FLOPs of one training step, whole cluster (FLOP).
        peak_flops: the cluster's peak FLOP/s, all devices together (FLOP/s).
        console: show progress on stderr (rank 0 only).
    """

    def __init__(self, log_path: str | os.PathLike | None, *, log_every: int, total_steps: int,
                 start_step: int = 0, tokens_per_step: int, flops_per_step: float | None = None,
                 peak_flops: float | None = None, console: bool = True) -> None:
        if log_every < 1:
            raise ValueError(f"log_every must be >= 1, got {log_every}")
        if not 0 <= start_step <= total_steps:
            raise ValueError(f"start_step must be in 0..total_steps ({total_steps}), got {start_step}")
        self.log_path = None if log_path is None else os.fspath(log_path)
        self.log_every = int(log_every)
        self.total_steps = int(total_steps)
        self.start_step = int(start_step)
        self.tokens_per_step = int(tokens_per_step)
        self.flops_per_step = flops_per_step
        self.peak_flops = peak_flops
        self.console = console
        self._file: TextIO | None = None
        self._progress = None
        self._task = None

    def __enter__(self) -> TrainingLog:
        if self.log_path is not None:
            parent = os.path.dirname(self.log_path)
            if parent:
                os.makedirs(parent, exist_ok=True)
            self._file = open(self.log_path, "a", encoding="utf-8")
        if self.console and sys.stderr.isatty():
            self._start_bar()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        if self._file is not None:
            self._file.close()
            self._file = None

    def _start_bar(self) -> None:
        """A rich progress bar on stderr, already at ``start_step`` steps done."""
        from rich.console import Console
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                                   TimeRemainingColumn)

        self._progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                  TimeRemainingColumn(), TextColumn("{task.fields[status]}"),
                                  console=Console(stderr=True))
        self._progress.start()
        self._task = self._progress.add_task("train", total=self.total_steps,
                                             completed=self.start_step, status="")

    def should_log(self, step: int) -> bool:
        """Whether ``step`` (0-based) is logged: every ``log_every``-th, and the last."""
        return (step + 1) % self.log_every == 0 or step == self.total_steps - 1

    def log(self, step: int, loss: Any, lr: float, step_s: float,
            grad_norm: Any = None, val_loss: float | None = None) -> dict[str, Any] | None:
        """Record step ``step`` (0-based), which took ``step_s`` seconds.

        ``loss`` and ``grad_norm`` may be floats or 0-d tensors; they are read
        (a device sync) only on logged steps. A step with a ``val_loss`` (the
        held-out loss measured after it) is always logged. Returns the logged
        record, or None when the step is not logged. The progress bar advances
        on every call.
        """
        record = None
        status = None
        if self.should_log(step) or val_loss is not None:
            loss_value = None if loss is None else float(loss)
            record = step_record(step, loss_value, lr, step_s,
                                 None if grad_norm is None else float(grad_norm),
                                 tokens_per_step=self.tokens_per_step,
                                 flops_per_step=self.flops_per_step, peak_flops=self.peak_flops,
                                 val_loss=val_loss)
            self._write(record)
            status = self._show(record, loss_value)
        if self._progress is not None:
            fields = {} if status is None else {"status": status}
            self._progress.update(self._task, completed=step + 1, **fields)
        return record

    def _write(self, record: dict[str, Any]) -> None:
        """Append ``record`` as one JSON line, flushed (a crash keeps the log)."""
        if self._file is not None:
            self._file.write(json.dumps(record, allow_nan=False) + "\n")
            self._file.flush()

    def _show(self, record: dict[str, Any], loss: float | None) -> str | None:
        """Print the plain line (no terminal), or return the bar's status text."""
        if not self.console:
            return None
        line = format_line(record, self.total_steps, loss)
        if self._progress is not None:
            return line.split("  ", 1)[1]  # the bar shows the step count itself
        print(line, file=sys.stderr, flush=True)
        return None


class StepClock:
    """Seconds per training step, without a device synchronisation per step.

    :meth:`tick` marks the end of a step (and the start of the next). On a GPU
    each mark is a CUDA event in the device's stream, so a step's time is the
    device's time from one mark to the next (including any wait for the host),
    read only when asked; elsewhere the host's clock.
    """

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._unread: list[Any] = []  # marks not yet turned into seconds, and the last read
        self._seconds: list[float] = []
        self.tick()

    def tick(self) -> None:
        """Mark the end of the step that is being issued now."""
        if self._cuda:
            mark = torch.cuda.Event(enable_timing=True)
            mark.record()
        else:
            mark = time.perf_counter()
        self._unread.append(mark)

    def restart(self) -> None:
        """Start the next step's time now: what ran since the last mark (a
        checkpoint save, say) is no step's."""
        self.seconds()
        self._unread = []
        self.tick()

    def seconds(self) -> list[float]:
        """Every timed step's seconds so far (on a GPU this waits for the last mark)."""
        marks = self._unread
        if len(marks) > 1:
            if self._cuda:
                marks[-1].synchronize()
                self._seconds += [a.elapsed_time(b) / 1e3 for a, b in zip(marks, marks[1:])]
            else:
                self._seconds += [b - a for a, b in zip(marks, marks[1:])]
            self._unread = marks[-1:]
        return list(self._seconds)
