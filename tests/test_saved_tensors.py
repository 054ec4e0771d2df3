"""Every rule of costmodel.saved_tensors.SAVED against what autograd really keeps
for that op's backward (``torch.autograd.graph.saved_tensors_hooks``), with every
floating input requiring a gradient."""

import pytest
import torch

from costmodel.saved_tensors import SAVED, SavedRule

aten = torch.ops.aten


def _f(*shape, positive=False):
    t = torch.rand(*shape) + 0.5 if positive else torch.randn(*shape)
    return t.requires_grad_()


def _examples():
    """aten overload name -> (callable, tensor arguments in the op's argument order)."""
    a, b = _f(4, 6), _f(4, 6)
    idx = torch.tensor([1, 3, 0, 2])
    cases = {
        "aten.mm.default": (lambda x, y: aten.mm(x, y), [_f(4, 5), _f(5, 3)]),
        "aten.bmm.default": (lambda x, y: aten.bmm(x, y), [_f(2, 4, 5), _f(2, 5, 3)]),
        "aten.addmm.default": (lambda c, x, y: aten.addmm(c, x, y), [_f(3), _f(4, 5), _f(5, 3)]),
        "aten.mul.Tensor": (lambda x, y: aten.mul(x, y), [a, b]),
        "aten.div.Tensor": (lambda x, y: aten.div(x, y), [a, _f(4, 6, positive=True)]),
        "aten.gelu.default": (lambda x: aten.gelu(x), [a]),
        "aten.silu.default": (lambda x: aten.silu(x), [a]),
        "aten.pow.Tensor_Scalar": (lambda x: aten.pow(x, 2), [a]),
        "aten.log.default": (lambda x: aten.log(x), [_f(4, 6, positive=True)]),
        "aten.sin.default": (lambda x: aten.sin(x), [a]),
        "aten.cos.default": (lambda x: aten.cos(x), [a]),
        "aten.relu.default": (lambda x: aten.relu(x), [a]),
        "aten.sigmoid.default": (lambda x: aten.sigmoid(x), [a]),
        "aten.tanh.default": (lambda x: aten.tanh(x), [a]),
        "aten.exp.default": (lambda x: aten.exp(x), [a]),
        "aten.rsqrt.default": (lambda x: aten.rsqrt(x), [_f(4, 6, positive=True)]),
        "aten.sqrt.default": (lambda x: aten.sqrt(x), [_f(4, 6, positive=True)]),
        "aten._softmax.default": (lambda x: aten._softmax(x, -1, False), [a]),
        "aten._log_softmax.default": (lambda x: aten._log_softmax(x, -1, False), [a]),
        "aten.native_layer_norm.default": (
            lambda x, w, c: aten.native_layer_norm(x, [6], w, c, 1e-5), [a, _f(6), _f(6)]),
        "aten.native_dropout.default": (lambda x: aten.native_dropout(x, 0.5, True), [a]),
        "aten.nll_loss_forward.default": (
            lambda x, t: aten.nll_loss_forward(x, t, None, 1, -100), [a, idx]),
        "aten.embedding.default": (lambda w, i: aten.embedding(w, i), [_f(10, 4), idx]),
        "aten.where.self": (lambda c, x, y: aten.where(c, x, y), [a > 0, a, b]),
        "aten.scaled_dot_product_attention.default": (
            lambda q, k, v: aten.scaled_dot_product_attention(q, k, v, is_causal=True),
            [_f(2, 2, 8, 4), _f(2, 2, 8, 4), _f(2, 2, 8, 4)]),
        "aten.add.Tensor": (lambda x, y: aten.add(x, y), [a, b]),
        "aten.sub.Tensor": (lambda x, y: aten.sub(x, y), [a, b]),
        "aten.neg.default": (lambda x: aten.neg(x), [a]),
        "aten.sum.dim_IntList": (lambda x: aten.sum(x, [1]), [a]),
        "aten.mean.dim": (lambda x: aten.mean(x, [1]), [a]),
        "aten.cat.default": (lambda x, y: aten.cat([x, y]), [a, b]),
        "aten.clone.default": (lambda x: aten.clone(x), [a]),
        "aten._to_copy.default": (lambda x: aten._to_copy(x, dtype=torch.bfloat16), [a]),
        "aten.mul.Scalar": (lambda x: aten.mul(x, 2.0), [a]),
    }
    return cases


def _same(t: torch.Tensor, u: torch.Tensor) -> bool:
    return (t.data_ptr() == u.data_ptr() and t.shape == u.shape and t.dtype == u.dtype)


def _saved_by_autograd(fn, args):
    packed = []

    def pack(t):
        packed.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args)
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    inputs = {i for i, x in enumerate(args) if any(_same(p, x) for p in packed)}
    outputs = {i for i, o in enumerate(outs)
               if isinstance(o, torch.Tensor) and o.numel() and any(_same(p, o) for p in packed)}
    return inputs, outputs


@pytest.mark.parametrize("op", sorted(_examples()))
def test_rule_matches_what_autograd_saves(op):
    fn, args = _examples()[op]
    rule: SavedRule = SAVED[op]
    want_inputs = set(rule.inputs) | set(rule.operands or ())  # every operand needs a gradient
    got_inputs, got_outputs = _saved_by_autograd(fn, args)
    if op == "aten.scaled_dot_product_attention.default":
        # the CPU flash kernel: q, k, v, the output and the log-sum-exp (not a captured output)
        assert got_inputs == want_inputs and 0 in got_outputs
        return
    assert (got_inputs, got_outputs) == (want_inputs, set(rule.outputs))


def test_every_rule_is_checked():
    assert set(SAVED) - set(_examples()) <= {
        op for op, rule in SAVED.items() if rule == SavedRule()}
