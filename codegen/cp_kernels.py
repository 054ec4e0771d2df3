"""The fused kernel one block of context-parallel attention runs
(:class:`codegen.context_parallel._BlockedAttention`), on the device its
tensors are on, and a one-process emulation of a cp group's attention.

Ring and all-gathered attention merge the blocks' partial outputs by their
log-sum-exp, so a block needs a kernel that returns it, and its backward,
which takes the merged output and log-sum-exp back:

* CPU: the flash kernel ``F.scaled_dot_product_attention`` runs on CPU
  tensors (any float dtype, any head dim);
* CUDA: FlashAttention-2 (``_scaled_dot_product_flash_attention``) for fp16
  and bf16 on sm80 and later, head dims a multiple of 8 up to 256 (q, k and v
  alike; 193 to 224 only on sm80 and sm90, whose backward has them), else the
  memory-efficient kernel (``_scaled_dot_product_efficient_attention`` with
  ``compute_log_sumexp``; fp32 and fp16, bf16 from sm80; head dims a multiple
  of 4 in fp32, of 8 otherwise), whose log-sum-exp comes padded along the
  queries (to a multiple of 32 on CUDA) and is cut to them here;
* nothing else: :func:`block_kernel` refuses it in one line.

:func:`choose_kernel` is the rule, a pure function of (device type, dtype,
head dims, compute capability), so that it is checked on CPU too. The aten
ops come from :mod:`ir.torch_compat`; called directly (not through
``F.scaled_dot_product_attention``, which pads head dims and picks a backend
itself), each gets contiguous blocks of the dims it supports.
:func:`cut_chunks` and :func:`joined_chunks` lay whole sequences out as a cp
group's load-balanced chunks and back, for
:func:`codegen.context_parallel.emulated_attention`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
import torch
import torch.nn.functional as F

from ir.torch_compat import cpu_flash_attention_ops, cuda_attention_ops

__all__ = ["CPU_FLASH", "CUDA_EFFICIENT", "CUDA_FLASH", "BlockKernel", "block_kernel",
           "choose_kernel", "cut_chunks", "joined_chunks"]

CPU_FLASH, CUDA_FLASH, CUDA_EFFICIENT = "cpu_flash", "cuda_flash", "cuda_efficient"

_HALF = (torch.float16, torch.bfloat16)


def choose_kernel(device_type: str, dtype: torch.dtype, head_dim: int,
                  capability: tuple[int, int] | None = None,
                  value_head_dim: int | None = None) -> str | None:
    """The kernel for a block of attention over ``dtype`` tensors of query/key
    head dim ``head_dim`` (value: ``value_head_dim``, the same if None) on a
    ``device_type`` device of compute ``capability`` (CUDA's ``(major,
    minor)``): :data:`CPU_FLASH`, :data:`CUDA_FLASH`, :data:`CUDA_EFFICIENT`,
    or None where none returns the log-sum-exp."""
    v_dim = head_dim if value_head_dim is None else value_head_dim
    if device_type == "cpu":
        return CPU_FLASH if dtype.is_floating_point and dtype.itemsize >= 2 else None
    if device_type != "cuda" or capability is None:
        return None
    sm80 = tuple(capability) >= (8, 0)
    if (dtype in _HALF and sm80 and head_dim == v_dim and head_dim % 8 == 0
            and 0 < head_dim <= 256
            and not (192 < head_dim <= 224 and tuple(capability) not in ((8, 0), (9, 0)))):
        return CUDA_FLASH
    align = 4 if dtype == torch.float32 else 8
    if ((dtype in (torch.float32, torch.float16) or (dtype == torch.bfloat16 and sm80))
            and head_dim > 0 and v_dim > 0 and head_dim % align == 0 and v_dim % align == 0):
        return CUDA_EFFICIENT
    return None


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _padded_queries(queries: int) -> int:
    """The length of the memory-efficient kernel's log-sum-exp for ``queries``
    queries (torch's meta kernel: a multiple of 32 on CUDA, exact on ROCm)."""
    return queries if torch.version.hip else -(-queries // 32) * 32


@dataclass(frozen=True)
class BlockKernel:
    """One of :func:`choose_kernel`'s kernels and its backward, called the
    same way: ``forward`` gives a block's output, its float32 log-sum-exp
    ``[rows, heads, queries]`` and what its backward needs of the call;
    ``backward`` gives dq, dk, dv from the merged output and log-sum-exp."""

    name: str

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                scale: float | None) -> tuple[torch.Tensor, torch.Tensor, tuple]:
        if self.name == CPU_FLASH:
            out, lse = cpu_flash_attention_ops()[0](q, k, v, 0.0, causal, scale=scale)
            return out, lse, ()
        q, k, v = (t.contiguous() for t in (q, k, v))
        if self.name == CUDA_FLASH:
            out, lse, *rest = cuda_attention_ops()["flash"][0](q, k, v, 0.0, causal, False,
                                                              scale=scale)
            return out, lse.float(), tuple(rest[:6])  # cum_seq_q/k, max_q/k, philox seed/offset
        out, lse, seed, offset = cuda_attention_ops()["efficient"][0](
            q, k, v, None, True, 0.0, causal, scale=scale)
        return out, lse[..., :q.shape[2]].float(), (seed, offset)

    def backward(self, grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, causal: bool,
                 scale: float | None, saved: tuple) -> tuple[torch.Tensor, ...]:
        if self.name == CPU_FLASH:
            return cpu_flash_attention_ops()[1](grad_out, q, k, v, out, lse, 0.0, causal,
                                                scale=scale)
        grad_out, q, k, v, out, lse = (t.contiguous() for t in (grad_out, q, k, v, out, lse))
        if self.name == CUDA_FLASH:
            cum_q, cum_k, max_q, max_k, seed, offset = saved
            return cuda_attention_ops()["flash"][1](grad_out, q, k, v, out, lse, cum_q, cum_k,
                                                    max_q, max_k, 0.0, causal, seed, offset,
                                                    scale=scale)
        seed, offset = saved
        lse = F.pad(lse, (0, _padded_queries(q.shape[2]) - lse.shape[-1]))
        dq, dk, dv, _ = cuda_attention_ops()["efficient"][1](
            grad_out, q, k, v, None, out, lse, seed, offset, 0.0, [True, True, True, False],
            causal, scale=scale)
        return dq, dk, dv


def block_kernel(q: torch.Tensor, v: torch.Tensor) -> BlockKernel:
    """The :class:`BlockKernel` for blocks of queries ``q`` and values ``v``
    (``[rows, heads, tokens, dim]``) on their device.

    Raises:
        ValueError: no kernel there returns the log-sum-exp.
    """
    device = q.device
    capability = _capability(device.index if device.index is not None
                             else torch.cuda.current_device()) if device.type == "cuda" else None
    name = choose_kernel(device.type, q.dtype, q.shape[-1], capability, v.shape[-1])
    if name is None:
        raise ValueError(f"no fused attention kernel returning the log-sum-exp runs {q.dtype} "
                         f"blocks of head dim {q.shape[-1]}/{v.shape[-1]} on {device.type}"
                         f"{f' sm{capability[0]}{capability[1]}' if capability else ''}, "
                         f"which context parallelism needs; plan without it")
    return BlockKernel(name)


def cut_chunks(t: torch.Tensor, cp: int) -> list[torch.Tensor]:
    """``[rows, heads, seq, dim]`` ``t`` as the cp ranks hold it under causal
    load balancing: rank ``c`` chunks ``c`` and ``2 cp - 1 - c`` of ``2 cp``."""
    chunks = t.chunk(2 * cp, dim=2)
    return [torch.cat([chunks[c], chunks[2 * cp - 1 - c]], dim=2) for c in range(cp)]


def joined_chunks(parts: list[torch.Tensor]) -> torch.Tensor:
    """The inverse of :func:`cut_chunks`: the cp ranks' tensors as whole sequences."""
    cp = len(parts)
    halves = [p.chunk(2, dim=2) for p in parts]
    return torch.cat([halves[c][0] for c in range(cp)]
                     + [halves[c][1] for c in reversed(range(cp))], dim=2)
