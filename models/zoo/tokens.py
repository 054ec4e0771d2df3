"""The two ends the zoo's language models share: token ids in, the next-token loss out.

GPT, Llama, the mixture-of-experts GPT and DeepSeek-V3 all take
``forward(idx, targets)``: int64 token ids [batch, seq] and the ids that follow
them, and return the mean cross-entropy of their logits against ``targets`` (the
logits themselves when ``targets`` is None).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["next_token_loss", "token_inputs"]


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor | None) -> torch.Tensor:
    """The mean cross-entropy of ``logits`` [batch, seq, V] against ``targets``
    [batch, seq]; ``logits`` when ``targets`` is None."""
    if targets is None:
        return logits
    return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def token_inputs(config: Any, batch_size: int, seq_len: int,
                 device: torch.device | str = "meta") -> tuple[torch.Tensor, torch.Tensor]:
    """(idx, targets): int64 [batch_size, seq_len] token ids in [0, vocab_size) for
    a language model of ``config`` (a zoo config with ``vocab_size`` and
    ``max_seq_len``)."""
    if seq_len > config.max_seq_len:
        raise ValueError(f"seq_len={seq_len} exceeds max_seq_len={config.max_seq_len}")
    shape = (batch_size, seq_len)
    idx = torch.randint(0, config.vocab_size, shape, dtype=torch.long, device=device)
    targets = torch.randint(0, config.vocab_size, shape, dtype=torch.long, device=device)
    return idx, targets
