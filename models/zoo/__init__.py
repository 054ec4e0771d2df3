"""Model zoo shared by the CLI, the tests and the benchmarks.

One readable file per family (nanoGPT style): :mod:`models.zoo.gpt` (GPT-2/GPT-3),
:mod:`models.zoo.llama` (LLaMA 3), :mod:`models.zoo.moe` (top-2 mixture of experts),
:mod:`models.zoo.deepseek` (DeepSeek-V3: latent attention, top-8 of 256 experts) and
:mod:`models.zoo.mlp`. Every model's ``forward(inputs, targets)`` returns the scalar
training loss, so ``loss = model(*example_inputs)`` is one training step's forward.

    >>> model, inputs = build("gpt3-175b")          # meta device: allocates nothing
    >>> model, inputs = build("gpt-tiny", device="cpu")
    >>> model(*inputs).backward()

Default example inputs: batch 8 for the language models (sequence length as listed
in :func:`describe`), batch 1024 for ``mlp``. A model built on meta is materialised
with ``model.to_empty(device=d)`` followed by ``model.init_weights()``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import nn

from models.zoo import llama, mlp
from models.zoo.deepseek import DeepSeek, DeepSeekConfig
from models.zoo.gpt import GPT, GPTConfig
from models.zoo.llama import Llama, LlamaConfig
from models.zoo.mlp import MLP, MLPConfig
from models.zoo.moe import MoEConfig, MoEGPT
from models.zoo.tokens import token_inputs

__all__ = [
    "DeepSeek", "DeepSeekConfig", "GPT", "GPTConfig", "Llama", "LlamaConfig", "MLP", "MLPConfig",
    "MoEConfig", "MoEGPT",
    "UnknownModelError", "ExampleStepError", "build", "build_from_config", "config", "describe",
    "names",
]


class UnknownModelError(ValueError):
    """A model name that is not in the zoo; the message lists the available names."""

    def __init__(self, name: str) -> None:
        self.name = name
        super().__init__(f"unknown model {name!r}; available models: {', '.join(names())}")


class ExampleStepError(ValueError):
    """An example step (batch size, sequence length) the model cannot take."""


@dataclass(frozen=True)
class _Entry:
    config: Any
    batch_size: int
    seq_len: int | None  # None for models without a sequence dimension


def _gpt2(n_layer: int, n_embd: int, n_head: int) -> _Entry:
    return _Entry(GPTConfig(n_layer, n_embd, n_head, vocab_size=50257, block_size=1024), 8, 1024)


def _gpt3(n_layer: int, n_embd: int, n_head: int) -> _Entry:
    return _Entry(GPTConfig(n_layer, n_embd, n_head, vocab_size=50257, block_size=2048), 8, 2048)


def _llama3(n_layers: int, dim: int, n_heads: int, ffn_dim: int) -> _Entry:
    return _Entry(LlamaConfig(n_layers=n_layers, dim=dim, n_heads=n_heads, n_kv_heads=8,
                              ffn_dim=ffn_dim, vocab_size=128256, max_seq_len=131072,
                              rope_theta=500000.0, rope_scaling=llama.LLAMA31_ROPE_SCALING),
                  8, 2048)


_REGISTRY: dict[str, _Entry] = {
    # GPT-2 (Radford et al. 2019).
    "gpt2": _gpt2(12, 768, 12),
    "gpt2-medium": _gpt2(24, 1024, 16),
    "gpt2-large": _gpt2(36, 1280, 20),
    "gpt2-xl": _gpt2(48, 1600, 25),
    # GPT-3 (Brown et al. 2020, table 2.1); 39B is the Megatron-LM / Alpa config.
    "gpt3-350m": _gpt3(24, 1024, 16),
    "gpt3-1.3b": _gpt3(24, 2048, 16),
    "gpt3-2.7b": _gpt3(32, 2560, 32),
    "gpt3-6.7b": _gpt3(32, 4096, 32),
    "gpt3-13b": _gpt3(40, 5120, 40),
    "gpt3-39b": _gpt3(48, 8192, 64),
    "gpt3-175b": _gpt3(96, 12288, 96),
    # Llama 3.1 (Meta 2024, "The Llama 3 Herd of Models", table 3): 131,072 tokens of
    # context (rope theta 500,000 with Llama 3.1's frequency scaling); traced at 2048
    # tokens by default, --seq-len up to 131,072.
    "llama3-8b": _llama3(32, 4096, 32, 14336),
    "llama3-70b": _llama3(80, 8192, 64, 28672),
    "llama3-405b": _llama3(126, 16384, 128, 53248),
    # Mixtral-8x7B-like shape with GPT blocks and GELU experts: ~32.5B parameters.
    "moe-8x": _Entry(MoEConfig(n_layer=32, n_embd=4096, n_head=32, n_expert=8,
                               expert_hidden=14336, vocab_size=32000, block_size=4096,
                               capacity_factor=1.25, group_size=512), 8, 2048),
    # DeepSeek-V3 (DeepSeek-AI 2024), main model without multi-token prediction: 671B
    # parameters, 37B active per token. Trained dropless; priced at capacity factor 1.25.
    "deepseek-v3": _Entry(DeepSeekConfig(
        n_layers=61, n_dense_layers=3, dim=7168, n_heads=128, q_lora_rank=1536,
        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        ffn_dim=18432, n_routed_experts=256, n_shared_experts=1, moe_ffn_dim=2048, top_k=8,
        routed_scaling_factor=2.5, capacity_factor=1.25, group_size=4096, vocab_size=129280,
        max_seq_len=4096, rope_theta=10000.0, norm_eps=1e-6), 8, 4096),
    # ~134M parameters: 8 x Linear(4096, 4096).
    "mlp": _Entry(MLPConfig(d_in=1024, d_hidden=4096, d_out=1000, n_layers=8), 1024, None),
    # Tiny variants for CPU tests: forward + backward in milliseconds.
    "gpt-tiny": _Entry(GPTConfig(n_layer=2, n_embd=64, n_head=4, vocab_size=128,
                                 block_size=32), 8, 32),
    "llama-tiny": _Entry(LlamaConfig(n_layers=2, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=176,
                                     vocab_size=128, max_seq_len=32, rope_theta=10000.0), 8, 32),
    # capacity_factor = E / 2: no token is dropped, routing is exact top-2.
    "moe-tiny": _Entry(MoEConfig(n_layer=2, n_embd=64, n_head=4, n_expert=4, expert_hidden=128,
                                 vocab_size=128, block_size=32, capacity_factor=2.0,
                                 group_size=64), 8, 32),
    "mlp-tiny": _Entry(MLPConfig(d_in=32, d_hidden=64, d_out=10, n_layers=3), 8, None),
    # 1 dense + 2 MoE blocks, 8 experts top-3 + 1 shared; capacity factor 2 (some drops);
    # value heads padded for the CPU flash kernel.
    "deepseek-tiny": _Entry(DeepSeekConfig(
        n_layers=3, n_dense_layers=1, dim=64, n_heads=4, q_lora_rank=32, kv_lora_rank=16,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, ffn_dim=128,
        n_routed_experts=8, n_shared_experts=1, moe_ffn_dim=32, top_k=3,
        routed_scaling_factor=1.0, capacity_factor=2.0, group_size=64, vocab_size=128,
        max_seq_len=32, rope_theta=10000.0, norm_eps=1e-6, init_std=0.02,
        pad_value_heads=True), 8, 32),
}

TINY = ("gpt-tiny", "llama-tiny", "moe-tiny", "mlp-tiny", "deepseek-tiny")


def names() -> list[str]:
    """All registered model names, sorted."""
    return sorted(_REGISTRY)


def _entry(name: str) -> _Entry:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UnknownModelError(name) from None


def config(name: str) -> Any:
    """The (frozen) config dataclass of a registered model."""
    return _entry(name).config


def describe(name: str) -> dict[str, Any]:
    """Family, parameter count (elements) and default example input shape of a model."""
    e = _entry(name)
    return {"name": name, "family": _family(e.config), "num_params": e.config.num_params(),
            "batch_size": e.batch_size, "seq_len": e.seq_len}


def _family(cfg: Any) -> str:
    # MoEConfig before GPTConfig: an MoE config is a GPT config with experts
    for cls, fam in ((MoEConfig, "moe"), (GPTConfig, "gpt"), (LlamaConfig, "llama"),
                     (DeepSeekConfig, "deepseek"), (MLPConfig, "mlp")):
        if isinstance(cfg, cls):
            return fam
    raise TypeError(f"not a zoo config: {type(cfg).__name__}")


@contextlib.contextmanager
def _seeded(device: torch.device) -> Iterator[None]:
    """Seed 0 for real devices (restoring the caller's RNG state after); nothing on meta."""
    if device.type == "meta":
        yield
        return
    if device.type == "cpu":
        fork = torch.random.fork_rng(devices=[])
    else:
        fork = torch.random.fork_rng(device_type=device.type)
    with fork:
        torch.manual_seed(0)
        yield


def build_from_config(cfg: Any, *, device: torch.device | str = "meta",
                      batch_size: int | None = None, seq_len: int | None = None,
                      dtype: torch.dtype = torch.float32) -> tuple[nn.Module, tuple]:
    """Build a model from a config dataclass; see :func:`build`.

    Defaults: batch 8; sequence length = the config's maximum.
    """
    dev = torch.device(device)
    fam = _family(cfg)
    b = 8 if batch_size is None else int(batch_size)
    if b < 1:
        raise ExampleStepError(f"batch size must be a positive integer, got {b}")
    if fam != "mlp" and seq_len is not None and not 1 <= int(seq_len) <= cfg.max_seq_len:
        raise ExampleStepError(f"sequence length must be in 1..{cfg.max_seq_len} for this "
                               f"model (its maximum), got {seq_len}")
    with _seeded(dev), dev:
        if fam == "mlp":
            model: nn.Module = MLP(cfg)
            inputs = mlp.example_inputs(cfg, b, device=dev, dtype=dtype)
        else:
            s = cfg.max_seq_len if seq_len is None else int(seq_len)
            model = {"gpt": GPT, "llama": Llama, "deepseek": DeepSeek, "moe": MoEGPT}[fam](cfg)
            inputs = token_inputs(cfg, b, s, device=dev)
    if dtype != torch.float32:
        model = model.to(dtype=dtype)
    return model, tuple(inputs)


def build(name: str, *, device: torch.device | str = "meta", batch_size: int | None = None,
          seq_len: int | None = None, dtype: torch.dtype = torch.float32) -> tuple[nn.Module, tuple]:
    """Build a registered model and example inputs for one training step.

    Args:
        name: one of :func:`names`.
        device: where parameters and inputs live; ``"meta"`` (default) allocates
            nothing, so ``build("gpt3-175b")`` is instant.
        batch_size: example batch size (default per model: 8, ``mlp`` 1024).
        seq_len: example sequence length in tokens (default per model).
        dtype: floating dtype of parameters (and of float inputs).

    Returns:
        ``(model, example_inputs)``; ``model(*example_inputs)`` is the scalar loss.
        Token ids and targets are int64 in [0, vocab_size). On a real device the
        weights and inputs are drawn from seed 0, so two builds are identical.

    Raises:
        UnknownModelError: for a name not in the zoo (the message lists them).
    """
    e = _entry(name)
    return build_from_config(
        e.config, device=device,
        batch_size=e.batch_size if batch_size is None else batch_size,
        seq_len=e.seq_len if seq_len is None else seq_len, dtype=dtype)
