"""The single-process reference a distributed run is checked against.

Builds the same model spec with the same seed (hence the same weights and example
inputs), runs one plain forward and backward on one device (one per micro-batch,
gradients averaged, when the plan accumulates micro-batches) in the plan's
precision and returns the loss and every parameter gradient by FQN.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from models.source import build_model

__all__ = ["ReferenceResult", "gradient_errors", "loss_of", "make_optimizer", "reference_step",
           "relative_error", "zoo_kwargs"]


@dataclass
class ReferenceResult:
    """One process's training run.

    Attributes:
        loss: step-1 loss (a Python float).
        grads: step-1 gradients, FQN -> tensor (None for parameters without one).
        losses: the loss of every step.
        buffers: every buffer after the last step, FQN -> tensor (BatchNorm's
            running statistics, which forward updates in training mode).
    """

    loss: float
    grads: dict[str, torch.Tensor | None]
    losses: list[float] = field(default_factory=list)
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)


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


def zoo_kwargs(training: dict[str, Any] | None) -> dict[str, Any]:
    """batch_size / seq_len from a plan's ``training`` section, for build_model."""
    training = training or {}
    source = training.get("zoo_kwargs", training)
    return {k: source[k] for k in ("batch_size", "seq_len") if source.get(k) is not None}


def relative_error(a: torch.Tensor, b: torch.Tensor, tiny: float = 1e-12) -> float:
    """``max|a - b| / max(max|b|, tiny)``, computed in float64."""
    a = a.detach().to("cpu", torch.float64)
    b = b.detach().to("cpu", torch.float64)
    if a.shape != b.shape:
        return float("inf")
    if b.numel() == 0:
        return 0.0
    return float((a - b).abs().max() / max(float(b.abs().max()), tiny))


def gradient_errors(grads: dict[str, torch.Tensor | None],
                    reference: dict[str, torch.Tensor | None],
                    tiny: float = 1e-12) -> tuple[dict[str, float], list[str]]:
    """Every parameter's gradient error against the one-process reference, as
    ``--check`` counts it: ``max|a - b|`` over the parameter's entries, divided by
    the largest reference gradient entry of the whole model (``max|b|`` over every
    parameter; at least ``tiny``), computed in float64.

    One scale for all parameters, not each parameter's own ``max|b|``: a
    parameter whose true gradient is exactly zero (an attention key bias with
    absolute positions, since softmax is invariant to a constant added to a row)
    has only rounding noise on both sides, and its own scale would divide one
    noise by the other (errors of order 1). With the model's scale, that noise
    (~1e-7 of the largest entry in fp32) passes, while one entry off by 1e-3 of
    the largest still fails a 1e-5 tolerance (:func:`check_tolerance`).

    Args:
        grads: the run's full (unsharded) gradients, FQN -> tensor or None.
        reference: the reference's gradients (:attr:`ReferenceResult.grads`).
        tiny: the scale's floor (a model whose gradients are all zero).

    Returns:
        ``(errors, missing)``: FQN -> error (a fraction of the largest entry;
        ``inf`` for a shape mismatch) for every parameter both sides have a
        gradient for, and the FQNs of ``grads`` where exactly one side has none.
    """
    scale = max((float(g.detach().abs().max()) for g in reference.values()
                 if g is not None and g.numel() > 0), default=0.0)
    scale = max(scale, tiny)
    errors: dict[str, float] = {}
    missing: list[str] = []
    for fqn, got in grads.items():
        want = reference.get(fqn)
        if got is None or want is None:
            if (got is None) != (want is None):
                missing.append(fqn)
            continue
        a = got.detach().to("cpu", torch.float64)
        b = want.detach().to("cpu", torch.float64)
        if a.shape != b.shape:
            errors[fqn] = float("inf")
        else:
            errors[fqn] = float((a - b).abs().max()) / scale if b.numel() else 0.0
    return errors, missing


