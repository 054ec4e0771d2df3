"""torch's coalesced functional collectives (``torch.distributed._functional_collectives``):
many tensors in one call, which a backend runs as one collective where it
can (gloo flattens an all-reduce or an all-gather of many tensors into one
buffer; NCCL groups the calls)."""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed._functional_collectives as funcol

__all__ = ["all_gather_coalesced", "all_reduce_coalesced"]


def all_reduce_coalesced(tensors: Sequence[torch.Tensor], group: Any) -> list[torch.Tensor]:
    """The sums of ``tensors`` over ``group`` (a process group or ``(mesh, dim)``),
    new tensors, waited for: one coalesced all-reduce."""
    return [funcol.wait_tensor(t) for t in funcol.all_reduce_coalesced(list(tensors), "sum",
                                                                        group)]


def all_gather_coalesced(tensors: Sequence[torch.Tensor], group: Any) -> list[torch.Tensor]:
    """Every rank's ``tensors`` of ``group`` concatenated along dim 0, rank
    order (each of ``group size x`` its rows), waited for: one coalesced
    all-gather. Every rank gives tensors of the same shapes."""
    # the newer name; torch 2.13 deprecates the older one (a warning per call site)
    gather = (getattr(funcol, "all_gather_single_coalesced", None)
              or funcol.all_gather_into_tensor_coalesced)
    return [funcol.wait_tensor(t) for t in gather(list(tensors), group)]
