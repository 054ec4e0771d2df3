"""Memory per device: training state (params, grads, optimizer, ZeRO) and activations.

Units: bytes.

Training state is counted as torch allocates it under the step's precision
(:mod:`ir.precision`). With Psi parameters and Adam (2 states), per device,
without ZeRO:

=============  ==========================================================  ==========
precision      kept                                                        bytes/Psi
=============  ==========================================================  ==========
fp32           fp32 params, grads, 2 states                                16
bf16           bf16 params, grads, 2 states                                8
bf16-mixed     fp32 params, grads, 2 states + bf16 working copy of params  18
=============  ==========================================================  ==========

bf16-mixed is Megatron-LM's and torchtitan's layout: fp32 master parameters,
gradients accumulated and reduced in fp32, fp32 optimizer states, and the bf16
copy of each parameter the forward reads (autograd keeps it for the matmul's
backward). ZeRO (Rajbhandari et al., SC'20) shards these over a data-parallel
group of N: stage 1 the optimizer states, stage 2 also the gradients, stage 3
also the parameters; under stage 3 (FSDP2) each parameter is all-gathered whole
in the compute dtype for the step and its gradient is whole in the compute
dtype until it is reduce-scattered. FSDP2 runs stage 2 too
(``reshard_after_forward=False``) and stores the parameters sharded there as
well: its layout is stage 3's (``params_sharded``). Sharded parts use ``ceil(Psi / N)``
parameters per device (FSDP pads). (The ZeRO paper's own example keeps fp16
gradients: 16 bytes/Psi at stage 0.)

ZeRO stage 1 is Megatron-LM's distributed optimizer (and the ZeRO paper's
stage 1, whose optimizer states include the fp32 master copy). Under a mixed
precision the model holds its parameters whole in the compute dtype and
their gradients whole in the gradient dtype (the precision's
``reduce_dtype``); for its 1/N of the parameters each rank holds the fp32
master copy and the states and, when the gradients are not fp32, the fp32
copy of its gradient slice the step reads (Megatron's "main grads", counted
with the gradients: they exist at the step, not during the backward). Bytes
per parameter with Adam, N data-parallel ranks (N = 1: Megatron's optimizer
without the distributed optimizer; the totals are Megatron-LM's table of the
distributed optimizer):

==========================  ===============  =========  ================  ===========
precision, gradient dtype   params (whole)   grads      optimizer (1/N)   bytes/Psi
==========================  ===============  =========  ================  ===========
bf16/fp16-mixed, fp32       2                4          4 + 8             6 + 12/N
bf16/fp16-mixed, bf16/fp16  2                2 + 4/N    4 + 8             4 + 16/N
fp32                        4                4          8                 8 + 8/N
bf16                        2                2          4                 4 + 4/N
==========================  ===============  =========  ================  ===========

At stage 1 the ``optimizer`` part therefore includes the fp32 master
parameters of the device's slice; at the other stages the master parameters
are counted in ``params``.

Activations follow Korthikanti et al., "Reducing Activation Recomputation in
Large Transformer Models" (MLSys'23), Sec. 4 and Table 2, for one GPT layer
with 16-bit activations: ``sbh(34 + 5as/h)`` bytes without recomputation.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Iterable, Mapping, Union

if TYPE_CHECKING:
    from ir.precision import Precision

__all__ = [
    "MEMORY_RESERVE",
    "OPTIMIZER_ACCESSES",
    "OPTIMIZER_STATES",
    "backward_timeline_excess",
    "optimizer_step_bytes",
    "step_copy_bytes",
    "step_peak_bytes",
    "training_state_bytes",
    "gpt_activation_bytes_per_layer",
    "reserve_bytes",
    "usable_memory",
]

#: Optimizer -> number of per-parameter state tensors it keeps.
OPTIMIZER_STATES = {"adam": 2, "adamw": 2, "sgd_momentum": 1, "sgd": 0}

#: Optimizer -> tensors of a parameter's size its update reads and writes, as
#: torch's multi-tensor (``foreach``) implementation runs it, the default on GPUs:
#: one pass over the whole list per ``_foreach`` op. AdamW: decay the parameter
#: (read, write: 2), ``lerp_`` the first moment towards the gradient (3), scale
#: the second moment (2), ``addcmul_`` the squared gradient into it (3),
#: ``sqrt`` of it into a new list (2), divide that by the bias correction (2),
#: add eps (2), ``addcdiv_`` the step into the parameter (4): 20. Adam without
#: weight decay skips the first: 18. SGD: ``add_`` the scaled gradient (3); with
#: momentum, scale the buffer (2), add the gradient to it (3) and add it to the
#: parameter (3): 8.
OPTIMIZER_ACCESSES = {"adam": 18, "adamw": 20, "sgd_momentum": 8, "sgd": 3}


def training_state_bytes(
    num_params: int,
    *,
    precision: "str | Precision" = "fp32",
    optimizer: str = "adam",
    zero_stage: int = 0,
    dp_size: int = 1,
    params_sharded: bool | None = None,
    gathered: bool = True,
) -> dict[str, int]:
    """Bytes per device for parameters, gradients and optimizer states.

    Args:
        num_params: parameters of the model (or of the part this device group
            holds), Psi.
        precision: a :class:`ir.precision.Precision` or its name
            (``fp32``, ``bf16``, ``bf16-mixed``): master parameters,
            gradients and optimizer states in its master dtype, plus the
            compute-dtype working copy of the parameters when mixed.
        optimizer: a key of :data:`OPTIMIZER_STATES`.
        zero_stage: 0 none; 1 shards optimizer states over ``dp_size``
            (under a mixed precision with the fp32 master parameters, which
            the model then holds in the compute dtype: Megatron-LM's
            distributed optimizer, in the module docstring's table, also for
            ``dp_size`` 1); 2 also gradients; 3 also parameters (gathered whole in the compute
            dtype for the step, gradients whole in the compute dtype until
            reduce-scattered).
        dp_size: data-parallel (ZeRO) group size N.
        params_sharded: whether the master parameters are stored sharded over
            ``dp_size`` and gathered whole in the compute dtype for the step;
            None: at stage 3 only, as the ZeRO paper has it. FSDP2's stage 2
            (``reshard_after_forward=False``) passes True: it shards the master
            parameters as stage 3 does and only keeps the gathered copy from
            forward to backward, so it allocates what stage 3 does.
        gathered: with ``params_sharded`` over ``dp_size`` > 1, whether the
            whole compute-dtype copy and the whole gradient are counted. False
            for a ZeRO-3 layer that FSDP2 gathers on its own
            (:mod:`codegen.zero3_units`) and that is not among those gathered
            at the step's peak: its shards alone.

    Returns:
        ``{"params", "grads", "optimizer", "total"}`` in bytes per device
        (``params`` includes the working copy or the gathered parameters; at
        stage 1 ``optimizer`` includes the fp32 master slice).
    """
    from ir.precision import get_precision

    if isinstance(num_params, bool) or not isinstance(num_params, int) or num_params < 0:
        raise ValueError(f"num_params must be an integer >= 0, got {num_params!r}")
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"unknown optimizer {optimizer!r}; known: {', '.join(OPTIMIZER_STATES)}")
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage!r}")
    if isinstance(dp_size, bool) or not isinstance(dp_size, int) or dp_size < 1:
        raise ValueError(f"dp_size must be an integer >= 1, got {dp_size!r}")
    p = get_precision(precision)
    master, compute = p.master_bytes, p.compute_dtype.itemsize
    shard = math.ceil(num_params / dp_size)  # parameters per device when sharded
    states = master * OPTIMIZER_STATES[optimizer]
    if zero_stage == 1 and p.mixed and not params_sharded:
        # the distributed optimizer (module docstring): working params and their
        # gradients whole; the fp32 master slice (and main-grad slice) with the states
        grad = p.reduce_dtype.itemsize
        params, opt = compute * num_params, (master + states) * shard
        # 16-bit gradients: the fp32 copy of the slice the step reads (at the step)
        grads = grad * num_params + (master * shard if grad != master else 0)
        return {"params": params, "grads": grads, "optimizer": opt,
                "total": params + grads + opt}
    if params_sharded is None:
        params_sharded = zero_stage >= 3
    whole = gathered or not params_sharded or dp_size == 1
    params = master * (shard if params_sharded else num_params)
    if whole:
        params += step_copy_bytes(num_params, precision=p, dp_size=dp_size,
                                  params_sharded=params_sharded)
    grads = master * (shard if zero_stage >= 2 else num_params)
    if zero_stage >= 2 and dp_size > 1 and whole:  # whole until reduce-scattered
        grads += compute * num_params
    opt = states * (shard if zero_stage >= 1 else num_params)
    return {"params": params, "grads": grads, "optimizer": opt, "total": params + grads + opt}


def step_copy_bytes(num_params: int, *, precision: "str | Precision" = "fp32",
                    dp_size: int = 1, params_sharded: bool = False) -> int:
    """Bytes of the whole compute-dtype copy of ``num_params`` parameters that a
    step makes from the master copy and frees again before the optimizer step:
    the cast of each parameter under a mixed precision (autograd keeps it for
    the backward), or the parameters FSDP2 all-gathers (``params_sharded`` over
    ``dp_size`` > 1), which it frees once their gradients are reduce-scattered.
    0 where the step reads the stored parameters themselves. Part of
    :func:`training_state_bytes`'s ``params`` (except at stage 1 under a mixed
    precision, whose compute-dtype parameters are stored)."""
    from ir.precision import get_precision

    p = get_precision(precision)
    if p.mixed or (params_sharded and dp_size > 1):
        return p.compute_dtype.itemsize * num_params
    return 0


def step_peak_bytes(parts: Mapping[str, float], optimizer: str = "adam", *,
                    state_bytes: float | None = None, step_copy: float = 0.0,
                    backward_excess: float | None = None,
                    forward_excess: float = 0.0) -> float:
    """Peak bytes per device of a step that runs the whole batch at once (no
    gradient accumulation), from its parts by kind (bytes: ``params``,
    ``optimizer``, ``grads``, ``activations``, ``backward_transient``,
    ``recomputed_layer``).

    Parameters and optimizer states live throughout. At the start of the
    backward every saved activation and the largest backward transient (or,
    later, a checkpointed layer recomputed) are alive and no gradient yet (they were set to None after the last step); the
    backward makes gradients as it frees activations, so their sum peaks at
    one end or the other; at the optimizer step every gradient is alive, with
    the foreach optimizer's temporaries (torch's multi-tensor Adam makes one
    list of the states' size, ``sqrt(v)``). With gradient accumulation or a
    pipeline the gradients of earlier micro-batches live beside later
    activations: use the sum of the parts instead.

    ``state_bytes``: bytes of one of those state lists; by default the
    ``optimizer`` part over the optimizer's states, right where that part
    is the states alone (not at ZeRO stage 1 under a mixed precision, whose
    ``optimizer`` part holds the master copy too: pass it then).
    ``step_copy``: bytes of ``params`` that the step frees before the optimizer
    step (:func:`step_copy_bytes`: the compute-dtype copy under a mixed
    precision), not alive at it.
    ``backward_excess``: the backward's timeline
    (:meth:`costmodel.strategy_cost.IntraOpCost.backward_excess`): the most
    the backward holds beyond the saved activations at any of its ops (the
    gradients made so far and that op's transient, less the activations
    already freed). The backward's peak is then not only at its start: a
    mixture-of-experts layer at the end of the model makes its experts'
    gradients, many GB at once, while nearly every activation is still alive.
    None: the start alone (the largest transient).
    ``forward_excess``: the most a forward redistribute holds beyond the saved
    activations (:meth:`costmodel.strategy_cost.IntraOpCost.forward_reshard_excess`),
    counted beside all of them.
    """
    # the loss's transient comes first; a checkpointed layer is recomputed after
    # it; the backward's timeline, where given, holds each op's transient less
    # the activations freed before it runs, so the largest transient alone
    # (as if every activation were alive beside it) stands in only without it
    transient = (parts.get("backward_transient", 0.0) if backward_excess is None
                 else backward_excess)
    backward_start = parts.get("activations", 0.0) + max(transient, forward_excess,
                                                         parts.get("recomputed_layer", 0.0))
    optimizer_step = optimizer_step_bytes(parts, optimizer, state_bytes=state_bytes,
                                          step_copy=step_copy)
    return parts.get("params", 0.0) + parts.get("optimizer", 0.0) + max(backward_start,
                                                                        optimizer_step)


def optimizer_step_bytes(parts: Mapping[str, float], optimizer: str = "adam", *,
                         state_bytes: float | None = None, step_copy: float = 0.0) -> float:
    """Bytes alive at the optimizer step beyond the parameters and optimizer
    states (bytes by kind, as :func:`step_peak_bytes` takes them): every
    gradient and the foreach optimizer's temporaries (one list of a state's
    size: ``state_bytes``, by default the ``optimizer`` part over its
    states), less the compute-dtype copy the step has freed (``step_copy``)."""
    states = OPTIMIZER_STATES.get(optimizer, 0)
    if not states:
        step_temporaries = 0.0
    elif state_bytes is not None:
        step_temporaries = float(state_bytes)
    else:
        step_temporaries = parts.get("optimizer", 0.0) / states
    return parts.get("grads", 0.0) + step_temporaries - step_copy


def backward_timeline_excess(steps: "Iterable[tuple[float, ...]]") -> float:
    """The most bytes a backward holds beyond the saved activations, from its
    ops in the order they run: per op ``(gradients it makes, its transient,
    activations freed once it has run)``, and optionally a fourth, the
    activations made again before it runs (a checkpointed layer recomputed
    when its backward begins). At an op the gradients made so far (its own
    too), the activations made again and not yet freed, and its transient are
    alive, and the activations of the ops that ran before it are freed. 0 for
    no op."""
    made = freed = best = 0.0
    for grads, transient, released, *remade in steps:
        made += grads
        freed -= sum(remade)
        best = max(best, made + transient - freed)
        freed += released
    return best


Recompute = Union[bool, str]


def gpt_activation_bytes_per_layer(
    b: int,
    s: int,
    h: int,
    a: int,
    recompute: Recompute = False,
    *,
    tp: int = 1,
    sequence_parallel: bool = False,
) -> float:
    """Activation bytes one transformer layer keeps for backward, per device.

    Korthikanti et al. (MLSys'23), 16-bit activations, ``b`` micro-batch size,
    ``s`` sequence length, ``h`` hidden size, ``a`` attention heads, ``t = tp``:

    ===================================  ====================================
    recompute                            bytes
    ===================================  ====================================
    False / "none", no TP                sbh (34 + 5as/h)
    False, tensor parallel               sbh (10 + 24/t + 5as/(ht))
    False, tensor + sequence parallel    sbh (34/t + 5as/(ht))
    "selective" (attention core)         sbh (10 + 24/t); with SP sbh 34/t
    True / "full"                        2sbh (layer input only); with SP 2sbh/t
    ===================================  ====================================

    (The 2sbh/t for full recomputation with sequence parallelism is ours:
    Megatron then stores the sequence-sharded layer input.)
    """
    for name, v in (("b", b), ("s", s), ("h", h), ("a", a), ("tp", tp)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
    mode = ("full" if recompute else "none") if isinstance(recompute, bool) else recompute
    if mode not in ("none", "selective", "full"):
        raise ValueError(f"recompute must be False/True or 'none', 'selective', 'full'; got {recompute!r}")
    t = tp
    sbh = s * b * h
    if mode == "full":
        return 2 * sbh / (t if sequence_parallel else 1)
    attention_core = 5 * a * s / (h * t)  # softmax, dropout mask, scores: recomputed when selective
    rest = 34 / t if sequence_parallel else 10 + 24 / t
    if mode == "selective":
        return sbh * rest
    return sbh * (rest + attention_core)


#: Fraction of device memory kept free for the allocator's fragmentation and workspaces.
MEMORY_RESERVE = 0.1


def usable_memory(device_memory: int) -> float:
    """Bytes per device a plan may use: ``device_memory`` (bytes) less the
    allocator's reserve (:data:`MEMORY_RESERVE`)."""
    return float(device_memory - reserve_bytes(device_memory, MEMORY_RESERVE))


def reserve_bytes(total: int, fraction: float) -> int:
    """Bytes to hold back from ``total`` for allocator fragmentation and workspaces.

    ``ceil(total * fraction)``; the usable budget is ``total - reserve_bytes(...)``.
    ``fraction`` must be in [0, 1).
    """
    if not total >= 0:
        raise ValueError(f"total must be >= 0 bytes, got {total!r}")
    if not 0 <= fraction < 1:
        raise ValueError(f"fraction must be in [0, 1), got {fraction!r}")
    return math.ceil(total * fraction)
