"""Validation: the held-out loss of a plan's model, forward only.

``planner train --eval-data FILE --eval-every N --eval-batches K`` measures,
after every N-th step and after the last, the mean loss of the model over the
first K batches of the held-out token file (the same K batches each time, so
the numbers compare), under the same plan as training: every rank runs its
part of the forward, without autograd (``torch.no_grad``) and without
touching gradients or optimizer states.

:meth:`codegen.parallel_model.ParallelModel.eval_loss` runs each batch: a
single-stage plan's program as a training step's forward does, a pipeline's
schedule forward only (``schedule.eval``), the loss the mean over
micro-batches as the training step's.

The program is the captured training program: dropout, if the model has any,
drops in validation too, and buffers a forward updates (BatchNorm's running
statistics) are updated.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

__all__ = ["Validation", "held_out_loss"]


def held_out_loss(model: Any, batches: Sequence[tuple]) -> torch.Tensor:
    """The mean loss of ``model`` (a :class:`codegen.parallel_model.ParallelModel`)
    over ``batches`` (global batches, the same on every rank), forward only.

    Every rank calls it (it runs the plan's collectives). Returns a 0-d float64
    tensor on the rank's device, the same value on every rank; reading it
    waits for the forwards.
    """
    if not batches:
        raise ValueError("held_out_loss needs at least one batch")
    total = torch.zeros((), dtype=torch.float64, device=model.device)
    for batch in batches:
        total += model.eval_loss(*batch)
    return total / len(batches)


class Validation:
    """When the job validates and what it measured.

    Args:
        batches: index ``k`` -> the k-th held-out global batch.
        count: batches per validation (``--eval-batches``).
        every: steps between validations (``--eval-every``); None: only after
            the last step.
        total_steps: the job's steps; the last is ``total_steps - 1``.
    """

    def __init__(self, batches: Callable[[int], tuple], *, count: int, every: int | None,
                 total_steps: int) -> None:
        if count < 1 or (every is not None and every < 1):
            raise ValueError(f"count and every must be at least 1, got {count} and {every}")
        self.batches = batches
        self.count = int(count)
        self.every = every
        self.total_steps = int(total_steps)
        #: ``{"step": step (0-based), "loss": mean held-out loss}`` per validation
        self.losses: list[dict[str, float]] = []

    def due(self, step: int) -> bool:
        """Whether the job validates after ``step`` (0-based)."""
        return (step == self.total_steps - 1
                or (self.every is not None and (step + 1) % self.every == 0))

    def run(self, model: Any, step: int) -> float:
        """Validate after ``step`` (every rank); the loss, recorded in :attr:`losses`."""
        loss = float(held_out_loss(model, [self.batches(k) for k in range(self.count)]))
        self.losses.append({"step": int(step), "loss": loss})
        return loss
