"""The ``nn.ModuleList`` of identical blocks a fast trace replicates.

:func:`find_block_list` picks the largest list of at least the given number of
structurally identical blocks (same module types, parameter and buffer
shapes, attributes, no hooks) that the model registers once and owns alone;
:func:`truncated` is a shallow copy of the model that keeps only its first
blocks, for the probe captures of :mod:`ir.block_capture.trace`.
"""

from __future__ import annotations

import copy
import warnings
from collections import Counter
from typing import Any

import torch
from torch import nn

from ir.block_capture.unsupported import Unsupported

# Attributes every nn.Module has; the rest of an instance's __dict__ is compared.
_MODULE_INTERNALS = frozenset(vars(nn.Module()))
_FORWARD_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks",
                  "_backward_pre_hooks")


def find_block_list(model: nn.Module, min_blocks: int) -> tuple[str, int]:
    """FQN and length of the largest ModuleList of >= ``min_blocks`` identical blocks."""
    best: tuple[str, int, int] | None = None
    reasons = []
    for path, mod in model.named_modules():
        if not path or not isinstance(mod, nn.ModuleList) or len(mod) < max(min_blocks, 4):
            continue
        why = _why_not_identical(list(mod))
        if why:
            reasons.append(f"{path}: {why}")
            continue
        size = sum(p.numel() for p in mod.parameters())
        if best is None or size > best[2]:
            best = (path, len(mod), size)
    if best is None:
        raise Unsupported("no nn.ModuleList of at least %d identical blocks%s" % (
            min_blocks, (" (" + "; ".join(reasons) + ")") if reasons else ""))
    path, n, _ = best
    _check_reachable(model, path)
    return path, n


def _check_reachable(model: nn.Module, path: str) -> None:
    """The list is registered once, under ``path``, and owns its parameters alone."""
    mod = model
    for part in path.split("."):
        mod = mod._modules.get(part)
        if mod is None:
            raise Unsupported(f"{path} is not reachable through registered submodules")
    blocks = list(mod)
    owned = {id(m) for b in blocks for m in b.modules()} | {id(mod)}
    seen = Counter(id(m) for _, m in model.named_modules(remove_duplicate=False))
    if any(seen[i] != 1 for i in owned):
        raise Unsupported(f"modules of {path} are registered more than once")
    tensors = Counter(id(t) for _, t in model.named_parameters(remove_duplicate=False))
    tensors.update(id(t) for _, t in model.named_buffers(remove_duplicate=False))
    for b in blocks:
        for t in list(b.parameters()) + list(b.buffers()):
            if tensors[id(t)] != 1:
                raise Unsupported(f"a tensor of {path} is shared with another module")


def _why_not_identical(blocks: list[nn.Module]) -> str | None:
    """Why ``blocks`` are not all alike (the first difference), or None."""
    ref_entries, ref_attrs = _describe(blocks[0])
    for i, b in enumerate(blocks[1:], start=1):
        entries, attrs = _describe(b)
        if entries != ref_entries:
            return f"block {i} differs from block 0 in structure, shapes or hooks"
        for (where, a), (_, b_) in zip(ref_attrs, attrs):
            for key in a:
                if not _same_value(a[key], b_[key]):
                    return f"attribute {where or '<block>'}.{key} of block {i} differs"
    return None


def _describe(block: nn.Module) -> tuple[list, list]:
    """What must agree between blocks: the module tree with types, modes,
    hooks, parameter and buffer shapes and attribute names (``entries``,
    compared whole), and each module's own attributes (compared by value)."""
    entries: list = []
    attrs: list = []
    for name, m in block.named_modules(remove_duplicate=False):
        hooks = tuple(len(getattr(m, h, {})) for h in _FORWARD_HOOKS)
        entries.append(("module", name, type(m), m.training, hooks))
        for pn, p in m._parameters.items():
            entries.append(("param", name, pn, None if p is None else (
                type(p), tuple(p.shape), p.dtype, p.device.type, p.requires_grad)))
        for bn, b in m._buffers.items():
            entries.append(("buffer", name, bn, None if b is None else (
                type(b), tuple(b.shape), b.dtype, b.device.type),
                bn in m._non_persistent_buffers_set))
        extra = {k: v for k, v in vars(m).items() if k not in _MODULE_INTERNALS}
        entries.append(("attrs", name, tuple(sorted(extra))))
        attrs.append((name, extra))
    if any(h for e in entries if e[0] == "module" for h in e[4]):
        entries.append(("hooks",))  # blocks with hooks are never treated as identical
        entries.append(object())
    return entries, attrs


def _same_value(a: Any, b: Any) -> bool:
    """Two attribute values are equal plain data (tensors and modules never are,
    but for the same object)."""
    if a is b:
        return True
    if type(a) is not type(b) or isinstance(a, (torch.Tensor, nn.Module)):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same_value(a[k], b[k]) for k in a)
    try:
        return (a == b) is True
    except Exception:  # noqa: BLE001
        return False


def truncated(model: nn.Module, path: str, k: int) -> nn.Module:
    """A shallow copy of ``model`` whose ModuleList at ``path`` keeps its first ``k`` blocks."""

    def shallow(m: nn.Module) -> nn.Module:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            c = copy.copy(m)
        c._modules = dict(m._modules)
        return c

    parts = path.split(".")
    root = shallow(model)
    new, old = root, model
    for part in parts[:-1]:
        child = shallow(old._modules[part])
        new._modules[part] = child
        new, old = child, old._modules[part]
    blocks = old._modules[parts[-1]]
    short = shallow(blocks)
    short._modules = dict(list(blocks._modules.items())[:k])
    new._modules[parts[-1]] = short
    return root
