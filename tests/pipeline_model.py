"""A GPT deep enough to pipeline over 4 ranks with 2 stages each (test fixture).

``tests/pipeline_model.py:gpt8`` is gpt-tiny's shape with 8 blocks: 8 sequences
of 32 tokens, vocabulary 128, hidden 64, 4 heads.
"""

import torch

from models.zoo import gpt
from models.zoo.tokens import token_inputs


def gpt8():
    """(model, (idx, targets)) built on the current default device."""
    cfg = gpt.GPTConfig(n_layer=8, n_embd=64, n_head=4, vocab_size=128, block_size=32)
    device = torch.get_default_device()
    return gpt.GPT(cfg), token_inputs(cfg, 8, 32, device=device)


def gpt_wide():
    """(model, (idx, targets)): 2 blocks of gpt2's width (hidden 768, 12 heads of
    64), vocabulary 128, 4 sequences of 64 tokens, built on the current default
    device. On 4 ranks its heads split 3 per rank, and the CPU attention kernel
    hands back gradients laid out otherwise than gpt-tiny's."""
    cfg = gpt.GPTConfig(n_layer=2, n_embd=768, n_head=12, vocab_size=128, block_size=64)
    device = torch.get_default_device()
    return gpt.GPT(cfg), token_inputs(cfg, 4, 64, device=device)
