"""torch's coalesced functional all-gather (``torch.distributed._functional_collectives``):
many tensors in one call, which a backend runs as one collective where it
can (gloo flattens an all-gather of many tensors into one buffer; NCCL
groups the calls). Gradients are all-reduced flat instead
(:func:`codegen.grad_reduction.all_reduce_flat`)."""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed._functional_collectives as funcol

__all__ = ["all_gather_coalesced"]


def all_gather_coalesced(tensors: Sequence[torch.Tensor], group: Any) -> list[torch.Tensor]:
    """Every rank's ``tensors`` of ``group`` concatenated along dim 0, rank
    order (each of ``group size x`` its rows), waited for: one coalesced
    all-gather. Every rank gives tensors of the same shapes."""
    # the newer name; torch 2.13 deprecates the older one (a warning per call site)
    gather = (getattr(funcol, "all_gather_single_coalesced", None)
              or funcol.all_gather_into_tensor_coalesced)
    return [funcol.wait_tensor(t) for t in gather(list(tensors), group)]
