"""Small models of the families ``planner`` must plan, run and check
(issue 41): factories ``(model, example_inputs)`` for ``--model
tests/coverage_models.py:NAME``. Every one is deterministic (dropout 0) so that
``planner run --check`` can compare it with one process."""

from __future__ import annotations

import torch
from torch import nn


class MaskedLMStep(nn.Module):
    """``forward(input_ids, labels)``: a Hugging Face masked LM's own loss (a scalar)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.hf = model

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.hf(input_ids=input_ids, labels=labels).loss


def bert_mlm(batch_size: int = 4, seq_len: int = 16) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """A 2-layer BERT masked LM (hidden 64, 4 heads, vocabulary 128, absolute
    positions, dropout 0): its attention key biases' true gradient is exactly
    zero, which the check must not fail on."""
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2,
                        num_attention_heads=4, intermediate_size=128,
                        max_position_embeddings=64, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0, attn_implementation="eager")
    ids = torch.randint(0, config.vocab_size, (batch_size, seq_len))
    return MaskedLMStep(BertForMaskedLM(config)), (ids, ids.clone())
