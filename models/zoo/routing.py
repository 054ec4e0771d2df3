"""What the zoo's mixture-of-experts layers share: routing groups and expert capacity.

Both :mod:`models.zoo.moe` (GShard top-2) and :mod:`models.zoo.deepseek` route
tokens in groups of ``S`` and give each expert at most ``C`` slots per group, so
that every shape is static and the layers export with ``torch.export``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

__all__ = ["expert_capacity", "expert_weights", "routing_groups"]


def routing_groups(group_size: int, num_tokens: int, seq_len: int) -> tuple[int, int]:
    """(G, S): routing groups and tokens per group for ``num_tokens`` tokens:
    groups of ``group_size`` when it divides them, else one group per sequence."""
    s = group_size if num_tokens % group_size == 0 else seq_len
    return num_tokens // s, s


def expert_capacity(capacity_factor: float, top_k: int, group_size: int, n_experts: int) -> int:
    """Slots one expert has per group of ``group_size`` tokens (C):
    ``capacity_factor`` times a perfectly balanced load of ``top_k`` choices per
    token, at least 1 and at most the group."""
    c = math.ceil(capacity_factor * top_k * group_size / n_experts)
    return max(1, min(group_size, c))


def expert_weights(n_experts: int, *shapes: tuple[int, int]) -> tuple[nn.Parameter, ...]:
    """One uninitialised batched weight [n_experts, rows, cols] per ``(rows, cols)``
    of ``shapes``: every expert's matrix of one kind in one tensor, dimension 0
    the expert (what expert parallelism shards)."""
    return tuple(nn.Parameter(torch.empty(n_experts, rows, cols)) for rows, cols in shapes)
