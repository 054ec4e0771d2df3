"""LLaMA (2/3): RMSNorm, rotary position embeddings, grouped-query attention, SwiGLU.

Module and parameter names follow Meta's reference code and torchtitan:

* ``tok_embeddings`` [V, h];
* ``layers.<i>``: ``attention_norm`` (RMSNorm), ``attention.{wq, wk, wv, wo}``,
  ``ffn_norm`` (RMSNorm), ``feed_forward.{w1, w2, w3}`` (w1 gate, w3 up, w2 down);
* ``norm`` (RMSNorm) and an untied ``output`` head Linear(h, V).

No Linear has a bias. Rotary embeddings are computed inside each attention
module from the positions (no buffers), so a model built on the meta device is
materialised with ``model.to_empty(device=...)`` + ``model.init_weights()``.

Parameter counts (elements), with ``d = h / n_heads`` and ``f = ffn_dim``:

* one block: ``2 h^2 + 2 h (n_kv_heads d) + 3 h f + 2 h``;
* whole model: ``L * block + 2 V h + h``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from models.zoo.tokens import next_token_loss


@dataclass(frozen=True)
class LlamaConfig:
    """Shape of a LLaMA model.

    Attributes:
        n_layers: number of transformer blocks (L).
        dim: hidden size (h), in elements.
        n_heads: query heads.
        n_kv_heads: key/value heads (grouped-query attention); divides ``n_heads``.
        ffn_dim: SwiGLU inner size (f), in elements.
        vocab_size: vocabulary size (V), in tokens.
        max_seq_len: longest supported sequence, in tokens.
        rope_theta: rotary base frequency.
        norm_eps: RMSNorm epsilon.
        rope_scaling: Llama 3.1's rotary frequency scaling (``rope_type: llama3`` of
            its released ``config.json``), or None for plain RoPE; see
            :class:`RopeScaling`.
    """

    n_layers: int
    dim: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    vocab_size: int = 128256
    max_seq_len: int = 8192
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5
    rope_scaling: "RopeScaling | None" = None

    def __post_init__(self) -> None:
        if self.dim % self.n_heads:
            raise ValueError(f"dim={self.dim} is not divisible by n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}")
        if (self.dim // self.n_heads) % 2:
            raise ValueError("head_dim must be even for rotary embeddings")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def block_params(self) -> int:
        h, kv = self.dim, self.n_kv_heads * self.head_dim
        return 2 * h * h + 2 * h * kv + 3 * h * self.ffn_dim + 2 * h

    def num_params(self) -> int:
        return self.n_layers * self.block_params() + 2 * self.vocab_size * self.dim + self.dim

    def forward_flops(self, batch_size: int, seq_len: int) -> float:
        """Matmul FLOPs of one forward pass (causal attention counted as full):
        ``L (2 b s (2 h^2 + 2 h kv d + 3 h f) + 4 b s^2 h) + 2 b s h V``."""
        b, s, h = batch_size, seq_len, self.dim
        kv = self.n_kv_heads * self.head_dim
        per_layer = 2 * b * s * (2 * h * h + 2 * h * kv + 3 * h * self.ffn_dim) + 4 * b * s * s * h
        return float(self.n_layers * per_layer + 2 * b * s * h * self.vocab_size)


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1's scaling of the rotary frequencies (``rope_scaling`` with
    ``rope_type: "llama3"`` in Meta's released ``config.json``), which takes the
    8,192-token Llama 3 to 131,072 tokens: wavelengths (in tokens) shorter than
    ``original_max_seq_len / high_freq_factor`` keep their frequency, those longer
    than ``original_max_seq_len / low_freq_factor`` are divided by ``factor``,
    and the ones between are interpolated smoothly."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_seq_len: int = 8192

    def apply(self, inv_freq: torch.Tensor) -> torch.Tensor:
        """The scaled inverse frequencies (radians per token) of ``inv_freq``."""
        low_wavelen = self.original_max_seq_len / self.low_freq_factor
        high_wavelen = self.original_max_seq_len / self.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        smooth = (self.original_max_seq_len / wavelen - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor)
        mid = (1 - smooth) * inv_freq / self.factor + smooth * inv_freq
        out = torch.where(wavelen > low_wavelen, inv_freq / self.factor, inv_freq)
        between = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
        return torch.where(between, mid, out)


#: Llama 3.1's rotary scaling (131,072 tokens of context).
LLAMA31_ROPE_SCALING = RopeScaling()


class RMSNorm(nn.Module):
    """``x * rsqrt(mean(x^2, -1) + eps) * weight`` over the last dimension."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_cos_sin(seq_len: int, head_dim: int, theta: float,
                 device: torch.device | str | None = None,
                 dtype: torch.dtype = torch.float32,
                 scaling: RopeScaling | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotation angles, each [seq_len, head_dim // 2].

    Angle of position ``p`` and pair ``i`` is ``p * theta^(-2i / head_dim)`` (radians),
    the frequency ``theta^(-2i / head_dim)`` scaled by ``scaling`` when given.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device,
                                              dtype=torch.float32) / head_dim))
    if scaling is not None:
        inv_freq = scaling.apply(inv_freq)
    pos = torch.arange(seq_len, device=device, dtype=torch.float32)
    angles = torch.outer(pos, inv_freq)
    cos, sin = angles.cos(), angles.sin()
    if dtype != torch.float32:
        cos, sin = cos.to(dtype), sin.to(dtype)
    return cos, sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs ``(x[..., i], x[..., i + d/2])`` by the angles in cos/sin.

    Args:
        x: [batch, seq, heads, head_dim].
        cos, sin: [seq, head_dim // 2].

    A rotation per pair, so the norm of every head vector is preserved and
    ``<rope(q, m), rope(k, n)>`` depends only on ``m - n``.
    """
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos = cos[None, :, None, :]
    sin = sin[None, :, None, :]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Attention(nn.Module):
    """Causal grouped-query attention with rotary embeddings. [B, T, h] -> [B, T, h]."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.n_kv_heads = config.n_kv_heads
        self.head_dim = config.head_dim
        self.rope_theta = config.rope_theta
        self.rope_scaling = config.rope_scaling
        self.wq = nn.Linear(config.dim, config.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.dim, config.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(config.dim, config.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(config.n_heads * self.head_dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim)
        k = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim)
        cos, sin = rope_cos_sin(T, self.head_dim, self.rope_theta, device=x.device, dtype=x.dtype,
                                scaling=self.rope_scaling)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        # Repeat each kv head n_rep times: [B, T, kv, d] -> [B, T, heads, d].
        n_rep = self.n_heads // self.n_kv_heads
        if n_rep > 1:
            k = k[:, :, :, None, :].expand(B, T, self.n_kv_heads, n_rep, self.head_dim)
            k = k.reshape(B, T, self.n_heads, self.head_dim)
            v = v[:, :, :, None, :].expand(B, T, self.n_kv_heads, n_rep, self.head_dim)
            v = v.reshape(B, T, self.n_heads, self.head_dim)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, self.n_heads * self.head_dim)
        return self.wo(y)


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) * w3 x)``; w1/w3 are [f, h], w2 is [h, f]."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.ffn_dim, bias=False)
        self.w2 = nn.Linear(config.ffn_dim, config.dim, bias=False)
        self.w3 = nn.Linear(config.dim, config.ffn_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = FeedForward(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        x = x + self.feed_forward(self.ffn_norm(x))
        return x


class Llama(nn.Module):
    """LLaMA language model; ``forward(idx, targets)`` returns the mean cross-entropy loss.

    Args of forward:
        idx: token ids, int64 [batch, seq], seq <= max_seq_len.
        targets: int64 [batch, seq]; when ``None`` the logits [batch, seq, V] are returned.
    """

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList([TransformerBlock(config) for _ in range(config.n_layers)])
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """N(0, 0.02) for embeddings and Linears, N(0, 0.02/sqrt(2L)) for wo/w2, ones for norms."""
        std = 0.02
        out_std = std / math.sqrt(2 * self.config.n_layers)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                last = name.rsplit(".", 1)[-1]
                nn.init.normal_(module.weight, mean=0.0,
                                std=out_std if last in ("wo", "w2") else std)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=std)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        x = self.tok_embeddings(idx)
        for layer in self.layers:
            x = layer(x)
        return next_token_loss(self.output(self.norm(x)), targets)

