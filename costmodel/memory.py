"""Memory per device: training state (params, grads, optimizer, ZeRO) and activations.

Units: bytes.

Training state follows the ZeRO paper (Rajbhandari et al., SC'20, Sec. 3.1
and Fig. 1): with Psi parameters, mixed-precision Adam keeps 2 Psi bytes of
fp16/bf16 parameters, 2 Psi of gradients and K Psi = 12 Psi of fp32 master
parameters + momentum + variance. Per device, over a data-parallel group of N:

    stage 0 (plain DP)             (2 + 2 + K) Psi      e.g. 7.5B params, N=64: 120 GB
    stage 1 (P_os)                 (2 + 2 + K/N) Psi                           31.4 GB
    stage 2 (P_os+g)               (2 + (2 + K)/N) Psi                         16.6 GB
    stage 3 (P_os+g+p)             (2 + 2 + K)/N Psi                            1.9 GB

Sharded parts use ``ceil(Psi / N)`` parameters per device (FSDP pads).

Activations follow Korthikanti et al., "Reducing Activation Recomputation in
Large Transformer Models" (MLSys'23), Sec. 4 and Table 2, for one GPT layer
with 16-bit activations: ``sbh(34 + 5as/h)`` bytes without recomputation.
"""

from __future__ import annotations

import math
from typing import Union

__all__ = [
    "OPTIMIZER_STATES",
    "training_state_bytes",
    "gpt_activation_bytes_per_layer",
    "reserve_bytes",
]

#: Optimizer -> number of per-parameter state tensors it keeps.
OPTIMIZER_STATES = {"adam": 2, "adamw": 2, "sgd_momentum": 1, "sgd": 0}


def training_state_bytes(
    num_params: int,
    *,
    param_bytes: int = 4,
    mixed_precision: bool = False,
    optimizer: str = "adam",
    zero_stage: int = 0,
    dp_size: int = 1,
) -> dict[str, int]:
    """Bytes per device for parameters, gradients and optimizer states.

    Args:
        num_params: parameters of the model (or of the part this device group
            holds), Psi.
        param_bytes: bytes per element of the full-precision parameter dtype
            (4 = fp32). Without mixed precision, parameters, gradients and
            each optimizer state use it (fp32 Adam: 4 + 4 + 8 = 16 B/param).
            With mixed precision, parameters and gradients are 2-byte
            (fp16/bf16) and the optimizer keeps a master copy plus its states
            at ``param_bytes`` each (Adam: 2 + 2 + 12 = 16 B/param).
        mixed_precision: see ``param_bytes``.
        optimizer: a key of :data:`OPTIMIZER_STATES`.
        zero_stage: 0 none; 1 shards optimizer states over ``dp_size``;
            2 also gradients; 3 also parameters.
        dp_size: data-parallel (ZeRO) group size N.

    Returns:
        ``{"params", "grads", "optimizer", "total"}`` in bytes per device.
    """
    if isinstance(num_params, bool) or not isinstance(num_params, int) or num_params < 0:
        raise ValueError(f"num_params must be an integer >= 0, got {num_params!r}")
    if isinstance(param_bytes, bool) or not isinstance(param_bytes, int) or param_bytes < 1:
        raise ValueError(f"param_bytes must be a positive integer (bytes), got {param_bytes!r}")
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"unknown optimizer {optimizer!r}; known: {', '.join(OPTIMIZER_STATES)}")
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage!r}")
    if isinstance(dp_size, bool) or not isinstance(dp_size, int) or dp_size < 1:
        raise ValueError(f"dp_size must be an integer >= 1, got {dp_size!r}")

    states = OPTIMIZER_STATES[optimizer]
    if mixed_precision:
        p_b, g_b, o_b = 2, 2, param_bytes * (1 + states)  # master copy + states
    else:
        p_b, g_b, o_b = param_bytes, param_bytes, param_bytes * states
    shard = math.ceil(num_params / dp_size)  # parameters per device when sharded
    params = p_b * (shard if zero_stage >= 3 else num_params)
    grads = g_b * (shard if zero_stage >= 2 else num_params)
    opt = o_b * (shard if zero_stage >= 1 else num_params)
    return {"params": params, "grads": grads, "optimizer": opt, "total": params + grads + opt}


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
