"""The same training job in one process, with plain PyTorch: what a plan's run
is checked against.

:func:`train_one_process` builds the plan's model on one device with seed 0
(the weights :func:`codegen.parallel_model.parallelize` gives fresh), and
trains it on the job's batches with torch's own optimizer, LR schedule
(:func:`training.lr_schedule.warmup_cosine`) and
``torch.nn.utils.clip_grad_norm_``: eager forward and backward of the whole
batch, or of each micro-batch with the losses averaged where the plan
accumulates micro-batches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

__all__ = ["OneProcessRun", "train_one_process"]


@dataclass
class OneProcessRun:
    """What :func:`train_one_process` returns."""

    losses: list[float]  # the loss of every step, before its update
    state: dict[str, torch.Tensor]  # the parameters after the last step, by FQN


def train_one_process(plan: Any, batches: Callable[[int], tuple], *, steps: int,
                      optimizer: str = "adamw", lr: float = 3e-4, warmup: int = 0,
                      min_lr_ratio: float = 0.1, weight_decay: float = 0.0,
                      grad_clip: float | None = None, device: str = "cpu",
                      start_state: dict[str, torch.Tensor] | None = None) -> OneProcessRun:
    """Train the model of ``plan`` (a Plan) for ``steps`` steps in this process.

    ``batches(step)`` gives the global batch of a step; ``start_state``
    replaces the fresh weights (a Hugging Face checkpoint's, say). The
    arguments are :class:`training.config.TrainConfig`'s.
    """
    from codegen.reference import loss_of, zoo_kwargs
    from models.source import build_model
    from training.lr_schedule import warmup_cosine

    model, _ = build_model(plan.model["source"], device=device, seed=0,
                           **zoo_kwargs(plan.training))
    if start_state is not None:
        model.load_state_dict(start_state, strict=False)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt_class = torch.optim.SGD if optimizer == "sgd" else torch.optim.AdamW
    opt = opt_class(params, lr=lr, weight_decay=weight_decay)
    schedule = warmup_cosine(opt, warmup_steps=warmup, total_steps=steps,
                             min_lr_ratio=min_lr_ratio)
    parts = plan.pipeline.num_microbatches if plan.pipeline is not None else 1
    losses = []
    for step in range(steps):
        batch = [t.to(device) if isinstance(t, torch.Tensor) else t for t in batches(step)]
        total = 0.0
        for micro in zip(*[t.chunk(parts) for t in batch]):
            loss = loss_of(model(*micro)) / parts
            loss.backward()
            total += float(loss.detach())
        if grad_clip:
            torch.nn.utils.clip_grad_norm_(params, grad_clip)
        opt.step()
        schedule.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
    state = {fqn: p.detach().clone() for fqn, p in model.named_parameters()}
    return OneProcessRun(losses, state)
