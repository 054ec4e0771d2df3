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


class BatchNormCNN(nn.Module):
    """Two conv + BatchNorm + ReLU blocks, global pooling and a linear
    classifier; ``forward(images, labels)`` returns the cross-entropy loss. In
    training mode each BatchNorm updates its running mean and variance and
    counts its batches: buffers forward writes."""

    def __init__(self, channels: int = 8, classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, channels, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, 2 * channels, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(2 * channels)
        self.head = nn.Linear(2 * channels, classes)

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn1(self.conv1(images)))
        h = torch.relu(self.bn2(self.conv2(h)))
        logits = self.head(h.mean(dim=(2, 3)))
        return nn.functional.cross_entropy(logits, labels)


def bn_cnn(batch_size: int = 8, image_size: int = 8) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """:class:`BatchNormCNN` on ``batch_size`` random 3 x image_size x image_size
    images with random labels of 10 classes."""
    images = torch.randn(batch_size, 3, image_size, image_size)
    labels = torch.randint(0, 10, (batch_size,))
    return BatchNormCNN(), (images, labels)


class BranchOnValue(nn.Module):
    """A forward that branches on a tensor's value (``if h.mean() > 0``), which
    no capture of the program can take: the planner must say so in one line."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 16)
        self.fc2 = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        if h.mean() > 0:  # data-dependent: the line the planner's error names
            h = torch.relu(h)
        return self.fc2(h).pow(2).mean()


def branch_on_value(batch_size: int = 4) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """:class:`BranchOnValue` on ``batch_size`` random 16-vectors."""
    return BranchOnValue(), (torch.randn(batch_size, 16),)


class ItemInForward(nn.Module):
    """A forward that reads a tensor's value as a Python number (``.item()``)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        scale = h.abs().max().item()
        return (h / scale).pow(2).mean()


def item_in_forward(batch_size: int = 4) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """:class:`ItemInForward` on ``batch_size`` random 16-vectors."""
    return ItemInForward(), (torch.randn(batch_size, 16),)


class Seq2SeqLMStep(nn.Module):
    """``forward(input_ids, labels)``: a Hugging Face encoder-decoder's own loss
    (a scalar); the decoder's inputs are the labels shifted right, as the model
    makes them itself."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.hf = model

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.hf(input_ids=input_ids, labels=labels).loss


def bart(batch_size: int = 8, seq_len: int = 16) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """A BART encoder-decoder (2 + 2 layers, d_model 64, 4 heads, vocabulary
    128, dropout 0) on random token ids that are also its labels."""
    from transformers import BartConfig, BartForConditionalGeneration

    config = BartConfig(vocab_size=128, d_model=64, encoder_layers=2, decoder_layers=2,
                        encoder_attention_heads=4, decoder_attention_heads=4,
                        encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=64,
                        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
    ids = torch.randint(3, config.vocab_size, (batch_size, seq_len))
    return Seq2SeqLMStep(BartForConditionalGeneration(config)), (ids, ids.clone())
