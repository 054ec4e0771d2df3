"""A fixed parameter layout applied to a stage's strategy lists.

A caller may fix the placements of parameters (by FQN) and of other nodes
(by name): Megatron's layouts (:func:`planner.megatron_layout.megatron_layout`),
or a user's. :func:`pin_fixed` keeps, of each fixed node, the strategies that
give it those placements, and of every op that reads a fixed parameter
(directly or through views of it), the strategies that read it without
gathering it on any mesh axis (where it is replicated, an op may read it
split or as a pending sum, which moves nothing): a layout that splits a
weight over the tensor-parallel ranks computes with the split weight, as
Megatron's column- and row-parallel linears do, and never gathers it whole
for an op.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from ir.graph import PARAM
from ir.strategy import NodeStrategies, Placements, is_replicate

__all__ = ["FixedPlacementError", "pin_fixed"]


class FixedPlacementError(ValueError):
    """A placement the caller fixed is not available for that tensor on this mesh."""


def pin_fixed(strategies: Sequence[NodeStrategies], fixed: Mapping[str, Placements],
              mesh_shape: Sequence[int]) -> list[NodeStrategies]:
    """``strategies`` (one list per node, in graph order) narrowed to
    ``fixed`` (see the module docstring). An op that cannot read a fixed
    weight where it lies (no such strategy) keeps its strategies.

    Raises:
        FixedPlacementError: a fixed node has no strategy giving its placements.
    """
    out = list(strategies)
    held: dict[str, set] = {}  # node name -> the placements a fixed weight arrives in
    for i, ns in enumerate(out):
        node = ns.node
        key = node.fqn if node.kind == PARAM else node.name
        if key in fixed:
            want = tuple(fixed[key])
            ns = out[i] = NodeStrategies(node, [s for s in ns.strategies if s.outputs[0] == want],
                                         ns.fallback)
            if not ns.strategies:
                raise FixedPlacementError(
                    f"{key} {list(node.output.shape)} cannot take placements {list(want)} "
                    f"on mesh {'x'.join(map(str, mesh_shape))} (uneven or unknown dim)")
            if node.kind == PARAM:
                held[node.name] = {want}
            continue
        reads = [(k, held[a]) for k, a in enumerate(node.args) if a in held]
        if not reads:
            continue
        kept = [s for s in ns.strategies
                if all(any(_ungathered(have, s.inputs[k]) for have in arrive)
                       for k, arrive in reads)]
        if not kept:
            continue
        out[i] = NodeStrategies(node, kept, ns.fallback)
        if node.is_view and node.target != "getitem":
            held[node.name] = {s.outputs[0] for s in kept}
    return out


def _ungathered(have: Placements, read: Placements) -> bool:
    """Whether a tensor placed ``have`` is read as ``read`` without a gather:
    the same on every mesh axis, or replicated where they differ."""
    return all(h == r or is_replicate(h) for h, r in zip(have, read))