def check_tolerance(precision: Any) -> float:
    """Tolerance of ``planner run --check`` in ``precision``: of the loss's
    relative error and of every gradient's error as :func:`gradient_errors`
    scales it (a fraction of the model's largest gradient entry). fp32: 1e-5
    (sums in another order differ by a few float32 roundings, 6e-8 each). With bf16 compute every product and sum is rounded
    to 8 significant bits (unit roundoff 2^-9 ~ 2e-3), and a sharded run
    rounds partial sums and reductions at other points than one process, so
    the two differ by a few roundings per layer: 5e-2 (of the largest
    gradient entry) holds them while still failing a wrong placement, which
    is off by order one."""
    from ir.precision import get_precision

    return 1e-5 if get_precision(precision).compute_dtype == torch.float32 else 5e-2


def make_optimizer(params: Any, name: str = "sgd", lr: float = 1e-3) -> torch.optim.Optimizer:
    """The optimizer both the reference and the distributed run use."""
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr)
    raise ValueError(f"unknown optimizer {name!r}; use sgd or adamw")


def reference_step(source: str, *, seed: int = 0, device: str = "cpu", steps: int = 1,
                   optimizer: str = "sgd", lr: float = 1e-3, precision: Any = "fp32",
                   num_microbatches: int = 1, **model_kwargs: Any) -> ReferenceResult:
    """Train ``source`` (zoo name or ``file.py:factory``) for ``steps`` steps on one device.

    Args:
        source: the plan's ``model.source``.
        seed: the seed the distributed run built the model with.
        device: where to run the reference.
        steps: training steps (forward, backward, optimizer step).
        optimizer, lr: as in the distributed run (see :func:`make_optimizer`).
        precision: the plan's training precision (:mod:`ir.precision`): the
            reference trains in it too (:func:`ir.precision.forward_in`).
        num_microbatches: split the batch (dim 0 of every tensor input) into
            this many micro-batches, run forward and backward on each and
            average their gradients, as a pipeline plan's schedule does
            (``scale_grads``); the step loss is the mean of the micro-batch
            losses. In fp32 this is the whole-batch step up to float32
            roundings; in bf16 each micro-batch's gradients are rounded to
            bf16 apart, as the plan rounds them, so the check then compares
            the same sums (a whole-batch bf16 reference differs from them by
            up to ~6e-2 of a layer-norm bias gradient on gpt-tiny).
        model_kwargs: batch_size / seq_len for zoo models (see :func:`zoo_kwargs`).

    Returns:
        The step-1 loss and gradients, the loss of every step and the buffers
        after the last.
    """
    from codegen.pipeline import split_microbatches
    from ir.precision import forward_in, get_precision, prepare_model

    precision = get_precision(precision)
    model, inputs = build_model(source, device=device, seed=seed, **model_kwargs)
    model = prepare_model(model, precision)
    model.train()
    opt = make_optimizer(model.parameters(), optimizer, lr)
    losses: list[float] = []
    grads: dict[str, torch.Tensor | None] = {}
    m = max(1, int(num_microbatches))
    microbatches = split_microbatches(tuple(inputs), m) if m > 1 else [tuple(inputs)]
    for step in range(max(1, steps)):
        mb_losses = []
        for mb in microbatches:
            loss = loss_of(forward_in(model, mb, precision))
            loss.backward()
            mb_losses.append(float(loss.detach()))
        if m > 1:  # the schedule's scale_grads
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.div_(m)
        losses.append(sum(mb_losses) / m)
        if step == 0:  # kept on the CPU: the run being checked shares the device
            grads = {fqn: (p.grad.detach().to("cpu", copy=True) if p.grad is not None else None)
                     for fqn, p in model.named_parameters()}
        opt.step()
        opt.zero_grad(set_to_none=True)
    buffers = {fqn: b.detach().to("cpu", copy=True) for fqn, b in model.named_buffers()}
    return ReferenceResult(loss=losses[0], grads=grads, losses=losses, buffers=buffers)
