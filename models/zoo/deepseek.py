"""DeepSeek-V3: multi-head latent attention and a fine-grained top-k mixture of experts.

The shape follows the DeepSeek-V3 technical report (DeepSeek-AI 2024) for the main
model (671B parameters, 37B active per token; no multi-token-prediction module):

* ``tok_embeddings`` [V, h], an untied ``output`` head Linear(h, V) and a final
  ``norm`` (RMSNorm);
* ``dense_layers.<i>`` (the first ``n_dense_layers`` blocks) and ``moe_layers.<i>``
  (the rest). Every block is ``x + attention(attention_norm(x))`` then
  ``x + feed_forward(ffn_norm(x))`` with RMSNorm; a dense block's feed-forward is a
  SwiGLU ``w2(silu(w1 x) * w3 x)``, an MoE block's is :class:`MoE`. The two kinds
  are two ``nn.ModuleList`` so that the 58 identical MoE blocks form one list of
  identical blocks (the planner captures one and replicates it);
* attention is multi-head latent attention (:class:`MLA`): queries pass through a
  low-rank bottleneck (``wq_a`` -> ``q_norm`` -> ``wq_b``), keys and values are
  rebuilt from a compressed latent (``wkv_a`` -> ``kv_norm`` -> ``wkv_b``), and a
  decoupled rotary part of ``qk_rope_head_dim`` elements per head, whose key is
  shared by all heads, carries the positions. Fused causal attention
  (``F.scaled_dot_product_attention(..., is_causal=True)``) with query/key heads of
  ``qk_nope_head_dim + qk_rope_head_dim`` and value heads of ``v_head_dim``.
  During training MLA runs in this "naive" form (keys and values materialised per
  head); the absorbed form only pays off for decoding.

  Value heads narrower than the query/key heads (128 vs 192 in DeepSeek-V3) run
  on CUDA's memory-efficient kernel but not on the CPU flash kernel
  (torch then takes the math path, which DTensor cannot shard and whose output
  layout differs from the fused one the planner captures). ``pad_value_heads``
  zero-pads the values to the query/key size and slices the output back (the usual
  workaround for kernels of equal head sizes): the same result and parameters, attention
  FLOPs ``2 b s^2 a (2 (dn + dr))`` instead of ``2 b s^2 a (dn + dr + dv)``.
  ``deepseek-v3`` is exact (no padding); ``deepseek-tiny`` pads, so that its plans
  run on CPU ranks.

Routing (:func:`route`): sigmoid affinities ``s = sigmoid(x W_r^T)``, the ``top_k``
experts with the largest affinities per token, their weights ``s_i / sum_top s_j``
times ``routed_scaling_factor``. Omitted from DeepSeek-V3: group-limited routing
(``n_group``/``topk_group``), the auxiliary-loss-free balancing bias (it only changes
which experts are selected) and the sequence-wise auxiliary loss; ``forward``
returns the language-model loss only.

Dispatch is token choice with a static expert capacity, so the layer exports with
``torch.export(strict=False)`` with static shapes (no ``nonzero``, no data-dependent
sizes or Python control flow):

1. tokens are split into groups of ``S`` tokens ([G, S, h]);
2. a group's ``k S`` assignments (token, choice) are ordered choice-major (every
   token's first choice before any second choice) and, per expert, numbered in that
   order with a stable sort (:func:`expert_positions`, as sort-based token
   permutation does); an expert keeps its first ``C`` assignments,
   ``C = min(S, ceil(capacity_factor * k * S / E))``, the rest are dropped;
3. tokens are *gathered* into an expert buffer [E, G*C, h] with index tensors of
   static shape (``torch.gather``: its backward is ``scatter_add``), the experts run
   as batched matmuls, and each token gathers its ``k`` results back and sums them
   with its weights. Moving tokens costs bytes, not matmul FLOPs (a one-hot einsum
   dispatch would cost ``4 G S E C h`` FLOPs per layer, more than the experts
   themselves at 256 experts).

``dropless=True`` sets ``C = S``: every token may go to any expert, so nothing is
dropped, realised with the same static shapes by giving every expert a slot for
every token of the group. Its expert buffer is [E, G*S, h], so the experts cost
``E / k`` times the FLOPs of the routed tokens (32x for DeepSeek-V3): exact, but
meant for small models and tests. DeepSeek-V3 itself trains dropless with grouped
matmuls of data-dependent sizes; ``deepseek-v3`` in the zoo prices a capacity factor
of 1.25 instead (the balancing bias keeps expert loads near even).

Parameter counts (elements), with ``a = n_heads``, ``q = q_lora_rank``,
``c = kv_lora_rank``, ``dn, dr, dv`` the no-rope, rope and value head sizes:

* attention: ``h q + q + q a (dn + dr) + h (c + dr) + c + c a (dn + dv) + a dv h``;
* dense block: attention ``+ 2 h + 3 h F``; MoE block: attention ``+ 2 h + h E
  + 3 E h f + 3 h f n_shared``;
* model: ``n_dense * dense + n_moe * moe + 2 V h + h``; active per token: all but
  ``(E - k) 3 h f`` of each MoE block.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from models.zoo.llama import RMSNorm, apply_rope, rope_cos_sin
from models.zoo.routing import expert_capacity, expert_weights, routing_groups
from models.zoo.tokens import next_token_loss

# DeepSeekConfig fields that must be >= 1 (n_dense_layers and n_shared_experts may be 0).
_POSITIVE_SIZES = ("n_layers", "dim", "n_heads", "q_lora_rank", "kv_lora_rank",
                   "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "ffn_dim",
                   "n_routed_experts", "moe_ffn_dim", "top_k", "group_size", "vocab_size",
                   "max_seq_len")


@dataclass(frozen=True)
class DeepSeekConfig:
    """Shape of a DeepSeek-V3-style model (sizes in elements, lengths in tokens).

    Attributes:
        n_layers: transformer blocks (L), dense and MoE together.
        n_dense_layers: the first blocks, whose feed-forward is a dense SwiGLU.
        dim: hidden size (h).
        n_heads: attention heads (a).
        q_lora_rank: query bottleneck (q).
        kv_lora_rank: compressed key/value latent (c).
        qk_nope_head_dim: per-head query/key size without rotary embedding (dn).
        qk_rope_head_dim: per-head query/key size with rotary embedding (dr), even.
        v_head_dim: per-head value size (dv).
        ffn_dim: inner size of the dense blocks' SwiGLU (F).
        n_routed_experts: routed experts per MoE block (E).
        n_shared_experts: experts every token goes through, each ``moe_ffn_dim`` wide.
        moe_ffn_dim: inner size of one expert's SwiGLU (f).
        top_k: routed experts per token (k).
        routed_scaling_factor: factor on the normalised routing weights.
        capacity_factor: expert capacity relative to a perfectly balanced load
            (``C = ceil(capacity_factor * k * S / E)``), ignored when ``dropless``.
        dropless: give every expert a slot for every token of its group (``C = S``).
        group_size: tokens per routing group (S); when it does not divide the
            tokens of a batch, one group per sequence is used.
        vocab_size: vocabulary size (V).
        max_seq_len: longest supported sequence.
        rope_theta: rotary base frequency.
        norm_eps: RMSNorm epsilon.
        init_std: standard deviation of the normal initialisation of every weight.
        pad_value_heads: zero-pad value heads to ``dn + dr`` for the fused kernel
            (needed to run on CPU ranks; see the module docstring).
    """

    n_layers: int
    n_dense_layers: int
    dim: int
    n_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    ffn_dim: int
    n_routed_experts: int
    n_shared_experts: int
    moe_ffn_dim: int
    top_k: int
    routed_scaling_factor: float = 1.0
    capacity_factor: float = 1.25
    dropless: bool = False
    group_size: int = 4096
    vocab_size: int = 129280
    max_seq_len: int = 4096
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    init_std: float = 0.006
    pad_value_heads: bool = False

    def __post_init__(self) -> None:
        for name in _POSITIVE_SIZES:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)}")
        if not 0 <= self.n_dense_layers <= self.n_layers:
            raise ValueError(f"n_dense_layers={self.n_dense_layers} must be in 0..n_layers="
                             f"{self.n_layers}")
        if self.n_shared_experts < 0:
            raise ValueError(f"n_shared_experts must be >= 0, got {self.n_shared_experts}")
        if self.top_k > self.n_routed_experts:
            raise ValueError(f"top_k={self.top_k} exceeds n_routed_experts="
                             f"{self.n_routed_experts}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even "
                             "for rotary embeddings")
        if not self.capacity_factor > 0:
            raise ValueError(f"capacity_factor must be positive, got {self.capacity_factor}")

    # -- derived sizes -------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        """Per-head query/key size: ``dn + dr``."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def n_moe_layers(self) -> int:
        return self.n_layers - self.n_dense_layers

    @property
    def attention_v_head_dim(self) -> int:
        """Value head size the attention kernel runs with (``dn + dr`` when padded)."""
        return self.qk_head_dim if self.pad_value_heads else self.v_head_dim

    def group_shape(self, num_tokens: int, seq_len: int) -> tuple[int, int]:
        """(G, S): routing groups and tokens per group for ``num_tokens`` tokens."""
        return routing_groups(self.group_size, num_tokens, seq_len)

    def capacity(self, group_size: int) -> int:
        """Slots per expert and group (C): ``S`` when dropless, else
        ``min(S, ceil(capacity_factor * k * S / E))``."""
        if self.dropless:
            return group_size
        return expert_capacity(self.capacity_factor, self.top_k, group_size,
                               self.n_routed_experts)

    # -- parameter counts (elements) -------------------------------------------------
    def attention_params(self) -> int:
        h, a, q, c = self.dim, self.n_heads, self.q_lora_rank, self.kv_lora_rank
        dn, dr, dv = self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim
        return (h * q + q + q * a * (dn + dr) + h * (c + dr) + c + c * a * (dn + dv)
                + a * dv * h)

    def dense_block_params(self) -> int:
        return self.attention_params() + 2 * self.dim + 3 * self.dim * self.ffn_dim

    def expert_params(self) -> int:
        """One routed (or shared) expert: ``3 h f``."""
        return 3 * self.dim * self.moe_ffn_dim

    def moe_block_params(self) -> int:
        h, e = self.dim, self.n_routed_experts
        return (self.attention_params() + 2 * h + h * e
                + (e + self.n_shared_experts) * self.expert_params())

    def num_params(self) -> int:
        """Every parameter of the model."""
        return (self.n_dense_layers * self.dense_block_params()
                + self.n_moe_layers * self.moe_block_params()
                + 2 * self.vocab_size * self.dim + self.dim)

    def num_active_params(self) -> int:
        """Parameters one token uses: all but the ``E - k`` routed experts it skips
        in every MoE block (embedding and head included)."""
        skipped = (self.n_routed_experts - self.top_k) * self.expert_params()
        return self.num_params() - self.n_moe_layers * skipped

    def forward_flops(self, batch_size: int, seq_len: int) -> float:
        """Matmul FLOPs of one forward pass (causal attention counted as full).

        Per block ``2 T P_attn + 2 b s^2 a (dn + dr + dv)`` for attention (``dv``
        is ``dn + dr`` with ``pad_value_heads``)
        (``P_attn`` its projection weights, ``T = b s`` tokens); ``6 T h F`` for a
        dense feed-forward; router ``2 T h E``, routed experts ``6 E G C h f``
        (every slot of the buffer, used or not) and shared experts
        ``6 T h f n_shared`` for an MoE one; plus the head ``2 T h V``.
        """
        b, s, h = batch_size, seq_len, self.dim
        t = b * s
        norms = self.q_lora_rank + self.kv_lora_rank
        attn = (2 * t * (self.attention_params() - norms)
                + 2 * b * s * s * self.n_heads * (self.qk_head_dim + self.attention_v_head_dim))
        dense = 6 * t * h * self.ffn_dim
        g, gs = self.group_shape(t, s)
        f = self.moe_ffn_dim
        moe = (2 * t * h * self.n_routed_experts
               + 6 * self.n_routed_experts * g * self.capacity(gs) * h * f
               + 6 * t * h * f * self.n_shared_experts)
        return float(self.n_layers * attn + self.n_dense_layers * dense
                     + self.n_moe_layers * moe + 2 * t * h * self.vocab_size)


