"""torch.distributed.pipelining's split backward (private torch APIs; part of
:mod:`ir.torch_compat`): the input-gradient pass and the later
weight-gradient pass a zero-bubble schedule's ``I`` and ``W`` actions run."""

from __future__ import annotations

from typing import Any, Sequence

import torch

__all__ = ["split_backward"]


def split_backward(loss: torch.Tensor, inputs: Sequence[torch.Tensor],
                   params: Sequence[torch.nn.Parameter]) -> int:
    """The backward of ``loss`` as a pipeline stage under a zero-bubble
    schedule runs it: the gradients of ``inputs`` first (the parameters
    grouped by the autograd graph they hang from), then each group's weight
    gradients with a call of its own, accumulated into ``.grad``. Returns the
    number of parameter groups."""
    from torch.distributed.pipelining._backward import (stage_backward_input,
                                                        stage_backward_weight)

    groups: Any
    _, groups = stage_backward_input([loss], None, list(inputs), iter(params))
    count = len(groups)
    stage_backward_weight(iter(params), groups)
    return count
