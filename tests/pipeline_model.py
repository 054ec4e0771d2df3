"""A GPT deep enough to pipeline over 4 ranks with 2 stages each (test fixture).

``tests/pipeline_model.py:gpt8`` is gpt-tiny's shape with 8 blocks: 8 sequences
of 32 tokens, vocabulary 128, hidden 64, 4 heads.
"""

import torch

from ir.zoo import gpt


def gpt8():
    """(model, (idx, targets)) built on the current default device."""
    cfg = gpt.GPTConfig(n_layer=8, n_embd=64, n_head=4, vocab_size=128, block_size=32)
    device = torch.get_default_device()
    return gpt.GPT(cfg), gpt.example_inputs(cfg, 8, 32, device=device)
