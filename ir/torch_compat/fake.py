"""Fake tensors, fake process groups and meshes without process groups: what
the planner builds programs and strategies on without devices or ranks
(private torch APIs; part of :mod:`ir.torch_compat`)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

__all__ = ["fake_store_type", "fake_tensor_mode_type", "fake_tensor_on", "mesh_without_groups",
           "outside_fake_mode"]


def fake_store_type() -> type:
    """The no-op key-value store a ``"fake"`` process group is initialised
    with (a Python class before torch 2.14, a C++ one re-exported from the
    same module since)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore


def fake_tensor_mode_type() -> type:
    """torch's ``FakeTensorMode`` (tensors with shapes and no storage)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode


def mesh_without_groups(ranks: torch.Tensor, device_type: str = "cpu") -> Any:
    """A ``DeviceMesh`` of ``ranks`` on the process group up now, without one
    process group per mesh axis slice (``_init_backend=False``): for meshes
    whose shape alone is read (the planner's strategy functions; a (128, 4)
    mesh would make 132 groups). Made with the groups where this torch's
    ``DeviceMesh`` cannot skip them."""
    from torch.distributed.device_mesh import DeviceMesh

    try:
        return DeviceMesh(device_type, ranks, _init_backend=False)
    except TypeError:
        return DeviceMesh(device_type, ranks)


def outside_fake_mode() -> contextlib.AbstractContextManager:
    """A context in which tensors are real even under an active
    ``FakeTensorMode`` (a device mesh's rank table, made while a model's
    memory is counted on fake tensors)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    return unset_fake_temporarily()


def fake_tensor_on(mode: Any, meta: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A fake tensor of ``mode`` with ``meta``'s shape, strides and dtype that
    reports ``device``: torch code that branches on ``tensor.device.type`` takes
    that device's path, and nothing is allocated. ``meta``: a meta tensor."""
    from torch._subclasses.fake_tensor import FakeTensor

    return FakeTensor(mode, meta, device)
