"""Models sized for step-time checks on CPU ranks: a step is hundreds of
milliseconds of compute, well above the runtime's per-step overhead, and still
small enough that a one-process reference runs in seconds.

Factories for ``--model benchmarks/step_models.py:NAME`` (``planner plan``,
``benchmarks.measured``); each takes the example step's ``batch_size`` and
``seq_len`` (tokens) as keyword arguments.
"""

from __future__ import annotations

import torch

from models.zoo import GPTConfig, LlamaConfig, build_from_config

#: GPT blocks: 4 layers of hidden 256, 8 heads; 2,048-token vocabulary.
GPT_SMALL = GPTConfig(n_layer=4, n_embd=256, n_head=8, vocab_size=2048, block_size=128)
#: Llama blocks: 4 layers of hidden 256, 8 query and 4 K/V heads, SwiGLU of 704.
LLAMA_SMALL = LlamaConfig(n_layers=4, dim=256, n_heads=8, n_kv_heads=4, ffn_dim=704,
                          vocab_size=2048, max_seq_len=128, rope_theta=10000.0)


def gpt_small(batch_size: int = 8, seq_len: int = 128) -> tuple[torch.nn.Module, tuple]:
    """GPT_SMALL with a step of ``batch_size`` sequences of ``seq_len`` tokens."""
    return build_from_config(GPT_SMALL, device=torch.get_default_device(),
                             batch_size=batch_size, seq_len=seq_len)


def llama_small(batch_size: int = 8, seq_len: int = 128) -> tuple[torch.nn.Module, tuple]:
    """LLAMA_SMALL with a step of ``batch_size`` sequences of ``seq_len`` tokens."""
    return build_from_config(LLAMA_SMALL, device=torch.get_default_device(),
                             batch_size=batch_size, seq_len=seq_len)
