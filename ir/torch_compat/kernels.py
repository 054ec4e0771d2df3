"""The aten ops of the fused attention kernels that return the log-sum-exp,
which context parallelism calls block by block (private torch APIs; part of
:mod:`ir.torch_compat`)."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["cpu_flash_attention_ops", "cuda_attention_ops", "fused_sdp_choice"]


def cpu_flash_attention_ops() -> tuple[Any, Any]:
    """The CPU flash-attention kernel ``F.scaled_dot_product_attention`` runs on
    CPU tensors, and its backward."""
    aten = torch.ops.aten
    return (aten._scaled_dot_product_flash_attention_for_cpu.default,
            aten._scaled_dot_product_flash_attention_for_cpu_backward.default)


def cuda_attention_ops() -> dict[str, tuple[Any, Any]]:
    """The CUDA fused-attention kernels that return the log-sum-exp, each with
    its backward: ``"flash"`` (FlashAttention-2) and ``"efficient"`` (the
    memory-efficient kernel), as their aten schemas read in torch 2.11 to 2.14
    (the calls :mod:`codegen.cp_kernels` makes)."""
    aten = torch.ops.aten
    return {"flash": (aten._scaled_dot_product_flash_attention.default,
                      aten._scaled_dot_product_flash_attention_backward.default),
            "efficient": (aten._scaled_dot_product_efficient_attention.default,
                          aten._scaled_dot_product_efficient_attention_backward.default)}


def fused_sdp_choice(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
                     is_causal: bool, scale: float | None = None) -> int:
    """The kernel ``F.scaled_dot_product_attention`` picks for these tensors, no
    mask and no dropout (``torch._fused_sdp_choice``: 0 is the math path)."""
    return int(torch._fused_sdp_choice(query, key, value, None, 0.0, is_causal, scale=scale))
