"""Deferred initialisation (codegen.deferred_init): a build recorded on meta
materialises every tensor exactly as the build on the CPU gives."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch
from torch import nn

from codegen.deferred_init import record_build
from codegen.deferred_init_log import DeferredInitError
from codegen.deferred_init_record import InitRecord
from models.source import build_model
from models.zoo import TINY

HF_QWEN2 = ("hf:qwen2,num_hidden_layers=2,hidden_size=64,intermediate_size=128,"
            "num_attention_heads=4,num_key_value_heads=2,vocab_size=256,tie_word_embeddings=true")
HF_GPT2 = "hf:gpt2,n_layer=2,n_embd=64,n_head=4,vocab_size=256,n_positions=64"
needs_hf = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                              reason="transformers is not installed")


def _tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter (tied ones under each name) and buffer of ``model``."""
    named = dict(model.named_parameters(remove_duplicate=False))
    named.update(model.named_buffers(remove_duplicate=False))
    return named


def _assert_exact(record: InitRecord, meta: dict[str, torch.Tensor],
                  real: dict[str, torch.Tensor]) -> None:
    assert meta.keys() == real.keys()
    for name, t in meta.items():
        assert t.is_meta, name
        value = record.materialize(t)
        assert value.device == real[name].device, name
        assert value.dtype == real[name].dtype and value.shape == real[name].shape, name
        assert torch.equal(value, real[name]), name


def _check_spec(spec: str, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """Checks every tensor of ``spec``'s meta build; returns the CPU generator's
    state after the record and after the CPU build."""
    (model, inputs), record = record_build(
        lambda: build_model(spec, device="meta", seed=0, **kwargs), device="cpu")
    after_record = torch.default_generator.get_state()
    ref_model, ref_inputs = build_model(spec, device="cpu", seed=0, **kwargs)
    after_build = torch.default_generator.get_state()
    _assert_exact(record, _tensors(model), _tensors(ref_model))
    values = record.materialize_tree(inputs)
    assert len(values) == len(ref_inputs)
    for value, ref in zip(values, ref_inputs):
        assert torch.equal(value, ref)
    return after_record, after_build


@pytest.mark.parametrize("name", TINY)
def test_zoo_models_materialize_exactly(name):
    assert {"gpt-tiny", "llama-tiny", "moe-tiny", "deepseek-tiny", "mlp-tiny"} <= set(TINY)
    _check_spec(name)


@needs_hf
@pytest.mark.parametrize("spec", [HF_QWEN2, HF_GPT2], ids=["qwen2", "gpt2"])
def test_hf_models_materialize_exactly(spec):
    after_record, after_build = _check_spec(spec, seq_len=16, batch_size=4)
    assert torch.equal(after_record, after_build)  # the build does not fork the generator


@needs_hf
def test_hf_meta_switch_restored():
    """transformers skips initialising on meta; the record turns that off while
    recording only (so a plain meta build afterwards stays uninitialised)."""
    import transformers.modeling_utils as mu

    before = mu.get_torch_context_manager_or_global_device
    (model, _), _ = record_build(
        lambda: build_model(HF_GPT2, device="meta", seed=0, seq_len=16, batch_size=4), "cpu")
    assert mu.get_torch_context_manager_or_global_device is before
    with torch.device("meta"):
        assert mu.get_torch_context_manager_or_global_device() == torch.device("meta")


class _Tied(nn.Module):
    """A factory's model: reseeds in the middle, ties weights, trunc_normal_,
    orthogonal_, sparse_, dirac_ (no-ops on meta tensors), zeroes a row
    through a view, a literal buffer, a CPU constant."""

    def __init__(self, constant: torch.Tensor) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        torch.manual_seed(1234)  # reseeding in the middle of the build
        self.proj = nn.Linear(16, 16)
        self.head = nn.Linear(16, 32, bias=False)
        self.head.weight = self.emb.weight  # weight tying
        self.extra = nn.Parameter(torch.empty(8, 16))
        nn.init.trunc_normal_(self.extra, std=0.02, a=-0.04, b=0.04)
        with torch.no_grad():
            w = self.proj.weight
            w[0].zero_()  # an in-place write through a view
            w.data[:, 1].mul_(2.0)
        self.rot = nn.Parameter(torch.empty(6, 6))
        nn.init.orthogonal_(self.rot)  # these four do nothing on meta tensors
        self.sparse = nn.Parameter(torch.empty(10, 4))
        nn.init.sparse_(self.sparse, sparsity=0.5)
        self.conv = nn.Conv1d(4, 4, 3)
        nn.init.dirac_(self.conv.weight)
        self.register_buffer("scale", torch.tensor([1.5, -2.0, 0.25]))
        self.register_buffer("halves", self.scale.new_tensor([0.5, 0.125]))
        self.register_buffer("offset", constant.to(torch.get_default_device()) * 3)
        self.noise = nn.Parameter(torch.randn(4, 4, device="cpu").to(
            torch.get_default_device()))  # drawn on the CPU inside a meta build
        with torch.no_grad():
            self.proj.bias.copy_(torch.linspace(-1, 1, 16) * math.pi)


def _tied_factory(device: str, constant: torch.Tensor):
    torch.manual_seed(0)
    with torch.device(device):
        model = _Tied(constant)
        inputs = (torch.randint(0, 32, (2, 5)),)
    return model, inputs


def test_user_factory_reseed_tying_views_exact():
    constant = torch.arange(6.0)
    (model, inputs), record = record_build(lambda: _tied_factory("meta", constant), "cpu")
    state_after_record = torch.default_generator.get_state()
    ref_model, ref_inputs = _tied_factory("cpu", constant)
    state_after_build = torch.default_generator.get_state()
    # the real generator advanced (and was reseeded) exactly as the CPU build's
    assert torch.equal(state_after_record, state_after_build)
    assert model.head.weight is model.emb.weight
    _assert_exact(record, _tensors(model), _tensors(ref_model))
    assert torch.equal(record.materialize_tree(inputs)[0], ref_inputs[0])
    assert torch.equal(record.materialize(model.proj.weight)[0], torch.zeros(16))


def test_reversed_order_same_values_and_generator_untouched():
    (model, _), record = record_build(lambda: build_model("gpt-tiny", device="meta", seed=0),
                                      "cpu")
    params = list(model.parameters())
    torch.manual_seed(99)
    before = torch.default_generator.get_state()
    forward = [record.materialize(p) for p in params]
    backward = [record.materialize(p) for p in reversed(params)][::-1]
    assert torch.equal(torch.default_generator.get_state(), before)
    for a, b in zip(forward, backward):
        assert torch.equal(a, b)
    assert torch.equal(torch.randn(3), (torch.manual_seed(99), torch.randn(3))[1])


def _linears(device: str) -> nn.Module:
    torch.manual_seed(0)
    with torch.device(device):
        return nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(8)])


