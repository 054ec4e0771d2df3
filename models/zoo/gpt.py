"""GPT-2 / GPT-3: a decoder-only transformer with learned position embeddings.

The architecture follows nanoGPT (and the GPT-2/GPT-3 papers):

* token embedding ``transformer.wte`` [V, h] plus learned position embedding
  ``transformer.wpe`` [s, h];
* ``n_layer`` pre-LayerNorm blocks ``transformer.h.<i>``, each
  ``x + attn(ln_1(x))`` then ``x + mlp(ln_2(x))``;
* attention: fused ``c_attn`` Linear(h, 3h) with bias, causal
  ``F.scaled_dot_product_attention``, output projection ``c_proj`` Linear(h, h);
* MLP: ``c_fc`` Linear(h, 4h) -> GELU -> ``c_proj`` Linear(4h, h);
* final LayerNorm ``transformer.ln_f`` and an *untied* LM head ``lm_head``
  Linear(h, V, bias=False), so parameter counts are clean.

Parameter counts (elements, not bytes):

* one block: ``12 h^2 + 13 h``;
* whole model: ``L (12 h^2 + 13 h) + V h (wte) + s h (wpe) + 2 h (ln_f) + V h (head)``.

Forward FLOPs of one step (matmuls only, as counted by PyTorch's flop registry,
causal attention counted as full): ``L (24 b s h^2 + 4 b s^2 h) + 2 b s h V``.

No weight tying, no custom autograd: the module exports with
``torch.export.export(strict=False)`` on the meta device. By default no
dropout and fused attention; ``GPTConfig(attention="unfused", dropout=0.1)``
is the program Megatron-LM trained GPT-3-style models with in 2021: the
scores ``Q K^T`` materialised, masked, soft-maxed and dropped out as s x s
tensors, and dropout on the embeddings and after each block's projections.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from models.zoo.tokens import next_token_loss


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a GPT model.

    Attributes:
        n_layer: number of transformer blocks (L).
        n_embd: hidden size (h), in elements.
        n_head: attention heads (a); ``n_embd`` must be divisible by it.
        vocab_size: vocabulary size (V), in tokens.
        block_size: maximum sequence length (s), in tokens; the number of rows
            of the position embedding.
        layer_norm_eps: LayerNorm epsilon.
        attention: ``"fused"`` (``F.scaled_dot_product_attention``, one fused
            kernel) or ``"unfused"`` (the scores as [batch, heads, s, s]
            tensors: matmul, causal mask, softmax, dropout, matmul).
        dropout: probability of dropping an element of the embeddings, of each
            block's two projection outputs and (unfused) of the attention
            probabilities; 0 emits no dropout.
    """

    n_layer: int
    n_embd: int
    n_head: int
    vocab_size: int = 50257
    block_size: int = 1024
    layer_norm_eps: float = 1e-5
    attention: str = "fused"
    dropout: float = 0.0

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}")
        if self.attention not in ("fused", "unfused"):
            raise ValueError(f"attention must be 'fused' or 'unfused', got {self.attention!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout!r}")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def max_seq_len(self) -> int:
        return self.block_size

    def block_params(self) -> int:
        """Parameters of one transformer block: ``12 h^2 + 13 h``."""
        h = self.n_embd
        return 12 * h * h + 13 * h

    def num_params(self) -> int:
        """Parameters of the whole model (untied head)."""
        h, v, s = self.n_embd, self.vocab_size, self.block_size
        return self.n_layer * self.block_params() + v * h + s * h + 2 * h + v * h

    def forward_flops(self, batch_size: int, seq_len: int) -> float:
        """Matmul FLOPs of one forward pass: ``L(24bsh^2 + 4bs^2h) + 2bshV``."""
        b, s, h, v = batch_size, seq_len, self.n_embd, self.vocab_size
        return float(self.n_layer * (24 * b * s * h * h + 4 * b * s * s * h) + 2 * b * s * h * v)


def dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """``F.dropout``, or ``x`` itself when ``p`` is 0 (``F.dropout`` would still
    put an op in the captured program)."""
    return F.dropout(x, p, training) if p > 0 else x


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with a fused qkv projection.

    Input and output: [batch, seq, n_embd].
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.fused = config.attention == "fused"
        self.dropout = config.dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=True)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=True)
        if not self.fused:  # True above the diagonal: the future a token may not see
            s = config.block_size
            self.register_buffer("future", torch.ones(s, s, dtype=torch.bool).triu(1),
                                 persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        # [B, T, C] -> [B, n_head, T, head_dim]
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        if self.fused:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            scores = (q * (1.0 / math.sqrt(C // self.n_head))) @ k.transpose(-2, -1)
            scores = scores.masked_fill(self.future[:T, :T], float("-inf"))
            probs = dropout(torch.softmax(scores, dim=-1), self.dropout, self.training)
            y = probs @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return dropout(self.c_proj(y), self.dropout, self.training)


class MLP(nn.Module):
    """Position-wise feed-forward: Linear(h, 4h) -> GELU -> Linear(4h, h)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=True)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=True)
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dropout(self.c_proj(self.gelu(self.c_fc(x))), self.dropout, self.training)


class Block(nn.Module):
    """Pre-LayerNorm transformer block, ``x + attn(ln_1(x))`` then
    ``x + mlp(ln_2(x))``: ``12 h^2 + 13 h`` parameters.

    A subclass may put another feed-forward module in the MLP's place: it names
    it (:attr:`feed_forward_name`) and builds it (:meth:`feed_forward`).
    """

    feed_forward_name = "mlp"

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps, bias=True)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps, bias=True)
        self.add_module(self.feed_forward_name, self.feed_forward(config))

    def feed_forward(self, config: GPTConfig) -> nn.Module:
        """The module after ``ln_2``: the dense :class:`MLP`."""
        return MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        x = x + self.get_submodule(self.feed_forward_name)(self.ln_2(x))
        return x


class GPT(nn.Module):
    """GPT language model; ``forward(idx, targets)`` returns the mean cross-entropy loss.

    Args of forward:
        idx: token ids, int64 [batch, seq] with values in [0, vocab_size).
        targets: next-token ids, int64 [batch, seq]. When ``None`` the logits
            [batch, seq, vocab_size] are returned instead of the loss.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            h=nn.ModuleList([self.make_block(config) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps, bias=True),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """GPT-2 initialisation: N(0, 0.02), residual projections N(0, 0.02/sqrt(2L)).

        Covers every parameter, so a model built on meta can be materialised
        with ``model.to_empty(device=...)`` followed by ``model.init_weights()``.
        """
        std = 0.02
        proj_std = std / math.sqrt(2 * self.config.n_layer)
        for name, module in self.named_modules():
            self.init_module(name, module, std, proj_std)

    def make_block(self, config: GPTConfig) -> nn.Module:
        """One transformer block (subclasses swap the MLP, e.g. for experts)."""
        return Block(config)

    def init_module(self, name: str, module: nn.Module, std: float, proj_std: float) -> None:
        """Initialise one module's own parameters (see :meth:`init_weights`)."""
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0,
                            std=proj_std if name.endswith("c_proj") else std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        B, T = idx.shape
        pos = torch.arange(T, dtype=torch.long, device=idx.device)
        x = dropout(self.transformer.wte(idx) + self.transformer.wpe(pos),
                    getattr(self.config, "dropout", 0.0), self.training)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        return next_token_loss(self.lm_head(x), targets)

