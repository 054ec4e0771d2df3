"""Hugging Face ``transformers`` causal language models as planner models.

``--model hf:SPEC`` builds ``AutoModelForCausalLM.from_config`` of a config,
unedited and with the library's defaults, and trains it on next-token
prediction: :class:`CausalLMStep` calls it with ``labels`` and returns its
``.loss``. SPEC is one of

* a ``config.json`` file, or a folder holding one (a checkpoint's folder: only
  its config is read, never its weights);
* a model type with optional config fields, ``llama`` or
  ``llama,num_hidden_layers=2,hidden_size=256`` (values read as JSON where
  they parse, else as text).

The example step is ``batch_size`` sequences of ``seq_len`` random token ids
(default 8 x the smaller of the config's maximum positions and 2048), their
own labels. ``transformers`` is an optional dependency: ``pip install
'.[hf]'``.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from torch import nn

__all__ = ["CausalLMStep", "HFModelError", "build", "causal_lm_step"]

DEFAULT_BATCH_SIZE = 8
#: The longest default sequence, in tokens, for configs that allow longer ones.
DEFAULT_MAX_SEQ_LEN = 2048


class HFModelError(ValueError):
    """A Hugging Face model spec that names nothing buildable."""


class CausalLMStep(nn.Module):
    """One training step's forward of a causal LM: ``forward(input_ids, labels)``
    returns the model's own next-token cross-entropy loss (a scalar).

    The model is held as ``hf``, so its parameters are named ``hf.<its names>``.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.hf = model

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.hf(input_ids=input_ids, labels=labels).loss


def causal_lm_step(model: nn.Module, batch_size: int = DEFAULT_BATCH_SIZE,
                   seq_len: int | None = None) -> tuple[CausalLMStep, tuple[torch.Tensor, ...]]:
    """``(CausalLMStep(model), (input_ids, labels))`` for a factory: random token
    ids, int64 [batch_size, seq_len], made on the current default device.

    Raises:
        HFModelError: a batch or sequence the config cannot take.
    """
    config = model.config
    longest = getattr(config, "max_position_embeddings", None) or getattr(
        config, "n_positions", None)
    if seq_len is None:
        seq_len = min(int(longest or DEFAULT_MAX_SEQ_LEN), DEFAULT_MAX_SEQ_LEN)
    if batch_size < 1 or seq_len < 1:
        raise HFModelError(f"batch size {batch_size} and sequence length {seq_len} must be "
                           f"at least 1")
    if longest is not None and seq_len > int(longest):
        raise HFModelError(f"sequence length {seq_len} is longer than the config's "
                           f"{int(longest)} positions; give --seq-len {int(longest)} or less")
    ids = torch.randint(0, int(config.vocab_size), (batch_size, seq_len))
    return CausalLMStep(model), (ids, ids.clone())


def build(spec: str, batch_size: int = DEFAULT_BATCH_SIZE,
          seq_len: int | None = None) -> tuple[CausalLMStep, tuple[torch.Tensor, ...]]:
    """The model and example step of ``hf:SPEC`` (SPEC without the prefix),
    built on the current default device.

    Raises:
        HFModelError: transformers missing, a config that cannot be read, or a
            model that is no causal LM.
    """
    auto_config, auto_model = _transformers()
    config = _config(spec, auto_config)
    try:
        model = auto_model.from_config(config)
    except (ValueError, KeyError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise HFModelError(f"hf:{spec} is no causal language model transformers can build "
                           f"({first})") from err
    return causal_lm_step(model, batch_size, seq_len)


def _transformers() -> tuple[Any, Any]:
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError as err:
        raise HFModelError("hf: models need Hugging Face transformers; install it with "
                           "pip install 'autoparallel-planner[hf]' (or pip install "
                           "transformers)") from err
    return AutoConfig, AutoModelForCausalLM


def _config(spec: str, auto_config: Any) -> Any:
    """The config SPEC names: a config.json, a folder with one, or a model type
    with ``,field=value`` overrides."""
    path = os.path.join(spec, "config.json") if os.path.isdir(spec) else spec
    if path.endswith(".json"):
        if not os.path.isfile(path):
            raise HFModelError(f"hf:{spec}: no config file {path}")
        try:
            return auto_config.from_pretrained(path)
        except (ValueError, OSError, KeyError) as err:
            raise HFModelError(f"hf:{spec}: {path} is no transformers config ({err})") from err
    model_type, *fields = spec.split(",")
    overrides: dict[str, Any] = {}
    for field in fields:
        key, eq, value = field.partition("=")
        if not eq or not key:
            raise HFModelError(f"hf:{spec}: '{field}' is not FIELD=VALUE")
        overrides[key.strip()] = _value(value.strip())
    try:
        return auto_config.for_model(model_type, **overrides)
    except ValueError as err:
        raise HFModelError(f"hf:{spec}: unknown model type '{model_type}'; give a type "
                           f"transformers knows (gpt2, llama, mistral, mixtral, qwen2, ...) "
                           f"or a config.json") from err


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text
