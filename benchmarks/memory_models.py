"""The models of the memory benchmarks, and the attention kernel each step runs.

:data:`MODELS` names each model of ``benchmarks/memory_fidelity.py``: real ones
run on this CPU and the grid measured under ``FakeTensorMode`` (priced on one
H100, measured at the same shapes on a GPU). A model made from a config has a
factory here (:data:`FACTORIES`) that its plans name as their model source, so
that the runtime builds it on meta as ``planner run`` builds any plan's model.
:func:`attention_kernel` picks the attention kernel a measured step runs.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch

__all__ = ["FACTORIES", "MODELS", "attention_kernel", "build", "cluster_of", "model_source"]


def _cpu_small_config() -> Any:
    from models.zoo import GPTConfig

    return GPTConfig(n_layer=4, n_embd=256, n_head=8, vocab_size=2048, block_size=256)


def _cut(zoo_name: str, layers: int, **more: int) -> Any:
    """A config factory: the zoo model ``zoo_name`` with only ``layers`` layers
    (its full width and vocabulary) and the ``more`` fields replaced."""
    def config() -> Any:
        import dataclasses

        from models import zoo
        cfg = zoo.config(zoo_name)
        field = "n_layer" if hasattr(cfg, "n_layer") else "n_layers"
        return dataclasses.replace(cfg, **{field: layers}, **more)
    return config


def _sized(zoo_name: str, **fields: int) -> Any:
    """A config factory: the zoo model ``zoo_name`` with ``fields`` replaced."""
    def config() -> Any:
        import dataclasses

        from models import zoo
        return dataclasses.replace(zoo.config(zoo_name), **fields)
    return config


#: name -> (zoo name or None, config factory or None, batch, seq, cluster, fake).
#: The fake models (FakeTensorMode on CPU, priced on one H100) are the grid the
#: GPU run measures too, at the same shapes: each fits an 80 GB GPU in fp32
#: without checkpointing.
MODELS: dict[str, tuple[str | None, Any, int, int, str, bool]] = {
    "gpt-tiny": ("gpt-tiny", None, 8, 32, "local-cpu:1", False),
    "gpt-4x256": (None, _cpu_small_config, 4, 256, "local-cpu:1", False),
    "llama-4x256": (None, _sized("llama-tiny", n_layers=4, dim=256, n_heads=8, n_kv_heads=4,
                                 ffn_dim=688, vocab_size=2048, max_seq_len=256),
                    4, 256, "local-cpu:1", False),
    "moe-4x256": (None, _sized("moe-tiny", n_layer=4, n_embd=256, n_head=8, n_expert=4,
                               expert_hidden=512, vocab_size=2048, block_size=256,
                               group_size=256), 4, 256, "local-cpu:1", False),
    "gpt2": ("gpt2", None, 8, 1024, "h100:1", True),
    "gpt3-350m": ("gpt3-350m", None, 4, 2048, "h100:1", True),
    "gpt3-1.3b": ("gpt3-1.3b", None, 4, 2048, "h100:1", True),
    "gpt3-2.7b": ("gpt3-2.7b", None, 1, 2048, "h100:1", True),
    "llama3-8b-4l": (None, _cut("llama3-8b", 4), 2, 2048, "h100:1", True),
    "moe-8x-2l": (None, _cut("moe-8x", 2), 2, 2048, "h100:1", True),
    # one dense layer and one of 256 experts, as the model's layers are (too big for
    # one GPU in fp32: measured on fake tensors only)
    "deepseek-v3-2l": (None, _cut("deepseek-v3", 2, n_dense_layers=1), 1, 4096, "h100:1", True),
}
#: the models :data:`MODELS` builds from a config: name -> the factory a plan
#: names as its model source (``benchmarks.memory_models:FACTORY``), so that the
#: runtime builds them itself, on meta, as ``planner run`` builds any plan's model
FACTORIES = {"gpt-4x256": "gpt_4x256", "llama-4x256": "llama_4x256", "moe-4x256": "moe_4x256",
             "llama3-8b-4l": "llama3_8b_4l", "moe-8x-2l": "moe_8x_2l",
             "deepseek-v3-2l": "deepseek_v3_2l"}


def model_source(name: str) -> str:
    """The model source of ``name``'s plans: its zoo name or its factory."""
    return MODELS[name][0] or f"benchmarks.memory_models:{FACTORIES[name]}"


def _factory(name: str) -> Callable[..., tuple[torch.nn.Module, tuple]]:
    def factory(batch_size: int | None = None, seq_len: int | None = None
                ) -> tuple[torch.nn.Module, tuple]:
        from models import zoo

        _, cfg, batch, seq, _, _ = MODELS[name]
        return zoo.build_from_config(cfg(), device=torch.get_default_device(),
                                     batch_size=batch_size or batch, seq_len=seq_len or seq)
    factory.__name__ = FACTORIES[name]
    factory.__doc__ = f"``{name}`` of :data:`MODELS` on the default device (a plan's model source)."
    return factory


gpt_4x256 = _factory("gpt-4x256")
llama_4x256 = _factory("llama-4x256")
moe_4x256 = _factory("moe-4x256")
llama3_8b_4l = _factory("llama3-8b-4l")
moe_8x_2l = _factory("moe-8x-2l")
deepseek_v3_2l = _factory("deepseek-v3-2l")


