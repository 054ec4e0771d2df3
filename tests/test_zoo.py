"""The model zoo: shapes, parameter counts, FLOPs, determinism, MoE routing, RoPE."""

from __future__ import annotations

import math

import pytest
import torch

import ir
from models import zoo
from models.zoo.gpt import GPT, Block, GPTConfig
from models.zoo.llama import Attention, LlamaConfig, apply_rope, rope_cos_sin
from models.zoo.moe import MoEConfig, MoELayer, top2_combine_weights, top2_dispatch


def _numel(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


# --------------------------------------------------------------------- registry

REQUIRED = [
    "gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl", "gpt3-350m", "gpt3-1.3b", "gpt3-2.7b",
    "gpt3-6.7b", "gpt3-13b", "gpt3-39b", "gpt3-175b", "llama3-8b", "llama3-70b", "moe-8x",
    "gpt-tiny", "llama-tiny", "moe-tiny", "mlp-tiny", "mlp",
]


def test_names_sorted_and_complete():
    names = zoo.names()
    assert names == sorted(names)
    assert set(REQUIRED) <= set(names)


def test_unknown_name_lists_available_models():
    with pytest.raises(zoo.UnknownModelError) as info:
        zoo.build("gpt5-turbo")
    assert isinstance(info.value, ValueError)
    msg = str(info.value)
    assert "gpt5-turbo" in msg
    for name in zoo.names():
        assert name in msg
    with pytest.raises(zoo.UnknownModelError):
        zoo.config("nope")


@pytest.mark.parametrize("name", REQUIRED)
def test_every_model_builds_on_meta(name):
    model, inputs = zoo.build(name)
    assert all(p.is_meta for p in model.parameters())
    assert all(t.is_meta for t in inputs)
    assert _numel(model) == zoo.config(name).num_params()
    if zoo.describe(name)["seq_len"] is not None:
        b, s = zoo.describe(name)["batch_size"], zoo.describe(name)["seq_len"]
        assert [tuple(t.shape) for t in inputs] == [(b, s), (b, s)]
        assert all(t.dtype == torch.int64 for t in inputs)


def test_published_configs():
    c = zoo.config("gpt3-175b")
    assert (c.n_layer, c.n_embd, c.n_head, c.block_size, c.vocab_size) == (96, 12288, 96, 2048, 50257)
    assert (zoo.config("gpt3-39b").n_layer, zoo.config("gpt3-39b").n_embd) == (48, 8192)
    c = zoo.config("gpt2")
    assert (c.n_layer, c.n_embd, c.n_head, c.block_size, c.vocab_size) == (12, 768, 12, 1024, 50257)
    c = zoo.config("llama3-8b")
    assert (c.n_layers, c.dim, c.n_heads, c.n_kv_heads, c.ffn_dim, c.vocab_size, c.max_seq_len) == (
        32, 4096, 32, 8, 14336, 128256, 131072)
    assert zoo.describe("llama3-8b")["seq_len"] == 2048
    assert round(zoo.config("llama3-8b").num_params() / 1e9, 2) == 8.03
    assert round(zoo.config("llama3-70b").num_params() / 1e9, 1) == 70.6
    assert round(zoo.config("gpt3-175b").num_params() / 1e9) == 175
    c = zoo.config("llama3-405b")
    assert (c.n_layers, c.dim, c.n_heads, c.n_kv_heads, c.ffn_dim, c.vocab_size) == (
        126, 16384, 128, 8, 53248, 128256)
    assert round(c.num_params() / 1e9) == 406  # Meta's "405B" (405.9e9 with the head)


def test_llama3_takes_llama31_context_on_meta():
    """Every zoo Llama 3 accepts 131,072 tokens (Llama 3.1's context), not one more;
    building the 405B at that length on meta allocates nothing and is quick."""
    import time
    for name in ("llama3-8b", "llama3-70b", "llama3-405b"):
        assert zoo.config(name).max_seq_len == 131072
        assert zoo.config(name).rope_scaling is not None
    t0 = time.perf_counter()
    model, (idx, targets) = zoo.build("llama3-405b", batch_size=1, seq_len=131072)
    assert idx.shape == (1, 131072) and idx.device.type == "meta"
    assert time.perf_counter() - t0 < 30
    with pytest.raises(zoo.ExampleStepError):
        zoo.build("llama3-8b", seq_len=131073)


def test_llama31_rope_scaling_matches_the_reference_bands():
    """Llama 3.1's scaling keeps the short wavelengths, divides the long ones by
    the factor (8) and interpolates between (Meta's reference ``apply_scaling``)."""
    import math
    from models.zoo.llama import LLAMA31_ROPE_SCALING as s
    inv = 1.0 / (500000.0 ** (torch.arange(0, 128, 2, dtype=torch.float32) / 128))
    out = s.apply(inv)
    wavelen = 2 * math.pi / inv
    short, long_ = wavelen < 8192 / 4, wavelen > 8192
    assert torch.equal(out[short], inv[short])
    assert torch.allclose(out[long_], inv[long_] / 8)
    mid = ~short & ~long_
    assert mid.any() and bool(((out[mid] <= inv[mid]) & (out[mid] >= inv[mid] / 8)).all())


def test_batch_seq_and_dtype_overrides():
    model, (idx, tgt) = zoo.build("gpt2", batch_size=2, seq_len=128, dtype=torch.bfloat16)
    assert idx.shape == tgt.shape == (2, 128)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    with pytest.raises(ValueError):
        zoo.build("gpt2", seq_len=4096)
    model, (x, y) = zoo.build("mlp-tiny", batch_size=5, dtype=torch.float64)
    assert x.shape == (5, 32) and x.dtype == torch.float64 and y.dtype == torch.int64


# ------------------------------------------------------------- parameter counts

@pytest.mark.parametrize("h,a", [(768, 12), (12288, 96)])
def test_gpt_block_params_exact(h, a):
    with torch.device("meta"):
        block = Block(GPTConfig(n_layer=1, n_embd=h, n_head=a))
    assert _numel(block) == 12 * h * h + 13 * h


@pytest.mark.parametrize("name", ["gpt-tiny", "gpt2", "gpt3-175b"])
def test_gpt_total_params_formula(name):
    c = zoo.config(name)
    l, h, v, s = c.n_layer, c.n_embd, c.vocab_size, c.block_size
    model, _ = zoo.build(name)
    assert _numel(model) == l * (12 * h * h + 13 * h) + v * h + s * h + 2 * h + v * h


# --------------------------------------------------------- CPU forward/backward

@pytest.mark.parametrize("name", zoo.TINY)
def test_tiny_forward_backward_cpu(name):
    model, inputs = zoo.build(name, device="cpu")
    loss = model(*inputs)
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert sum(g.abs().sum().item() for g in grads) > 0


def test_mlp_mse():
    cfg = zoo.MLPConfig(d_in=8, d_hidden=16, d_out=3, n_layers=2, loss="mse")
    model, (x, y) = zoo.build_from_config(cfg, device="cpu", batch_size=4)
    assert y.shape == (4, 3) and y.is_floating_point()
    model(x, y).backward()


def test_build_is_deterministic_and_keeps_caller_rng():
    state = torch.random.get_rng_state()
    m1, in1 = zoo.build("llama-tiny", device="cpu")
    m2, in2 = zoo.build("llama-tiny", device="cpu")
    assert torch.equal(torch.random.get_rng_state(), state)
    for (n1, p1), (n2, p2) in zip(m1.named_parameters(), m2.named_parameters()):
        assert n1 == n2 and torch.equal(p1, p2)
    assert all(torch.equal(a, b) for a, b in zip(in1, in2))


def test_meta_model_materialises_with_init_weights():
    model, _ = zoo.build("gpt-tiny")
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    _, inputs = zoo.build("gpt-tiny", device="cpu")
    assert torch.isfinite(model(*inputs))


# ----------------------------------------------------------------- export, FLOPs

@pytest.mark.parametrize("name", ["llama-tiny", "moe-tiny", "mlp-tiny"])
def test_tiny_exports_on_meta(name):
    g = ir.trace(*zoo.build(name))  # torch.export(strict=False) + run_decompositions
    assert g.num_parameters == zoo.config(name).num_params()
    assert g.forward_flops > 0
    cfg, d = zoo.config(name), zoo.describe(name)
    if name == "mlp-tiny":
        assert g.forward_flops == cfg.forward_flops(d["batch_size"])
    else:  # matmul FLOPs as captured equal the closed-form count, less the half of
        # the attention scores the fused causal kernel skips (2bs^2h a layer)
        b, s = d["batch_size"], d["seq_len"]
        layers = getattr(cfg, "n_layers", None) or cfg.n_layer
        skipped = layers * 2 * b * s * s * (getattr(cfg, "dim", None) or cfg.n_embd)
        assert g.forward_flops == cfg.forward_flops(b, s) - skipped


def test_gpt_forward_flops_match_formula():
    l, h, a, v, s, b = 2, 256, 4, 1000, 128, 2
    cfg = GPTConfig(n_layer=l, n_embd=h, n_head=a, vocab_size=v, block_size=s)
    model, inputs = zoo.build_from_config(cfg, batch_size=b, seq_len=s)
    g = ir.trace(model, inputs)
    expected = l * (24 * b * s * h * h + 4 * b * s * s * h) + 2 * b * s * h * v
    assert expected == cfg.forward_flops(b, s)
    # the fused causal attention kernel skips half the score products (2bs^2h a layer)
    ratio = g.forward_flops / (expected - l * 2 * b * s * s * h)
    assert abs(ratio - 1) < 0.01, ratio
    assert g.num_parameters == cfg.num_params()


# ----------------------------------------------------------------------- MoE

def test_top2_router_selects_two_experts_per_token():
    torch.manual_seed(1)
    logits = torch.randn(3, 50, 8)
    w = top2_combine_weights(logits)
    assert ((w != 0).sum(-1) == 2).all()
    torch.testing.assert_close(w.sum(-1), torch.ones(3, 50))
    top2 = logits.topk(2, dim=-1).indices
    assert torch.equal(w.topk(2, dim=-1).indices.sort(-1).values, top2.sort(-1).values)


def test_top2_dispatch_without_drops_equals_dense_weights():
    torch.manual_seed(2)
    logits = torch.randn(2, 16, 4)
    combine, dispatch, _ = top2_dispatch(logits, capacity=16)
    torch.testing.assert_close(combine.sum(-1), top2_combine_weights(logits))
    assert ((dispatch.sum(dim=(-1, -2))) == 2).all()           # 2 experts per token
    assert (dispatch.sum(dim=1) <= 1).all()                     # one token per slot


def test_top2_dispatch_respects_capacity():
    torch.manual_seed(3)
    logits = torch.randn(2, 32, 4)
    logits[..., 0] += 5.0                                       # overload expert 0
    combine, dispatch, _ = top2_dispatch(logits, capacity=5)
    assert (dispatch.sum(dim=(1, 3)) <= 5).all()                # per group, per expert
    assert (dispatch.sum(dim=1) <= 1).all()
    assert (dispatch.sum(dim=(-1, -2)) <= 2).all()
    assert ((combine != 0) == (dispatch != 0)).all()


def test_moe_layer_equals_reference_top2():
    cfg = MoEConfig(n_layer=1, n_embd=16, n_head=2, n_expert=4, expert_hidden=24,
                    vocab_size=32, block_size=8, capacity_factor=2.0, group_size=8)
    torch.manual_seed(4)
    layer = MoELayer(cfg)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(3, 8, 16)
    y = layer(x)
    w = top2_combine_weights(layer.router(x))                   # [B, T, E]
    ref = torch.zeros_like(x)
    for e in range(cfg.n_expert):
        out_e = layer.gelu(x @ layer.w_in[e]) @ layer.w_out[e]
        ref += w[..., e:e + 1] * out_e
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------- RoPE, GQA

def test_rope_is_a_real_rotation():
    torch.manual_seed(5)
    T, H, d = 12, 3, 16
    cos, sin = rope_cos_sin(T, d, theta=10000.0)
    q = torch.randn(2, T, H, d)
    rq = apply_rope(q, cos, sin)
    torch.testing.assert_close(rq.norm(dim=-1), q.norm(dim=-1))          # norm preserving
    torch.testing.assert_close(rq[:, 0], q[:, 0])                        # position 0: identity
    assert not torch.allclose(rq[:, 1:], q[:, 1:])
    # <R_m q, R_n k> depends only on m - n.
    v, k = torch.randn(d), torch.randn(d)
    vs = apply_rope(v.expand(1, T, 1, d), cos, sin)[0, :, 0]
    ks = apply_rope(k.expand(1, T, 1, d), cos, sin)[0, :, 0]
    torch.testing.assert_close(vs[7] @ ks[4], vs[3] @ ks[0])
    torch.testing.assert_close(vs[9] @ ks[2], vs[11] @ ks[4])


def test_gqa_equals_mha_with_repeated_kv_heads():
    gqa_cfg = LlamaConfig(n_layers=1, dim=32, n_heads=4, n_kv_heads=2, ffn_dim=64,
                          vocab_size=16, max_seq_len=8, rope_theta=10000.0)
    mha_cfg = LlamaConfig(n_layers=1, dim=32, n_heads=4, n_kv_heads=4, ffn_dim=64,
                          vocab_size=16, max_seq_len=8, rope_theta=10000.0)
    torch.manual_seed(6)
    gqa, mha = Attention(gqa_cfg), Attention(mha_cfg)
    d, rep = gqa_cfg.head_dim, 2
    with torch.no_grad():
        mha.wq.weight.copy_(gqa.wq.weight)
        mha.wo.weight.copy_(gqa.wo.weight)
        for name in ("wk", "wv"):
            w = getattr(gqa, name).weight.view(2, d, 32).repeat_interleave(rep, dim=0)
            getattr(mha, name).weight.copy_(w.reshape(4 * d, 32))
    x = torch.randn(2, 8, 32)
    torch.testing.assert_close(gqa(x), mha(x))
    assert _numel(gqa) < _numel(mha)


def test_rmsnorm_formula():
    from models.zoo.llama import RMSNorm
    norm = RMSNorm(8, eps=1e-6)
    x = torch.randn(3, 8)
    torch.testing.assert_close(norm(x), x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6))


def test_gpt_logits_when_no_targets():
    model, (idx, _) = zoo.build("gpt-tiny", device="cpu", batch_size=2, seq_len=5)
    assert model(idx).shape == (2, 5, 128)
    assert isinstance(model, GPT)
    assert math.isclose(GPTConfig(2, 64, 4).forward_flops(1, 1),
                        2 * (24 * 64 * 64 + 4 * 64) + 2 * 64 * 50257)
