"""The one-process reference: the same training job in one process, with plain
PyTorch, that a plan's distributed run is checked against (``planner run
--check``, :mod:`training.run_check`; the tests and benchmarks of ``planner train``).

:func:`train_one_process` builds the plan's model on one device with seed 0
(:func:`codegen.plan_model.build_plan_model`: the weights
:func:`codegen.parallel_model.parallelize` gives fresh) and trains it in the
plan's precision with torch's own optimizer, LR schedule
(:func:`training.lr_schedule.warmup_cosine`) and
``torch.nn.utils.clip_grad_norm_``: eager forward and backward of the whole
batch, or of each micro-batch with the gradients averaged where the plan
accumulates micro-batches (as a pipeline schedule's ``scale_grads`` does).

:func:`gradient_errors`, :func:`relative_error` and :func:`check_tolerance` are
the rules a run is compared with it by.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

__all__ = ["OneProcessRun", "check_tolerance", "gradient_errors", "make_optimizer",
           "relative_error", "train_one_process"]


@dataclass
class OneProcessRun:
    """One process's training run.

    Attributes:
        losses: the loss of every step, before its update.
        grads: step 1's gradients, FQN -> tensor on the CPU (None for
            parameters without one).
        buffers: every buffer after the last step, FQN -> tensor on the CPU
            (BatchNorm's running statistics, which forward updates in training mode).
        state: the parameters after the last step, by FQN.
    """

    losses: list[float]
    grads: dict[str, torch.Tensor | None] = field(default_factory=dict)
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    state: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def loss(self) -> float:
        """Step 1's loss."""
        return self.losses[0]


def make_optimizer(params: Any, name: str = "sgd", lr: float = 1e-3,
                   weight_decay: float = 0.0) -> torch.optim.Optimizer:
    """torch's optimizer ``name`` (sgd or adamw) over ``params``: the one the
    training job and the reference both use."""
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, weight_decay=weight_decay)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    raise ValueError(f"unknown optimizer {name!r}; use sgd or adamw")


def train_one_process(plan: Any, batches: Callable[[int], tuple] | None = None, *, steps: int,
                      optimizer: str = "adamw", lr: float = 3e-4, warmup: int = 0,
                      min_lr_ratio: float = 0.1, weight_decay: float = 0.0,
                      grad_clip: float | None = None, device: str = "cpu",
                      start_state: dict[str, torch.Tensor] | None = None) -> OneProcessRun:
    """Train the model of ``plan`` (a Plan) for ``steps`` steps in this process.

    ``batches(step)`` gives the global batch of a step (default: the model's
    example inputs at every step); ``start_state`` replaces the fresh weights
    (a Hugging Face checkpoint's, say). The other arguments, and their
    defaults, are :class:`training.config.TrainConfig`'s. The plan's precision
    (:mod:`ir.precision`) is trained in, and its micro-batches accumulated: in
    bf16 each micro-batch's gradients are then rounded apart, as the plan
    rounds them, so the check compares the same sums.
    """
    from codegen.plan_model import build_plan_model, loss_of
    from codegen.pipeline import split_microbatches
    from ir.precision import forward_in, get_precision, prepare_model
    from training.lr_schedule import warmup_cosine

    precision = get_precision(plan.precision)
    model, inputs = build_plan_model(plan, device)
    if start_state is not None:
        model.load_state_dict(start_state, strict=False)
    model = prepare_model(model, precision)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = make_optimizer(params, optimizer, lr, weight_decay)
    schedule = warmup_cosine(opt, warmup_steps=warmup, total_steps=max(1, steps),
                             min_lr_ratio=min_lr_ratio)
    m = plan.pipeline.num_microbatches if plan.pipeline is not None else 1
    run = OneProcessRun(losses=[])
    for step in range(max(1, steps)):
        batch = tuple(inputs) if batches is None else tuple(
            t.to(device) if isinstance(t, torch.Tensor) else t for t in batches(step))
        total = 0.0
        for micro in (split_microbatches(batch, m) if m > 1 else [batch]):
            loss = loss_of(forward_in(model, micro, precision))
            loss.backward()
            total += float(loss.detach())
        if m > 1:  # the schedule's scale_grads
            for p in params:
                if p.grad is not None:
                    p.grad.div_(m)
        run.losses.append(total / m)
        if step == 0:  # kept on the CPU: the run being checked shares the device
            run.grads = {fqn: (p.grad.detach().to("cpu", copy=True) if p.grad is not None
                               else None) for fqn, p in model.named_parameters()}
        if grad_clip:
            torch.nn.utils.clip_grad_norm_(params, grad_clip)
        opt.step()
        schedule.step()
        opt.zero_grad(set_to_none=True)
    run.buffers = {fqn: b.detach().to("cpu", copy=True) for fqn, b in model.named_buffers()}
    run.state = {fqn: p.detach() for fqn, p in model.named_parameters()}
    return run


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
    (sums in another order differ by a few float32 roundings, 6e-8 each). With
    bf16 compute every product and sum is rounded to 8 significant bits (unit
    roundoff 2^-9 ~ 2e-3), and a sharded run rounds partial sums and reductions
    at other points than one process, so the two differ by a few roundings per
    layer: 5e-2 (of the largest gradient entry) holds them while still failing a
    wrong placement, which is off by order one."""
    from ir.precision import get_precision

    return 1e-5 if get_precision(precision).compute_dtype == torch.float32 else 5e-2