def cluster_of(spec: str) -> Any:
    from costmodel.presets import load_cluster

    if spec == "h100:1":  # one H100: the dgx-h100 preset cut to one device
        return load_cluster("dgx-h100").sub_cluster(1, 1)
    return load_cluster(spec)


def build(name: str, device: str, batch: int, seq: int) -> tuple[torch.nn.Module, tuple]:
    from models import zoo
    zoo_name, cfg, _, _, _, _ = MODELS[name]
    if zoo_name is not None:
        return zoo.build(zoo_name, device=device, batch_size=batch, seq_len=seq)
    return zoo.build_from_config(cfg(), device=device, batch_size=batch, seq_len=seq)


def _cpu_takes_math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
                    scale: float | None) -> bool:
    """Whether the CPU's ``scaled_dot_product_attention`` runs the math path for
    these head sizes and dtype: its own choice (``torch._fused_sdp_choice``, 0 is
    math) asked on small real tensors of the same dtype and head sizes (under
    FakeTensorMode the op answers math for any shape)."""
    from ir.torch_compat.fake import outside_fake_mode
    from ir.torch_compat.kernels import fused_sdp_choice

    with outside_fake_mode():
        small = [torch.zeros(1, 1, 8, t.shape[-1], dtype=t.dtype) for t in (q, k, v)]
        return fused_sdp_choice(*small, is_causal=is_causal, scale=scale) == 0


def _efficient_instead(fake_mode: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                       is_causal: bool = False, scale: float | None = None,
                       enable_gqa: bool = False) -> torch.Tensor | None:
    """For SDPA's arguments (its signature after ``fake_mode``): CUDA's
    memory-efficient attention of them where the CPU would
    take the math path for them (see :func:`_target_attention`), else None.
    Tensors of another fake mode than the measured model's ``fake_mode`` (the
    probes a capture runs under its own, whose program must keep the planned
    node) are left alone; the measured model's, and wrappers without a mode
    of their own over them (an export's), are not."""
    from torch.distributed.tensor import DTensor

    from ir.torch_compat import local_tensor

    local = local_tensor(query) if isinstance(query, DTensor) else query
    if getattr(local, "fake_mode", fake_mode) is not fake_mode:
        return None
    if (attn_mask is None and not dropout_p and not enable_gqa and query.dim() == 4
            and query.shape[-1] % 8 == 0 and value.shape[-1] % 8 == 0
            and _cpu_takes_math(query, key, value, is_causal, scale)):
        grad = any(t.requires_grad for t in (query, key, value))
        return torch.ops.aten._scaled_dot_product_efficient_attention(
            query, key, value, None, grad, 0.0, is_causal, scale=scale)[0]
    return None


@contextlib.contextmanager
def _target_attention(fake_mode: Any, runtime: bool) -> Iterator[None]:
    """Fake models are priced on an H100: where the CPU has no fused attention
    kernel for a shape (DeepSeek-V3's value heads of 128 beside query/key heads
    of 192: CPU's flash kernel needs equal head sizes) and would take the math
    path (an s x s score matrix, in fp32 for bf16 inputs), which no GPU runs,
    attention on ``fake_mode``'s tensors runs CUDA's memory-efficient kernel
    instead, what SDPA picks there for unequal head sizes (flash needs them
    equal), through its meta kernels on the fake tensors. It saves what the
    planner prices for the fused node: q, k, v, the output and a float32
    log-sum-exp. Shapes the CPU runs fused are left alone (CPU's flash kernel
    saves what CUDA's does).

    Replaced for the duration where attention is called: the model's
    ``F.scaled_dot_product_attention`` (the plain loop; a capture meanwhile),
    or with ``runtime`` a call of the captured op
    ``aten.scaled_dot_product_attention`` (the executor's node runner, which
    runs the plan's program: enter it, inside the first, once the runtime is
    built, as a capture calls ops through the same method). Replaced, not
    hooked through a mode, so that a checkpointed layer's recomputation (run
    by the autograd engine) calls the same kernel."""
    import torch.nn.functional as F

    from ir.torch_compat import SDPA, OpOverload

    if runtime:
        original_call = OpOverload.__call__

        def call(op: Any, /, *args: Any, **kwargs: Any) -> Any:
            out = _efficient_instead(fake_mode, *args, **kwargs) if op is SDPA else None
            return original_call(op, *args, **kwargs) if out is None else out

        OpOverload.__call__ = call
        try:
            yield
        finally:
            OpOverload.__call__ = original_call
        return
    original = F.scaled_dot_product_attention

    def sdpa(*args: Any, **kwargs: Any) -> torch.Tensor:
        out = _efficient_instead(fake_mode, *args, **kwargs)
        return original(*args, **kwargs) if out is None else out

    F.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


@contextlib.contextmanager
def attention_kernel(kind: str, fake_mode: Any = None, runtime: bool = False) -> Iterator[None]:
    """``default``: the kernel SDPA picks (for a fake model, ``fake_mode`` its
    FakeTensorMode, the target GPU's where the CPU would take the math path:
    :func:`_target_attention`, in a built runtime's calls with ``runtime``);
    ``math``: the math kernel forced."""
    if kind == "default":
        with (_target_attention(fake_mode, runtime) if fake_mode is not None
              else contextlib.nullcontext()):
            yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        yield
