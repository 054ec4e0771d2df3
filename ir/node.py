"""The nodes of a captured program: what each value is, its tensors and its cost.

A :class:`Node` records one placeholder (parameter, buffer or user input) or
one aten call of the captured forward program; :class:`TensorInfo` the shape
and dtype of a tensor it reads or writes. Every number carries its unit in its
name: FLOPs are floating point operations of the forward pass, bytes are
bytes. :class:`ir.graph.Graph` is the program these nodes make up.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

# Node kinds: a placeholder for a parameter, a buffer or a user input, or an op.
PARAM = "param"
BUFFER = "buffer"
INPUT = "input"
OP = "op"

# The ATen ops that draw from a random number generator (dropout's mask and the
# like), by op packet name: a distributed run draws other numbers than one
# process, so their results can only be compared where nothing is drawn.
RANDOM_OPS = frozenset({
    "native_dropout", "bernoulli", "rand", "rand_like", "randn", "randn_like", "randint",
    "randint_like", "randperm", "normal", "uniform", "multinomial", "exponential",
    "geometric", "poisson", "cauchy", "log_normal", "random",
})


def draws_random(op: str) -> bool:
    """Whether the ATen op ``op`` (``aten.native_dropout.default``) draws random numbers."""
    parts = op.split(".")
    return len(parts) >= 2 and parts[0] == "aten" and parts[1].rstrip("_") in RANDOM_OPS


@dataclass(frozen=True)
class TensorInfo:
    """Shape and dtype of one tensor value (a global, unsharded view)."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= int(d)
        return n

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        """Bytes of the whole (unsharded) tensor."""
        return self.numel * self.itemsize

    @property
    def is_float(self) -> bool:
        return self.dtype.is_floating_point or self.dtype.is_complex

    def to_json(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "dtype": str(self.dtype).replace("torch.", "")}


@dataclass
class Node:
    """One value-producing step of the captured program.

    Attributes:
        name: unique node name (the torch.fx node name).
        kind: ``param``, ``buffer``, ``input`` or ``op``.
        target: aten overload name such as ``aten.mm.default``; ``getitem`` for
            tuple projections; the FQN for parameters and buffers.
        args: names of the nodes whose tensors this node reads, in argument order
            (one entry per tensor argument, repeats allowed).
        arg_index: for ``getitem`` nodes, the index of the projected output.
        inputs: TensorInfo of each tensor argument, aligned with ``args``.
        outputs: TensorInfo of each tensor output (several for multi-output ops).
        flops: forward FLOPs of this op (matmul/attention FLOPs from PyTorch's
            flop registry; 0 for memory-bound ops).
        bytes_moved: bytes read plus bytes written by this op in the forward pass
            (0 for view ops that move no data).
        params: FQNs of the parameters this node reads directly.
        module_path: FQN of the innermost nn.Module that issued the op ("" = root).
        layout_bound: indices into ``args`` of the tensors that must reach this
            op as their producer made them, never resharded: in a chain of
            views ending in ``aten.view`` that starts at a non-contiguous
            tensor, valid only for the strides the capture gave it
            (:func:`ir.exported_graph.layout_bound_args`).
    """

    name: str
    kind: str
    target: str
    args: tuple[str, ...] = ()
    arg_index: int | None = None
    inputs: tuple[TensorInfo, ...] = ()
    outputs: tuple[TensorInfo, ...] = ()
    flops: float = 0.0
    bytes_moved: float = 0.0
    params: tuple[str, ...] = ()
    module_path: str = ""
    fqn: str | None = None
    layout_bound: tuple[int, ...] = ()

    @property
    def is_view(self) -> bool:
        """An op that moves no bytes and does no FLOPs: a view of its input
        (tuple projections included)."""
        return self.kind == OP and self.bytes_moved == 0 and self.flops == 0

    @property
    def output(self) -> TensorInfo:
        """The single tensor output; raises for multi-output nodes."""
        if len(self.outputs) != 1:
            raise ValueError(f"node {self.name} ({self.target}) has {len(self.outputs)} outputs")
        return self.outputs[0]

    @property
    def is_placeholder(self) -> bool:
        return self.kind in (PARAM, BUFFER, INPUT)