def test_one_parameter_replays_only_its_ops():
    """Materialising one of 8 Linear(1024, 1024) weights replays its own ops
    (creation, the Parameter alias, kaiming uniform) and holds one weight."""
    model, record = record_build(lambda: _linears("meta"), "cpu")
    assert len(record) >= 8 * 2 * 3
    value = record.materialize(model[3].weight)
    assert record.last_replayed_ops <= 4
    assert record.last_peak_bytes == 1024 * 1024 * 4
    bias = record.materialize(model[5].bias)
    assert record.last_replayed_ops <= 4 and record.last_peak_bytes == 1024 * 4
    ref = _linears("cpu")
    assert torch.equal(value, ref[3].weight) and torch.equal(bias, ref[5].bias)


def test_derived_parameter_drops_its_inputs():
    """A weight computed from temporaries: the replay holds what it is computed
    from, and drops them once read."""

    def build(device: str) -> nn.Parameter:
        torch.manual_seed(0)
        with torch.device(device):
            a, b = torch.randn(256, 64), torch.randn(64, 256)
            other = nn.Parameter(torch.randn(512, 512))  # not needed
            return nn.Parameter(a @ b / 8), other

    (weight, other), record = record_build(lambda: build("meta"), "cpu")
    value = record.materialize(weight)
    assert record.last_replayed_ops <= 6
    # between ops: a and b (64 KiB each), then a @ b, then the weight (256 KiB each)
    assert record.last_peak_bytes == 256 * 256 * 4
    ref, ref_other = build("cpu")
    assert torch.equal(value, ref) and torch.equal(record.materialize(other), ref_other)


def test_layout_only_ops_skip_their_input():
    """``zeros_like(w)``/``randn_like(w)`` read only w's layout: materialising
    them does not make w."""

    def build(device: str):
        torch.manual_seed(0)
        with torch.device(device):
            weight = nn.Parameter(torch.randn(64, 32).t())
            return weight, torch.zeros_like(weight), torch.randn_like(weight) * 2

    (weight, zeros, noise), record = record_build(lambda: build("meta"), "cpu")
    refs = build("cpu")
    # zeros_like (+ the detach autograd adds); randn_like, detach, mul: not w's randn
    assert torch.equal(record.materialize(zeros), refs[1])
    assert record.last_replayed_ops <= 2
    assert torch.equal(record.materialize(noise), refs[2])
    assert record.last_replayed_ops <= 3
    value = record.materialize(weight)
    assert torch.equal(value, refs[0]) and value.stride() == refs[0].stride() == (1, 32)


def test_reading_values_on_meta_is_one_line_error():
    def build():
        with torch.device("meta"):
            layer = nn.Linear(4, 4)
            if layer.weight.sum().item() > 0:
                layer.bias.data.zero_()
        return layer

    with pytest.raises(DeferredInitError, match="_local_scalar_dense") as info:
        record_build(build, "cpu")
    assert "\n" not in str(info.value) and isinstance(info.value, ValueError)


def test_foreign_tensor_and_changed_constant_refused():
    constant = torch.ones(3)

    def build():
        with torch.device("meta"):
            return torch.zeros(3) + constant.to(torch.get_default_device())

    value, record = record_build(build, "cpu")
    assert torch.equal(record.materialize(value), torch.ones(3))
    with pytest.raises(DeferredInitError, match="did not make"):
        record.materialize(torch.empty(3, device="meta"))
    with pytest.raises(DeferredInitError, match="meta tensor"):
        record.materialize(torch.ones(3))
    constant.add_(1)
    with pytest.raises(DeferredInitError, match="changed in place"):
        record.materialize(value)
    with pytest.raises(DeferredInitError, match="real device"):
        record_build(build, "meta")
