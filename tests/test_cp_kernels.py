"""Context parallelism's attention blocks, in one process: which fused kernel a
block runs per device, dtype and head dim (codegen.cp_kernels), the causal
block order of the load-balanced chunks (_block), the log-sum-exp merge
(_merge), and a cp group's blocked attention emulated on the CPU kernel
against whole-sequence attention, forward and backward.

Tolerance (fp32, CPU flash kernel): outputs and gradients within 2e-5
absolute + 1e-4 relative of ``F.scaled_dot_product_attention`` over the
whole sequence; the merge reorders sums only, so errors are a few ulps."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F

import codegen.cp_kernels as cp_kernels
from codegen.context_parallel import _block, _merge, chunk_positions
from codegen.context_parallel import emulated_attention
from codegen.cp_kernels import (CPU_FLASH, CUDA_EFFICIENT, CUDA_FLASH, BlockKernel, block_kernel,
                                choose_kernel, cut_chunks, joined_chunks)
from ir.torch_compat import cpu_flash_attention_ops, cuda_attention_ops

ATOL, RTOL = 2e-5, 1e-4
bf16, fp16, fp32, fp64 = torch.bfloat16, torch.float16, torch.float32, torch.float64
H100, A100, A10, L4, V100, B200 = (9, 0), (8, 0), (8, 6), (8, 9), (7, 0), (10, 0)


@pytest.mark.parametrize("device, dtype, head_dim, capability, value_dim, expected", [
    ("cpu", fp32, 64, None, None, CPU_FLASH),
    ("cpu", bf16, 80, None, None, CPU_FLASH),
    ("cpu", fp64, 7, None, None, CPU_FLASH),
    ("cpu", torch.int64, 64, None, None, None),
    ("cuda", bf16, 128, H100, None, CUDA_FLASH),
    ("cuda", fp16, 64, A100, None, CUDA_FLASH),
    ("cuda", bf16, 256, A10, None, CUDA_FLASH),
    ("cuda", bf16, 224, H100, None, CUDA_FLASH),
    ("cuda", bf16, 224, L4, None, CUDA_EFFICIENT),   # FA2's backward: 193..224 on sm80/sm90 only
    ("cuda", bf16, 200, B200, None, CUDA_EFFICIENT),
    ("cuda", bf16, 288, H100, None, CUDA_EFFICIENT),  # over FA2's 256
    ("cuda", bf16, 100, H100, None, None),            # not a multiple of 8: neither
    ("cuda", bf16, 128, H100, 64, CUDA_EFFICIENT),    # v's head dim differs: flash cannot
    ("cuda", fp32, 128, H100, None, CUDA_EFFICIENT),
    ("cuda", fp32, 36, A100, None, CUDA_EFFICIENT),   # fp32: multiples of 4
    ("cuda", fp32, 34, A100, None, None),
    ("cuda", fp16, 64, V100, None, CUDA_EFFICIENT),   # no flash before sm80
    ("cuda", bf16, 64, V100, None, None),             # nor bf16 at all
    ("cuda", fp64, 64, H100, None, None),
    ("cuda", bf16, 64, None, None, None),             # capability unknown
    ("mps", fp32, 64, None, None, None),
])
def test_kernel_choice(device, dtype, head_dim, capability, value_dim, expected):
    assert choose_kernel(device, dtype, head_dim, capability, value_dim) == expected


def test_block_kernel_on_cpu_and_its_refusal():
    q = torch.zeros(1, 2, 8, 16)
    assert block_kernel(q, q) == BlockKernel(CPU_FLASH)
    with pytest.raises(ValueError, match="no fused attention kernel .* on cpu"):
        block_kernel(q.long(), q.long())


@pytest.mark.parametrize("cp", [2, 4])
def test_causal_blocks_cover_each_earlier_key_once(cp):
    """Over the blocks of every source rank, each of a rank's queries meets
    exactly the keys at or before its position, each once."""
    tokens = 4 * cp  # per rank: two chunks of two tokens
    half = tokens // 2
    positions = [chunk_positions(tokens, cp, c) for c in range(cp)]
    whole = 2 * cp * half
    for index in range(cp):
        seen = torch.zeros(tokens, whole, dtype=torch.int64)
        for source in range(cp):
            rows, keys, causal = _block(index, source, half)
            q_pos, k_pos = positions[index][rows], positions[source][keys]
            pairs = torch.ones(len(q_pos), len(k_pos), dtype=torch.int64)
            if causal:
                assert source == index
                pairs = pairs.tril()  # local order is positional order within a rank
            seen[torch.arange(tokens)[rows][:, None], k_pos[None, :]] += pairs
        q_all = positions[index]
        expected = (torch.arange(whole)[None, :] <= q_all[:, None]).long()
        assert torch.equal(seen, expected), (index, seen)


def test_chunks_round_trip():
    t = torch.arange(2 * 3 * 16).reshape(2, 3, 16, 1)
    parts = cut_chunks(t, 4)
    assert [p[0, 0, :, 0].tolist() for p in parts][1] == [2, 3, 12, 13]
    assert torch.equal(joined_chunks(parts), t)


def test_merge_of_key_blocks_is_whole_attention():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 12, 8) for _ in range(3))
    forward, _ = cpu_flash_attention_ops()
    whole, whole_lse = forward(q, k, v, 0.0, False)
    out = torch.zeros(2, 3, 12, 8)
    lse = torch.full((2, 3, 12), float("-inf"))
    for keys in (slice(0, 5), slice(5, 9), slice(9, 12)):
        block_out, block_lse = forward(q, k[:, :, keys], v[:, :, keys], 0.0, False)
        _merge(out, lse, block_out, block_lse)
    torch.testing.assert_close(out, whole, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(lse, whole_lse, atol=ATOL, rtol=RTOL)


def _reference(q, k, v, scale=None):
    repeats = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(repeats, dim=1) for t in (k, v))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)


@pytest.mark.parametrize("cp, kv_heads, scale", [(1, 4, None), (2, 4, None), (4, 4, 0.3),
                                                 (2, 2, None), (4, 1, None)])
def test_emulated_cp_matches_whole_sequence_attention(cp, kv_heads, scale):
    torch.manual_seed(cp * 10 + kv_heads)
    q = torch.randn(2, 4, 32, 16, requires_grad=True)
    k, v = (torch.randn(2, kv_heads, 32, 16, requires_grad=True) for _ in range(2))
    grad = torch.randn(2, 4, 32, 16)
    out = emulated_attention(q, k, v, cp, scale)
    got = (out, *torch.autograd.grad(out, (q, k, v), grad))
    ref = _reference(q, k, v, scale)
    want = (ref, *torch.autograd.grad(ref, (q, k, v), grad))
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL, msg=lambda m: f"{name}: {m}")


def test_emulation_would_catch_a_wrong_block_order(monkeypatch):
    """The emulation reads _block: swapping which rank's block a rank sees
    whole breaks the match (so the test above can fail)."""
    import codegen.context_parallel as context_parallel

    def wrong(index, source, half):
        rows, keys, causal = _block(index, source, half)
        return (keys, rows, causal) if not causal else (rows, keys, causal)
    monkeypatch.setattr(context_parallel, "_block", wrong)
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, 2, 16, 8) for _ in range(3))
    assert not torch.allclose(emulated_attention(q, k, v, 2), _reference(q, k, v), atol=1e-3)


# ---- the CUDA kernels' calls, against fakes of their aten schemas on CPU tensors
def _fake_cuda_ops(calls):
    cpu_forward, cpu_backward = cpu_flash_attention_ops()

    def flash(query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *,
              scale=None):
        assert dropout_p == 0.0 and return_debug_mask is False and isinstance(is_causal, bool)
        out, lse = cpu_forward(query, key, value, 0.0, is_causal, scale=scale)
        empty = torch.empty(0)
        return (out, lse, None, None, query.shape[2], key.shape[2], torch.tensor(7),
                torch.tensor(8), empty)

    def flash_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k,
                       max_q, max_k, dropout_p, is_causal, philox_seed, philox_offset, *,
                       scale=None):
        assert (cum_seq_q, cum_seq_k, max_q, max_k) == (None, None, query.shape[2], key.shape[2])
        assert (int(philox_seed), int(philox_offset)) == (7, 8) and logsumexp.is_contiguous()
        calls.append("flash_backward")
        return cpu_backward(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal,
                            scale=scale)

    def efficient(query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0,
                  is_causal=False, *, scale=None):
        assert attn_bias is None and compute_log_sumexp is True and dropout_p == 0.0
        out, lse = cpu_forward(query, key, value, 0.0, is_causal, scale=scale)
        padded = torch.full((*lse.shape[:2], -(-lse.shape[2] // 32) * 32), 1e9)
        padded[..., :lse.shape[2]] = lse  # CUDA's: padded along the queries
        return out, padded, torch.tensor(5), torch.tensor(6)

    def efficient_backward(grad_out_, query, key, value, attn_bias, out, logsumexp,
                           philox_seed, philox_offset, dropout_p, grad_input_mask,
                           is_causal=False, *, scale=None):
        assert attn_bias is None and list(grad_input_mask) == [True, True, True, False]
        assert logsumexp.shape[2] % 32 == 0 and (int(philox_seed), int(philox_offset)) == (5, 6)
        calls.append("efficient_backward")
        grads = cpu_backward(grad_out_, query, key, value, out,
                             logsumexp[..., :query.shape[2]], dropout_p, is_causal, scale=scale)
        return (*grads, None)

    return {"flash": (flash, flash_backward), "efficient": (efficient, efficient_backward)}


def test_cuda_fakes_follow_the_aten_schemas():
    fakes = _fake_cuda_ops([])
    for kind, ops in cuda_attention_ops().items():
        for op, fake in zip(ops, fakes[kind]):
            names = [a.name for a in op._schema.arguments]
            assert list(inspect.signature(fake).parameters) == names, (op, names)


@pytest.mark.parametrize("name", [CUDA_FLASH, CUDA_EFFICIENT])
@pytest.mark.parametrize("queries, causal", [(12, True), (40, False)])
def test_cuda_kernel_calls_on_cpu_fakes(monkeypatch, name, queries, causal):
    calls = []
    monkeypatch.setattr(cp_kernels, "cuda_attention_ops", lambda: _fake_cuda_ops(calls))
    torch.manual_seed(queries)
    q = torch.randn(2, 2, queries, 8)
    k, v = (torch.randn(2, 2, queries if causal else 24, 8) for _ in range(2))
    kernel, cpu = BlockKernel(name), BlockKernel(CPU_FLASH)
    out, lse, saved = kernel.forward(q, k, v, causal, None)
    want_out, want_lse, _ = cpu.forward(q, k, v, causal, None)
    assert lse.shape == (2, 2, queries) and lse.dtype == torch.float32
    torch.testing.assert_close((out, lse), (want_out, want_lse))
    grad = torch.randn_like(out)
    got = kernel.backward(grad, q, k, v, out, lse, causal, None, saved)
    torch.testing.assert_close(tuple(got), tuple(cpu.backward(grad, q, k, v, out, lse, causal,
                                                              None, ())))
    assert calls == [name.split("_")[1] + "_backward"]
