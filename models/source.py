"""Resolve a model spec (zoo name, ``file.py:factory``, ``package.module:factory``
or ``hf:CONFIG``, a Hugging Face causal LM: :mod:`models.hf`).

A user factory is a zero-argument callable returning ``(model, example_inputs)``.
It is called under ``torch.device(device)`` after ``torch.manual_seed(seed)``, so a
factory that builds its modules and inputs without naming a device gets meta
tensors for planning and identical real weights on every rank for running.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from typing import Any

import torch


#: The prefix of a Hugging Face model spec (:mod:`models.hf`).
HF_PREFIX = "hf:"


class ModelSourceError(ValueError):
    """The model spec names nothing that can be built."""


def _build_hf(spec: str, device: str, step: dict[str, Any]) -> tuple[torch.nn.Module, tuple]:
    """A Hugging Face causal LM (:func:`models.hf.build`) on ``device``."""
    from models import hf
    unknown = sorted(set(step) - {"batch_size", "seq_len"})
    if unknown:
        raise ModelSourceError(f"hf: models take no {', '.join(unknown)}")
    try:
        with torch.device(device):
            return hf.build(spec, **step)
    except hf.HFModelError as err:
        raise ModelSourceError(str(err)) from None


def _load_factory(spec: str):
    target, _, attr = spec.rpartition(":")
    if not target or not attr:
        raise ModelSourceError(
            f"model '{spec}' is neither a zoo name nor PATH.py:FACTORY / package.module:FACTORY")
    if target.endswith(".py"):
        if not os.path.isfile(target):
            raise ModelSourceError(f"model file {target} does not exist")
        name = "user_model_" + os.path.splitext(os.path.basename(target))[0]
        mod_spec = importlib.util.spec_from_file_location(name, os.path.abspath(target))
        module = importlib.util.module_from_spec(mod_spec)
        sys.modules[name] = module
        try:
            mod_spec.loader.exec_module(module)
        except Exception as err:  # noqa: BLE001 - user code
            raise ModelSourceError(f"importing {target} failed: {type(err).__name__}: {err}") from err
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as err:
            raise ModelSourceError(f"cannot import module '{target}' for model '{spec}': {err}") from err
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ModelSourceError(f"'{attr}' in {target} is not a callable factory")
    return factory


def build_model(spec: str, *, device: str = "meta", seed: int = 0, **zoo_kwargs: Any):
    """Return ``(model, example_inputs)`` for a zoo name or a user factory spec.

    Args:
        spec: zoo name (``gpt-tiny``, ``gpt3-175b``, ...) or ``file.py:factory``.
        device: ``meta`` for planning, ``cpu``/``cuda`` for running.
        seed: torch seed set before building, so every rank builds the same weights.
        zoo_kwargs: batch_size / seq_len overrides: of a zoo model's example
            step, or passed to a factory that takes them as keyword arguments.

    Raises:
        ModelSourceError: a ``.py`` file without ``:factory``, or overrides a
            factory does not take.
    """
    import inspect

    from models import zoo
    torch.manual_seed(seed)
    if spec.startswith(HF_PREFIX):
        return _build_hf(spec[len(HF_PREFIX):], device, zoo_kwargs)
    if ":" not in spec and spec.endswith(".py"):
        raise ModelSourceError(f"model file {spec} needs the factory to call: {spec}:make_model "
                               f"(a function returning (model, example_inputs))")
    if ":" not in spec or spec.split(":")[0] in zoo.names():
        return zoo.build(spec, device=device, **zoo_kwargs)
    factory = _load_factory(spec)
    if zoo_kwargs:
        accepted = inspect.signature(factory).parameters
        missing = [k for k in zoo_kwargs if k not in accepted]
        if missing and not any(p.kind == p.VAR_KEYWORD for p in accepted.values()):
            flags = ", ".join("--" + k.replace("_", "-") for k in missing)
            raise ModelSourceError(f"factory {spec} takes no {', '.join(missing)}, so {flags} "
                                   f"would be ignored; add the keyword argument to the "
                                   f"factory or leave the option out")
    with torch.device(device):
        result = factory(**zoo_kwargs)
    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], torch.nn.Module)):
        raise ModelSourceError(f"factory {spec} must return (model, example_inputs)")
    model, inputs = result
    return model, inputs if isinstance(inputs, tuple) else tuple(inputs) if isinstance(inputs, list) else (inputs,)
