"""Mixture-of-experts GPT: GPT blocks whose MLP is a top-2 routed MoE layer.

Layout (nanoGPT names, see :mod:`models.zoo.gpt`): ``transformer.wte``, ``transformer.wpe``,
``transformer.h.<i>.{ln_1, attn, ln_2, moe}``, ``transformer.ln_f``, ``lm_head``.
The MoE layer ``moe`` has a router ``moe.router`` Linear(h, E, bias=False) and the
experts as two batched weights ``moe.w_in`` [E, h, f] and ``moe.w_out`` [E, f, h]
(expert parallelism shards their dimension 0).

Dispatch is GShard-style with static shapes, so the layer exports with
``torch.export(strict=False)``:

1. tokens are split into groups of ``S`` tokens ([G, S, h]);
2. the router gives softmax gates [G, S, E]; the top-2 experts of every token are
   picked and their two gates renormalised to sum to 1;
3. every expert takes at most ``C = min(S, ceil(capacity_factor * 2 * S / E))``
   tokens per group, first choices before second choices, in token order; the
   rest are dropped (their weight becomes 0, the residual still carries them);
4. one-hot dispatch [G, S, E, C] and combine [G, S, E, C] tensors move tokens to
   the experts and back with einsum; experts run as one ``bmm`` over [E, G*C, h].

No data-dependent Python control flow, no ``nonzero``, no data-dependent sizes.
With ``capacity_factor >= E / 2`` no token is ever dropped and the layer equals
exact top-2 routing (``moe-tiny`` uses this).

Forward FLOPs per MoE layer (matmuls): router ``2 T h E``, experts
``4 E G C h f``, dispatch and combine ``2 * 2 G S E C h`` (T = G S tokens).
No auxiliary load-balancing loss is added: ``forward`` returns the LM loss only;
:func:`load_balancing_loss` computes the GShard/Switch auxiliary loss from the
gates for callers that want it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from models.zoo.gpt import GPT, Block, GPTConfig
from models.zoo.routing import expert_capacity, expert_weights, routing_groups


@dataclass(frozen=True, kw_only=True)
class MoEConfig(GPTConfig):
    """Shape of a mixture-of-experts GPT: a :class:`models.zoo.gpt.GPTConfig`
    (its fields say the attention, embeddings and norms) whose blocks' MLP is
    a top-2 routed MoE layer. The fields it adds are keyword-only.

    Attributes:
        n_expert: experts per MoE layer (E).
        expert_hidden: inner size of one expert (f), in elements.
        capacity_factor: expert capacity relative to a perfectly balanced top-2
            load; ``>= n_expert / 2`` means no token is ever dropped.
        group_size: tokens per routing group (S); when it does not divide the
            number of tokens of a batch, one group per sequence is used.
        top_k: experts each token is routed to (2).
    """

    n_expert: int
    expert_hidden: int
    capacity_factor: float = 1.25
    group_size: int = 512
    top_k: int = 2

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.dropout:
            raise ValueError("the MoE layer applies no dropout; set dropout=0")
        if self.top_k != 2:
            raise ValueError("only top-2 routing is implemented")
        if self.n_expert < 2:
            raise ValueError("top-2 routing needs at least 2 experts")

    @property
    def max_seq_len(self) -> int:
        return self.block_size

    def block_params(self) -> int:
        h, e, f = self.n_embd, self.n_expert, self.expert_hidden
        return 4 * h * h + 4 * h + 4 * h + h * e + 2 * e * h * f

    def num_params(self) -> int:
        h, v, s = self.n_embd, self.vocab_size, self.block_size
        return self.n_layer * self.block_params() + v * h + s * h + 2 * h + v * h

    def forward_flops(self, batch_size: int, seq_len: int) -> float:
        """Matmul FLOPs of one forward pass, as captured: attention and projections
        ``8 b s h^2 + 4 b s^2 h``, router ``2 b s h E``, experts ``4 E G C h f``,
        dispatch + combine ``4 G S E C h`` per layer, plus the LM head ``2 b s h V``."""
        b, s, h, e, f = batch_size, seq_len, self.n_embd, self.n_expert, self.expert_hidden
        g, gs = self.group_shape(b * s, s)
        c = self.capacity(gs)
        per_layer = (8 * b * s * h * h + 4 * b * s * s * h + 2 * b * s * h * e
                     + 4 * e * g * c * h * f + 4 * g * gs * e * c * h)
        return float(self.n_layer * per_layer + 2 * b * s * h * self.vocab_size)

    def group_shape(self, num_tokens: int, seq_len: int) -> tuple[int, int]:
        """(G, S): routing groups and tokens per group for ``num_tokens`` tokens."""
        return routing_groups(self.group_size, num_tokens, seq_len)

    def capacity(self, group_size: int) -> int:
        """Tokens one expert accepts per group (C)."""
        return expert_capacity(self.capacity_factor, self.top_k, group_size, self.n_expert)


def top2_combine_weights(logits: torch.Tensor) -> torch.Tensor:
    """Dense top-2 routing weights [..., E] from router logits [..., E].

    Softmax over experts, keep the two largest gates, renormalise them to sum
    to 1; every other entry is 0. Exactly two nonzeros per token (before any
    capacity limit).
    """
    gates = F.softmax(logits.float(), dim=-1)
    top_w, top_i = gates.topk(2, dim=-1)
    top_w = top_w / top_w.sum(dim=-1, keepdim=True)
    experts = torch.arange(logits.shape[-1], device=logits.device)
    onehot = (top_i.unsqueeze(-1) == experts).to(top_w.dtype)  # [..., 2, E]
    return (top_w.unsqueeze(-1) * onehot).sum(dim=-2)


def top2_dispatch(logits: torch.Tensor, capacity: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GShard top-2 routing with a static expert capacity.

    Args:
        logits: router logits [G, S, E].
        capacity: C, the most tokens one expert takes per group.

    Returns:
        combine: float32 [G, S, E, C], the renormalised gate of token s at slot c
            of expert e (0 where not routed or dropped);
        dispatch: float32 0/1 [G, S, E, C];
        gates: float32 softmax gates [G, S, E] (for an auxiliary loss).
    """
    G, S, E = logits.shape
    gates = F.softmax(logits.float(), dim=-1)
    top_w, top_i = gates.topk(2, dim=-1)                                     # [G, S, 2]
    top_w = top_w / top_w.sum(dim=-1, keepdim=True)
    experts = torch.arange(E, device=logits.device)
    mask = (top_i.unsqueeze(-1) == experts).to(torch.long)                  # [G, S, 2, E]
    mask1, mask2 = mask[:, :, 0, :], mask[:, :, 1, :]
    # Position of each token in its expert's buffer: first choices first.
    pos1 = torch.cumsum(mask1, dim=1) - 1
    mask1 = mask1 * (pos1 < capacity).to(torch.long)
    count1 = mask1.sum(dim=1, keepdim=True)                                  # [G, 1, E]
    pos2 = torch.cumsum(mask2, dim=1) - 1 + count1
    mask2 = mask2 * (pos2 < capacity).to(torch.long)
    slot1 = (pos1 * mask1).sum(dim=-1)                                       # [G, S]
    slot2 = (pos2 * mask2).sum(dim=-1)
    slots = torch.arange(capacity, device=logits.device)
    onehot1 = (slot1.unsqueeze(-1) == slots).to(torch.float32)               # [G, S, C]
    onehot2 = (slot2.unsqueeze(-1) == slots).to(torch.float32)
    d1 = mask1.to(torch.float32).unsqueeze(-1) * onehot1.unsqueeze(2)       # [G, S, E, C]
    d2 = mask2.to(torch.float32).unsqueeze(-1) * onehot2.unsqueeze(2)
    combine = top_w[:, :, 0, None, None] * d1 + top_w[:, :, 1, None, None] * d2
    dispatch = d1 + d2
    return combine, dispatch, gates


