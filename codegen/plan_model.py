"""A plan's model: built from its source, and the loss of its outputs.

:func:`build_plan_model` is the one place a plan's ``nn.Module`` and example
inputs are built (the runtime on meta, :func:`codegen.parallel_model.parallelize`;
the training job's checks; the one-process reference of ``--check``; the
benchmarks): the plan's ``model.source`` with seed 0 and the step sizes the plan
was made for, so every caller gets the same weights and inputs.
:func:`loss_of` is how the runtime and the reference read a loss off the outputs.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["build_plan_model", "loss_of", "zoo_kwargs"]


def zoo_kwargs(training: dict[str, Any] | None) -> dict[str, Any]:
    """batch_size / seq_len from a plan's ``training`` section, for the model's factory."""
    training = training or {}
    source = training.get("zoo_kwargs", training)
    return {k: source[k] for k in ("batch_size", "seq_len") if source.get(k) is not None}


def build_plan_model(plan: Any, device: str | torch.device = "meta", *,
                     seed: int = 0) -> tuple[nn.Module, tuple]:
    """``plan``'s model and example inputs (a Plan, or anything with its
    ``model["source"]`` and ``training``), built on ``device`` with ``seed``
    and the plan's batch size and sequence length
    (:func:`models.source.build_model`)."""
    from models.source import build_model

    shapes = zoo_kwargs(plan.training)
    return build_model(plan.model["source"], device=str(device), seed=seed, **shapes)


def loss_of(outputs: Any) -> Any:
    """The training loss of a program's outputs: its first tensor, which must be a
    scalar (the planner refuses other models).

    Applied the same way to the reference and to the distributed run.
    """
    if isinstance(outputs, (tuple, list)):
        tensors = [o for o in outputs if isinstance(o, torch.Tensor)]
        if not tensors:
            raise ValueError("the model returned no tensor; cannot train it")
        outputs = tensors[0]
    if not isinstance(outputs, torch.Tensor):
        raise ValueError(f"the model returned {type(outputs).__name__}, not a tensor loss")
    if outputs.numel() != 1:
        raise ValueError(f"the model returned a tensor of shape {list(outputs.shape)}, not a "
                         f"scalar loss; return the training loss from forward")
    return outputs if outputs.ndim == 0 else outputs.reshape(())
