"""Learning-rate schedule: linear warmup, then cosine decay to a floor.

The schedule is a :class:`torch.optim.lr_scheduler.LambdaLR` whose factor is a
small callable object (not a lambda), so ``scheduler.state_dict()`` saves both the
step counter and the schedule's parameters, and a resumed job continues exactly.
"""

from __future__ import annotations

import math

import torch


class WarmupCosineFactor:
    """The factor multiplying the base learning rate at scheduler step ``s``.

    With ``W = warmup_steps``, ``T = total_steps`` and ``m = min_lr_ratio``:

    * ``s < W``: ``(s + 1) / W``: linear warmup; step 0 gets ``lr / W``, step
      ``W - 1`` the full ``lr``;
    * ``W <= s < T``: ``m + (1 - m) * (1 + cos(pi * (s - W) / (T - W))) / 2``:
      cosine decay from ``lr`` at step ``W`` towards ``m * lr``;
    * ``s >= T``: ``m``: constant ``m * lr`` from step ``T`` on.

    ``W = 0`` means no warmup (step 0 gets the full ``lr``).
    """

    def __init__(self, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> None:
        self.warmup_steps = int(warmup_steps)
        self.total_steps = int(total_steps)
        self.min_lr_ratio = float(min_lr_ratio)

    def __call__(self, step: int) -> float:
        warmup, total, floor = self.warmup_steps, self.total_steps, self.min_lr_ratio
        if step < warmup:
            return (step + 1) / warmup
        if step >= total:
            return floor
        progress = (step - warmup) / (total - warmup)
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def _validate(warmup_steps: int, total_steps: int, min_lr_ratio: float) -> None:
    """ValueError (one line) for a schedule that cannot be built."""
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, got {total_steps}")
    if not 0 <= warmup_steps <= total_steps:
        raise ValueError(f"warmup_steps must be in 0..total_steps ({total_steps}), got {warmup_steps}")
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"min_lr_ratio must be in [0, 1], got {min_lr_ratio}")


def warmup_cosine(optimizer: torch.optim.Optimizer, *, warmup_steps: int, total_steps: int,
                  min_lr_ratio: float = 0.1) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup over ``warmup_steps`` steps, cosine decay to ``min_lr_ratio * lr``
    at ``total_steps``, constant after (:class:`WarmupCosineFactor` gives the exact
    factor per step).

    ``lr`` is each parameter group's learning rate when the schedule is built; the
    scheduler's step counter is the number of ``scheduler.step()`` calls, one per
    optimizer step. ``state_dict()`` / ``load_state_dict()`` round-trip it.

    Raises:
        ValueError: ``total_steps < 1``, ``warmup_steps`` outside
            ``0..total_steps``, or ``min_lr_ratio`` outside ``[0, 1]``.
    """
    _validate(warmup_steps, total_steps, min_lr_ratio)
    factor = WarmupCosineFactor(warmup_steps, total_steps, min_lr_ratio)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda=factor)