def load_balancing_loss(gates: torch.Tensor) -> torch.Tensor:
    """Switch/GShard auxiliary loss ``E * sum_e mean(gate_e) * frac(first choice = e)``.

    ``gates``: softmax gates [..., E]. Equals 1.0 for a perfectly balanced router.
    """
    E = gates.shape[-1]
    flat = gates.reshape(-1, E)
    first = (flat.argmax(dim=-1, keepdim=True) == torch.arange(E, device=gates.device))
    return E * (flat.mean(dim=0) * first.to(flat.dtype).mean(dim=0)).sum()


class MoELayer(nn.Module):
    """Top-2 routed experts, each ``Linear(h, f) -> GELU -> Linear(f, h)`` without bias.

    Input and output: [batch, seq, h].
    """

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.config = config
        h, e, f = config.n_embd, config.n_expert, config.expert_hidden
        self.router = nn.Linear(h, e, bias=False)
        self.w_in, self.w_out = expert_weights(e, (h, f), (f, h))
        self.gelu = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, h = x.shape
        E = self.config.n_expert
        G, S = self.config.group_shape(B * T, T)
        C = self.config.capacity(S)
        xg = x.reshape(G, S, h)
        combine, dispatch, _ = top2_dispatch(self.router(xg), C)
        combine, dispatch = combine.to(x.dtype), dispatch.to(x.dtype)
        expert_in = torch.einsum("gsec,gsh->egch", dispatch, xg).reshape(E, G * C, h)
        hidden = self.gelu(torch.bmm(expert_in, self.w_in))                   # [E, G*C, f]
        expert_out = torch.bmm(hidden, self.w_out).reshape(E, G, C, h)
        y = torch.einsum("gsec,egch->gsh", combine, expert_out)
        return y.reshape(B, T, h)


class MoEBlock(Block):
    """Pre-LayerNorm block: ``x + attn(ln_1(x))`` then ``x + moe(ln_2(x))``."""

    feed_forward_name = "moe"

    def feed_forward(self, config: MoEConfig) -> nn.Module:
        """The top-2 routed :class:`MoELayer`."""
        return MoELayer(config)


class MoEGPT(GPT):
    """MoE language model; ``forward(idx, targets)`` returns the mean cross-entropy loss.

    Args of forward:
        idx: token ids, int64 [batch, seq] in [0, vocab_size), seq <= block_size.
        targets: int64 [batch, seq]; when ``None`` the logits are returned.
    """

    def make_block(self, config: MoEConfig) -> nn.Module:
        return MoEBlock(config)

    def init_module(self, name: str, module: nn.Module, std: float, proj_std: float) -> None:
        """GPT's initialisation; experts N(0, 0.02) in, N(0, 0.02/sqrt(2L)) out."""
        if isinstance(module, MoELayer):
            nn.init.normal_(module.w_in, mean=0.0, std=std)
            nn.init.normal_(module.w_out, mean=0.0, std=proj_std)
        else:
            super().init_module(name, module, std, proj_std)
