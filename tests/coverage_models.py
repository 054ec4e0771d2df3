"""Small models of the families ``planner`` must plan, run and check
(issue 41): factories ``(model, example_inputs)`` for ``--model
tests/coverage_models.py:NAME``. Every one is deterministic (dropout 0) so that
``planner run --check`` can compare it with one process."""

from __future__ import annotations

import torch
from torch import nn


class HFLossStep(nn.Module):
    """``forward(input_ids, labels)``: a Hugging Face model's own loss (a scalar):
    a masked LM's, or an encoder-decoder's, whose decoder inputs are the labels
    shifted right, as the model makes them itself."""

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
    return HFLossStep(BertForMaskedLM(config)), (ids, ids.clone())


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


def bart(batch_size: int = 8, seq_len: int = 16) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """A BART encoder-decoder (2 + 2 layers, d_model 64, 4 heads, vocabulary
    128, dropout 0) on random token ids that are also its labels."""
    from transformers import BartConfig, BartForConditionalGeneration

    config = BartConfig(vocab_size=128, d_model=64, encoder_layers=2, decoder_layers=2,
                        encoder_attention_heads=4, decoder_attention_heads=4,
                        encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=64,
                        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
    ids = torch.randint(3, config.vocab_size, (batch_size, seq_len))
    return HFLossStep(BartForConditionalGeneration(config)), (ids, ids.clone())


def deberta_v2_mlm(batch_size: int = 8, seq_len: int = 16
                   ) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """A 2-layer DeBERTa-v2 masked LM (hidden 64, 4 heads, vocabulary 128,
    relative attention with the library's defaults, dropout 0)."""
    from transformers import DebertaV2Config, DebertaV2ForMaskedLM

    config = DebertaV2Config(vocab_size=128, hidden_size=64, num_hidden_layers=2,
                             num_attention_heads=4, intermediate_size=128,
                             max_position_embeddings=64, hidden_dropout_prob=0.0,
                             attention_probs_dropout_prob=0.0)
    ids = torch.randint(0, config.vocab_size, (batch_size, seq_len))
    return HFLossStep(DebertaV2ForMaskedLM(config)), (ids, ids.clone())


class LabelledStep(nn.Module):
    """``forward(inputs, labels)``: a Hugging Face model's own loss (a scalar)
    for the keyword ``key`` its inputs go by (``pixel_values``,
    ``input_features``)."""

    def __init__(self, model: nn.Module, key: str) -> None:
        super().__init__()
        self.hf = model
        self.key = key

    def forward(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.hf(**{self.key: inputs}, labels=labels).loss


def vit(batch_size: int = 8, image_size: int = 32) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """A 2-layer ViT image classifier (hidden 64, 4 heads, 8 x 8 patches, 10
    classes, dropout 0) on random images and labels."""
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                       intermediate_size=128, image_size=image_size, patch_size=8,
                       num_labels=10, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    images = torch.randn(batch_size, 3, image_size, image_size)
    return (LabelledStep(ViTForImageClassification(config), "pixel_values"),
            (images, torch.randint(0, 10, (batch_size,))))


def resnet(batch_size: int = 8, image_size: int = 32) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """A ResNet image classifier of two stages (16 and 32 channels, one basic
    block each, BatchNorm in training mode, 10 classes) on random images."""
    from transformers import ResNetConfig, ResNetForImageClassification

    config = ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1],
                          layer_type="basic", num_labels=10)
    images = torch.randn(batch_size, 3, image_size, image_size)
    return (LabelledStep(ResNetForImageClassification(config), "pixel_values"),
            (images, torch.randint(0, 10, (batch_size,))))


def whisper(batch_size: int = 8, seq_len: int = 16) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """A Whisper speech-to-text model (2 + 2 layers, d_model 64, 4 heads, 16
    mel bins, 32 audio frames, vocabulary 128, dropout 0) on random log-mel
    features and token labels."""
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    config = WhisperConfig(vocab_size=128, num_mel_bins=16, d_model=64, encoder_layers=2,
                           decoder_layers=2, encoder_attention_heads=4,
                           decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
                           max_source_positions=16, max_target_positions=64, pad_token_id=0,
                           bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
                           dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
    features = torch.randn(batch_size, config.num_mel_bins, 2 * config.max_source_positions)
    labels = torch.randint(3, config.vocab_size, (batch_size, seq_len))
    return LabelledStep(WhisperForConditionalGeneration(config), "input_features"), (features, labels)


class Attention(nn.Module):
    """Self-attention as Hugging Face writes it: heads split by a view, the
    fused kernel, then ``transpose(1, 2).contiguous()`` and a view merging the
    heads back. The capture has no copy there: the fused kernel's output is
    [batch, seq, heads, dim] in memory, so the transpose is contiguous."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        h = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(h.transpose(1, 2).contiguous().view(b, s, d)).pow(2).mean()


def attention(batch_size: int = 8, seq_len: int = 16) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """:class:`Attention` (hidden 32, 4 heads) on ``batch_size`` random sequences."""
    return Attention(), (torch.randn(batch_size, seq_len, 32),)


class FailsOnRanks(nn.Module):
    """A linear layer whose forward refuses to run where a process group exists:
    it plans, and then fails in every rank (a test of the ranks' error line)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            raise RuntimeError("this model refuses to run in the ranks")
        return self.lin(x).pow(2).mean()


def fails_on_ranks(batch_size: int = 8) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """:class:`FailsOnRanks` on a ``batch_size`` x 16 batch."""
    return FailsOnRanks(), (torch.randn(batch_size, 16),)
