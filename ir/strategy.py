"""Sharding strategies: the placements one op's inputs and outputs take on a mesh.

The vocabulary the planner chooses among and the cost model prices:
:class:`Strategy` (a placement tuple, one DTensor placement per mesh axis, for
each tensor argument and each output of one op) and :class:`NodeStrategies`
(every strategy considered for one graph node). :mod:`planner.ilp.strategies`
enumerates them from DTensor's sharding rules. :func:`local_numel`: the
elements of a tensor one device holds under its placements.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Iterator, Mapping, Sequence

from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from ir.graph import Node, TensorInfo

__all__ = ["NodeStrategies", "Placements", "Strategy", "is_replicate", "is_shard", "local_numel",
           "moved_arguments"]

Placements = tuple[Placement, ...]


@dataclass(frozen=True)
class Strategy:
    """Placements of one op: ``inputs[k]`` for the k-th tensor argument
    (aligned with ``Node.args``) and ``outputs[i]`` for the i-th output."""

    inputs: tuple[Placements, ...]
    outputs: tuple[Placements, ...]

    @functools.cached_property
    def split_axes(self) -> tuple[bool, ...]:
        """Per mesh axis, whether some input or output is not replicated on it
        (the op's work is split over that axis). Computed once: the cost model
        asks for every strategy of every priced node."""
        return _not_replicated(self.inputs + self.outputs, self._mesh_axes)

    @functools.cached_property
    def output_split_axes(self) -> tuple[bool, ...]:
        """Per mesh axis, whether some output is not replicated on it."""
        return _not_replicated(self.outputs, self._mesh_axes)

    @functools.cached_property
    def replicated_inputs(self) -> tuple[tuple[bool, ...], ...]:
        """Per input, per mesh axis, whether the input is replicated there."""
        return tuple(tuple(is_replicate(p) for p in pl) for pl in self.inputs)

    @property
    def _mesh_axes(self) -> int:
        return max((len(p) for p in self.inputs + self.outputs), default=0)


def _not_replicated(placements: Sequence[Placements], axes: int) -> tuple[bool, ...]:
    return tuple(any(not is_replicate(p[a]) for p in placements) for a in range(axes))


@dataclass
class NodeStrategies:
    """All strategies considered for one graph node.

    ``fallback`` names why the node is forced to replicate (None when the
    strategies came from DTensor).
    """

    node: Node
    strategies: list[Strategy]
    fallback: str | None = None


def is_shard(p: Placement) -> bool:
    """``isinstance(p, Shard)``, answered by the type where it is one of the
    three kept ones: a negative ``isinstance`` with torch's placement types
    runs Python code (their metaclass's ``__instancecheck__``), and the
    search asks it of millions of placements."""
    kind = type(p)
    return kind is Shard or (kind is not Replicate and kind is not Partial
                             and isinstance(p, Shard))


def is_replicate(p: Placement) -> bool:
    """``isinstance(p, Replicate)``, answered by the type as :func:`is_shard` is."""
    kind = type(p)
    return kind is Replicate or (kind is not Shard and kind is not Partial
                                 and isinstance(p, Replicate))


def local_numel(info: TensorInfo, placements: Sequence[Placement], mesh_shape: Sequence[int],
                skip_axis: int | None = None) -> float:
    """Elements of ``info`` held by one device (ignoring mesh axis ``skip_axis``)."""
    n = float(info.numel)
    for a, (p, size) in enumerate(zip(placements, mesh_shape)):
        if a != skip_axis and is_shard(p):
            n /= size
    return n


def moved_arguments(node: Node, strategy: Strategy, chosen: Mapping[str, Strategy]
                    ) -> Iterator[tuple[int, str, int, Placements, Placements]]:
    """Each argument of op ``node`` (run under ``strategy``) that its
    producer's strategy in ``chosen`` (node name -> strategy) leaves in other
    placements than ``node`` takes it in, the reshards an assignment makes:
    ``(argument position, producer name, producer output index, src, dst)``."""
    idx = node.arg_index if node.target == "getitem" else 0
    for k, arg in enumerate(node.args):
        src, dst = chosen[arg].outputs[idx], strategy.inputs[k]
        if src != dst:
            yield k, arg, idx, src, dst
