"""A model built on meta, seen as it runs on the cluster's kind of device.

Some models take another code path on another kind of device: Hugging Face's
MoE layers count tokens per expert in float32 on the CPU and in int32
elsewhere, and code may pick kernels by ``tensor.device.type``. A capture of
the model on meta takes the path of code that tests for no CPU, so the
program CPU ranks capture can differ from the one the planner priced, and the
plan would then not fit the program that runs.

:func:`on_device_type` gives a copy of a meta model whose parameters, buffers
and inputs are fake tensors (shapes and dtypes, no storage) that report the
CPU, so the capture of a plan for CPU ranks takes the CPU's path and still
allocates nothing. Tensors shared in the model (tied weights) or among the
inputs stay shared in the copy. Plans for GPUs keep the meta capture: fake
CUDA tensors need a CUDA build of torch, and the meta capture already takes
the path of code that tests for the CPU as a GPU takes it.
"""

from __future__ import annotations

import copy
from typing import Any, Sequence

import torch

from ir.precision import Precision, compute_copy
from ir.torch_compat import fake_tensor_mode_type, fake_tensor_on, tree_map

__all__ = ["on_device_type", "planned_copy"]


def planned_copy(model: torch.nn.Module, example_inputs: Sequence[Any], precision: Precision,
                 device_type: str) -> tuple[torch.nn.Module, tuple]:
    """The model and inputs the planner captures: floating tensors in the
    precision's compute dtype (:func:`ir.precision.compute_copy`), seen on
    the cluster's ``device_type`` (:func:`on_device_type`); ``model`` unchanged."""
    return on_device_type(*compute_copy(model, tuple(example_inputs), precision), device_type)


def on_device_type(model: torch.nn.Module, example_inputs: Sequence[Any],
                   device_type: str) -> tuple[torch.nn.Module, tuple]:
    """``(model, example_inputs)`` with every meta tensor turned into a fake
    tensor on ``device_type``, all of one fake mode.

    ``model`` is never changed: a copy is returned when it has meta tensors
    and ``device_type`` is ``"cpu"``. Anything else comes back as it is: a
    model with real tensors already takes a real device's path, and an
    accelerator is left to the meta capture (fake CUDA tensors need a CUDA
    build of torch, and code that tests for the CPU takes the accelerator's
    path on meta too)."""
    tensors = list(model.parameters()) + list(model.buffers())
    if device_type != "cpu" or not tensors or not all(t.is_meta for t in tensors):
        return model, tuple(example_inputs)
    device = torch.device(device_type)
    mode = fake_tensor_mode_type()(allow_non_fake_inputs=True)
    faked: dict[int, torch.Tensor] = {}

    def fake(t: Any) -> Any:
        if not (isinstance(t, torch.Tensor) and t.is_meta):
            return t
        if id(t) not in faked:
            faked[id(t)] = fake_tensor_on(mode, t.detach(), device)
        return faked[id(t)]

    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = torch.nn.Parameter(fake(p), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = fake(b)
    return copy.deepcopy(model, memo), tuple(tree_map(fake, tuple(example_inputs)))