# --------------------------------------------------------------------- routing

class Routing(NamedTuple):
    """Where the assignments of one batch of groups go (G groups of S tokens,
    E experts of C slots, k choices; assignment ``j S + s`` is token s's j-th choice).

    Attributes:
        slot_token: int64 [G, E*C], the token (index in its group) each expert slot
            takes; 0 for an empty slot (computed, never read back).
        assignment_slot: int64 [G, k*S], the slot ``e C + position`` of each
            assignment; 0 where dropped.
        assignment_weight: float32 [G, k*S], the routing weight of each assignment;
            0 where dropped.
    """

    slot_token: torch.Tensor
    assignment_slot: torch.Tensor
    assignment_weight: torch.Tensor


def topk_sigmoid(logits: torch.Tensor, top_k: int,
                 scaling: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's router without group limits or balancing bias.

    Args:
        logits: router logits [..., E].
        top_k: experts per token (k).
        scaling: factor on the normalised weights (``routed_scaling_factor``).

    Returns:
        weights: float32 [..., k], ``sigmoid`` affinities of the chosen experts
            normalised to sum to ``scaling``;
        experts: int64 [..., k], the chosen experts, largest affinity first.
    """
    scores = torch.sigmoid(logits.float())
    top_w, top_i = scores.topk(top_k, dim=-1)
    return top_w / top_w.sum(dim=-1, keepdim=True) * scaling, top_i


def expert_positions(experts: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Position of each assignment among those of its expert, in assignment order.

    Args:
        experts: int64 [G, N], the expert of each of a group's N assignments.
        n_experts: E.

    Returns:
        int64 [G, N]: ``positions[g, i]`` is the number of assignments ``j < i`` of
        group g with ``experts[g, j] == experts[g, i]``.

    A stable sort by expert lines each expert's assignments up in order; an
    assignment's rank in the sorted order less the start of its expert's run
    (exclusive cumulative counts) is its position. ``O(N log N + E)`` per group
    and static shapes, unlike a ``[G, N, E]`` one-hot cumulative sum.
    """
    G, N = experts.shape
    order = torch.argsort(experts, dim=1, stable=True)                     # [G, N]
    ones = torch.ones(G, N, dtype=torch.long, device=experts.device)
    counts = torch.zeros(G, n_experts, dtype=torch.long, device=experts.device)
    counts = counts.scatter_add(1, experts, ones)                           # [G, E]
    starts = counts.cumsum(dim=1) - counts
    ranks = torch.arange(N, device=experts.device).expand(G, N)
    sorted_positions = ranks - starts.gather(1, experts.gather(1, order))
    return torch.zeros_like(experts).scatter(1, order, sorted_positions)


def route(logits: torch.Tensor, top_k: int, capacity: int, scaling: float = 1.0) -> Routing:
    """Token-choice top-k routing with ``capacity`` slots per expert and group.

    Args:
        logits: router logits [G, S, E].
        top_k: experts per token (k).
        capacity: C, the most assignments one expert takes per group; an
            expert takes first choices before second choices, each in token order.
        scaling: factor on the normalised weights.

    Returns:
        the :class:`Routing`. Nothing is dropped when ``capacity >= S``.
    """
    G, S, E = logits.shape
    weights, experts = topk_sigmoid(logits, top_k, scaling)                 # [G, S, k]
    experts = experts.transpose(1, 2).reshape(G, top_k * S)                 # choice-major
    weights = weights.transpose(1, 2).reshape(G, top_k * S)
    positions = expert_positions(experts, E)
    kept = positions < capacity
    slots = experts * capacity + positions
    trash = E * capacity                        # one extra slot that dropped ones write to
    token = torch.arange(S, device=logits.device).repeat(top_k).expand(G, top_k * S)
    slot_token = torch.zeros(G, E * capacity + 1, dtype=torch.long, device=logits.device)
    slot_token = slot_token.scatter(1, torch.where(kept, slots, trash), token)
    return Routing(slot_token[:, :trash], torch.where(kept, slots, 0),
                   weights * kept.to(weights.dtype))


def dispatch(x: torch.Tensor, slot_token: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Gather tokens [G, S, h] into the expert buffer [E, G*C, h] (expert-major)."""
    G, _, h = x.shape
    slots = slot_token.shape[1]
    gathered = x.gather(1, slot_token.unsqueeze(-1).expand(G, slots, h))   # [G, E*C, h]
    c = slots // n_experts
    return gathered.view(G, n_experts, c, h).transpose(0, 1).reshape(n_experts, G * c, h)


def combine(expert_out: torch.Tensor, routing: Routing, group_shape: tuple[int, int],
            top_k: int) -> torch.Tensor:
    """Sum each token's ``k`` expert results [E, G*C, h] with their weights: [G, S, h]."""
    G, S = group_shape
    E, _, h = expert_out.shape
    by_group = expert_out.view(E, G, -1, h).transpose(0, 1).reshape(G, -1, h)  # [G, E*C, h]
    index = routing.assignment_slot.unsqueeze(-1).expand(G, top_k * S, h)
    picked = by_group.gather(1, index).view(G, top_k, S, h)
    weight = routing.assignment_weight.to(expert_out.dtype).view(G, top_k, S, 1)
    return (picked * weight).sum(dim=1)


# --------------------------------------------------------------------- modules

class MLA(nn.Module):
    """Multi-head latent attention, causal. [B, T, h] -> [B, T, h].

    ``q = wq_b(q_norm(wq_a x))`` gives per head a no-rope part (dn) and a rope part
    (dr); ``wkv_a x`` gives the latent (c) and one rope key (dr) shared by all heads;
    ``wkv_b(kv_norm(latent))`` gives per head the no-rope key (dn) and the value (dv).
    Scores are scaled by ``1 / sqrt(dn + dr)``.
    """

    def __init__(self, config: DeepSeekConfig) -> None:
        super().__init__()
        self.config = config
        c, a = config, config.n_heads
        self.wq_a = nn.Linear(c.dim, c.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(c.q_lora_rank, c.norm_eps)
        self.wq_b = nn.Linear(c.q_lora_rank, a * c.qk_head_dim, bias=False)
        self.wkv_a = nn.Linear(c.dim, c.kv_lora_rank + c.qk_rope_head_dim, bias=False)
        self.kv_norm = RMSNorm(c.kv_lora_rank, c.norm_eps)
        self.wkv_b = nn.Linear(c.kv_lora_rank, a * (c.qk_nope_head_dim + c.v_head_dim),
                               bias=False)
        self.wo = nn.Linear(a * c.v_head_dim, c.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        c, a = self.config, self.config.n_heads
        dn, dr, dv = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        cos, sin = rope_cos_sin(T, dr, c.rope_theta, device=x.device, dtype=x.dtype)
        q = self.wq_b(self.q_norm(self.wq_a(x))).view(B, T, a, dn + dr)
        q_nope, q_rope = q.split([dn, dr], dim=-1)
        latent, k_rope = self.wkv_a(x).split([c.kv_lora_rank, dr], dim=-1)
        k_rope = apply_rope(k_rope.view(B, T, 1, dr), cos, sin).expand(B, T, a, dr)
        kv = self.wkv_b(self.kv_norm(latent)).view(B, T, a, dn + dv)
        k_nope, v = kv.split([dn, dv], dim=-1)
        q = torch.cat([q_nope, apply_rope(q_rope, cos, sin)], dim=-1).transpose(1, 2)
        k = torch.cat([k_nope, k_rope], dim=-1).transpose(1, 2)
        v = v.transpose(1, 2)
        if c.pad_value_heads:  # zeros up to dn + dr: a kernel of equal head sizes
            v = F.pad(v, (0, dn + dr - dv))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)[..., :dv]
        return self.wo(y.transpose(1, 2).contiguous().view(B, T, a * dv))


class SwiGLU(nn.Module):
    """``w2(silu(w1 x) * w3 x)``; w1, w3 Linear(dim, hidden), w2 Linear(hidden, dim)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoE(nn.Module):
    """Routed SwiGLU experts plus shared experts. [B, T, h] -> [B, T, h].

    Router ``gate`` Linear(h, E); the routed experts as batched weights
    ``w1``, ``w3`` [E, h, f] and ``w2`` [E, f, h] (expert parallelism shards dim 0);
    ``shared_experts`` one SwiGLU of inner size ``n_shared * f`` (absent when 0).
    """

    def __init__(self, config: DeepSeekConfig) -> None:
        super().__init__()
        self.config = config
        h, e, f = config.dim, config.n_routed_experts, config.moe_ffn_dim
        self.gate = nn.Linear(h, e, bias=False)
        self.w1, self.w2, self.w3 = expert_weights(e, (h, f), (f, h), (h, f))
        self.shared_experts = (SwiGLU(h, f * config.n_shared_experts)
                               if config.n_shared_experts else None)

    def experts(self, tokens: torch.Tensor) -> torch.Tensor:
        """Every expert on its own tokens: [E, N, h] -> [E, N, h]."""
        hidden = F.silu(torch.bmm(tokens, self.w1)) * torch.bmm(tokens, self.w3)
        return torch.bmm(hidden, self.w2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, h = x.shape
        c = self.config
        G, S = c.group_shape(B * T, T)
        xg = x.reshape(G, S, h)
        routing = route(self.gate(xg), c.top_k, c.capacity(S), c.routed_scaling_factor)
        expert_out = self.experts(dispatch(xg, routing.slot_token, c.n_routed_experts))
        y = combine(expert_out, routing, (G, S), c.top_k).reshape(B, T, h)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y


class Block(nn.Module):
    """Pre-RMSNorm block: ``x + attention(attention_norm(x))`` then
    ``x + feed_forward(ffn_norm(x))``; the feed-forward is :class:`MoE` or a dense
    :class:`SwiGLU`."""

    def __init__(self, config: DeepSeekConfig, moe: bool) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = MLA(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = MoE(config) if moe else SwiGLU(config.dim, config.ffn_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class DeepSeek(nn.Module):
    """DeepSeek-V3 language model; ``forward(idx, targets)`` returns the mean
    cross-entropy loss.

    Args of forward:
        idx: token ids, int64 [batch, seq] in [0, vocab_size), seq <= max_seq_len.
        targets: int64 [batch, seq]; when ``None`` the logits [batch, seq, V] are returned.
    """

    def __init__(self, config: DeepSeekConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.dense_layers = nn.ModuleList(
            [Block(config, moe=False) for _ in range(config.n_dense_layers)])
        self.moe_layers = nn.ModuleList(
            [Block(config, moe=True) for _ in range(config.n_moe_layers)])
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """N(0, init_std) for every weight (the report's 0.006), ones for the norms.

        Covers every parameter, so a model built on meta is materialised with
        ``model.to_empty(device=...)`` followed by ``model.init_weights()``.
        """
        std = self.config.init_std
        for module in self.modules():
            if isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)
            elif isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=std)
            elif isinstance(module, MoE):
                for w in (module.w1, module.w2, module.w3):
                    nn.init.normal_(w, mean=0.0, std=std)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        x = self.tok_embeddings(idx)
        for layer in (*self.dense_layers, *self.moe_layers):
            x = layer(x)
        return next_token_loss(self.output(self.norm(x)), targets)
