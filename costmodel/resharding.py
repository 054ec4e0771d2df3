"""Resharding cost: the collectives DTensor's ``redistribute`` issues, priced.

Units: seconds, bytes.

A tensor's layout on an N-D mesh is one DTensor placement per mesh axis
(``Replicate()``, ``Shard(d)``, ``Partial(op)``); JSON writes them as
``"R"``, ``"S(d)"``, ``"P"`` / ``"P(avg)"``.

:func:`reshard_steps` replays DTensor's greedy planner
(``torch/distributed/tensor/_redistribute.py``,
``generate_greedy_transform_infos``): on a 1-D mesh one direct step; on an
N-D mesh, if the source is sharded, first a pass from the last mesh axis to
the first that also replicates "nested" shardings that do not line up with
the target, then a pass from first to last for whatever is left. Each step
changes one mesh axis and is priced as:

    axis src -> dst   collective                     bytes (B)
    S(d) -> R         all_gather                     tensor gathered over the axis
    P -> R            all_reduce                     local tensor
    P -> S(d)         reduce_scatter                 local tensor before the scatter
    R -> S(d)         none (local slice)             0
    R -> P            none (local zeroing)           0
    S(i) -> S(j)      all_to_all                     per-device shard (larger of
                                                     before/after)
    S(d) -> P         all_gather (DTensor has no     tensor gathered over the axis
                      direct path; priced via R)
    P(a) -> P(b)      all_reduce (via R; DTensor     local tensor
                      itself refuses this)
    same placement    none                           0

"Local tensor" sizes account for the sharding on the *other* mesh axes in the
state at the moment of the step (ceil division, like DTensor's padded
chunks), which is exactly what moves. Not modelled: DTensor's optional
merging of steps into one collective over a flattened mesh
(``_optimize_transform_infos``) and ``_StridedShard``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Sequence, Union

from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from .cluster import Link
from .collectives import collective_time

__all__ = ["ReshardStep", "reshard_steps", "reshard_time", "placement_str", "parse_placement"]

PlacementLike = Union[Placement, str]

_PARTIAL_OPS = tuple(getattr(Partial, "ALL_REDUCE_OPS", ("sum", "avg", "min", "max", "product")))
_RE_SHARD = re.compile(r"S\((\d+)\)")
_RE_PARTIAL = re.compile(r"P(?:\((\w+)\))?")


def placement_str(p: Placement) -> str:
    """JSON form of a placement: ``"R"``, ``"S(d)"``, ``"P"`` (sum) or ``"P(op)"``."""
    if isinstance(p, Shard) and type(p) is Shard:
        return f"S({p.dim})"
    if isinstance(p, Replicate):
        return "R"
    if isinstance(p, Partial):
        return "P" if p.reduce_op == "sum" else f"P({p.reduce_op})"
    raise ValueError(f"placement {p!r} has no JSON form; only Replicate, Shard(d) and Partial are supported")


def parse_placement(s: str) -> Placement:
    """Inverse of :func:`placement_str`: ``"R"``, ``"S(0)"``, ``"P"``, ``"P(avg)"``.

    Raises:
        ValueError: anything else, with the accepted forms in the message.
    """
    if not isinstance(s, str):
        raise ValueError(f"placement must be a string like 'R', 'S(0)', 'P' or 'P(avg)', got {s!r}")
    text = re.sub(r"\s+", "", s)
    if text == "R":
        return Replicate()
    m = _RE_SHARD.fullmatch(text)
    if m:
        return Shard(int(m.group(1)))
    m = _RE_PARTIAL.fullmatch(text)
    if m:
        op = m.group(1) or "sum"
        if op not in _PARTIAL_OPS:
            raise ValueError(f"placement {s!r}: unknown reduce op {op!r}; use one of {', '.join(_PARTIAL_OPS)}")
        return Partial(op)
    raise ValueError(f"placement {s!r} is not one of 'R', 'S(d)' (d >= 0), 'P' or 'P(op)'")


@dataclass(frozen=True)
class ReshardStep:
    """One DTensor transform on one mesh axis.

    Attributes:
        mesh_axis: the axis that changes.
        src, dst: its placement before and after (JSON form).
        collective: a :data:`costmodel.collectives.COLLECTIVES` kind, or None
            for a local (free) step.
        nbytes: bytes as :func:`collective_time` wants them for that kind
            (0 for local steps).
    """

    mesh_axis: int
    src: str
    dst: str
    collective: str | None
    nbytes: int


def _as_placement(p: PlacementLike) -> Placement:
    if isinstance(p, str):
        return parse_placement(p)
    if isinstance(p, Shard) and type(p) is not Shard:
        raise ValueError(f"placement {p!r} is not supported by the cost model (only Replicate, Shard(d), Partial)")
    if isinstance(p, (Replicate, Shard, Partial)):
        return p
    raise ValueError(f"placement {p!r} is not a DTensor Replicate/Shard/Partial or its JSON string")


def _normalize(placements: Sequence[PlacementLike], ndim: int, what: str) -> list[Placement]:
    out: list[Placement] = []
    for p in placements:
        p = _as_placement(p)
        if isinstance(p, Shard):
            if not -ndim <= p.dim < ndim:
                raise ValueError(f"{what} placement {placement_str(p)} shards dim {p.dim} of a {ndim}-D tensor")
            p = Shard(p.dim % ndim)
        out.append(p)
    return out


def _transforms(src: list[Placement], dst: list[Placement], mesh_shape: tuple[int, ...]) -> list[tuple[int, Placement, Placement, list[Placement]]]:
    """DTensor's greedy transform list: (axis, from, to, placements before the step)."""
    if len(mesh_shape) == 1:
        return [(0, src[0], dst[0], list(src))] if src[0] != dst[0] else []
    cur, tgt = list(src), list(dst)
    out: list[tuple[int, Placement, Placement, list[Placement]]] = []
    num_shards = math.prod(m for p, m in zip(src, mesh_shape) if isinstance(p, Shard))
    if num_shards > 1:
        for i in reversed(range(len(cur))):
            target = tgt[i]
            if isinstance(target, Shard):
                cur_axes = [j for j in range(i) if isinstance(cur[j], Shard) and cur[j].dim == target.dim]
                tgt_axes = [j for j in range(i) if isinstance(tgt[j], Shard) and tgt[j].dim == target.dim]
                if cur_axes != tgt_axes:
                    target = Replicate()  # clear the misaligned nested sharding first
            if cur[i] != target:
                out.append((i, cur[i], target, list(cur)))
                cur[i] = target
    for i in range(len(cur)):
        if cur[i] != tgt[i]:
            out.append((i, cur[i], tgt[i], list(cur)))
            cur[i] = tgt[i]
    return out


def _local_elems(shape: tuple[int, ...], placements: list[Placement], mesh_shape: tuple[int, ...], skip: int | None) -> int:
    """Elements one device holds, sharding on every axis except ``skip`` applied (ceil)."""
    dims = list(shape)
    for j, (p, m) in enumerate(zip(placements, mesh_shape)):
        if j != skip and isinstance(p, Shard):
            dims[p.dim] = -(-dims[p.dim] // m)
    return math.prod(dims)


def reshard_steps(
    src: Sequence[PlacementLike],
    dst: Sequence[PlacementLike],
    shape: Sequence[int],
    itemsize: int,
    mesh_shape: Sequence[int],
) -> list[ReshardStep]:
    """The steps DTensor takes from ``src`` to ``dst`` placements, with bytes.

    Args:
        src, dst: one placement per mesh axis (DTensor objects or JSON strings).
        shape: GLOBAL tensor shape, elements.
        itemsize: bytes per element.
        mesh_shape: logical mesh shape.
    """
    shape = tuple(shape)
    mesh = tuple(mesh_shape)
    if any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in shape):
        raise ValueError(f"shape must be non-negative integers, got {shape!r}")
    if isinstance(itemsize, bool) or not isinstance(itemsize, int) or itemsize < 1:
        raise ValueError(f"itemsize must be a positive integer (bytes), got {itemsize!r}")
    if any(isinstance(m, bool) or not isinstance(m, int) or m < 1 for m in mesh) or not mesh:
        raise ValueError(f"mesh_shape must be a non-empty tuple of integers >= 1, got {mesh_shape!r}")
    if len(src) != len(mesh) or len(dst) != len(mesh):
        raise ValueError(
            f"need one placement per mesh axis: mesh {mesh} has {len(mesh)} axes, src has {len(src)}, dst has {len(dst)}"
        )
    srcp = _normalize(src, len(shape), "src")
    dstp = _normalize(dst, len(shape), "dst")
    steps: list[ReshardStep] = []
    for axis, a, b, state in _transforms(srcp, dstp, mesh):
        full = itemsize * _local_elems(shape, state, mesh, skip=axis)  # bytes gathered over `axis`
        kind: str | None
        nbytes = 0
        if isinstance(a, Replicate):
            kind = None  # R -> S: local slice; R -> P: local zeroing
        elif isinstance(a, Shard) and isinstance(b, Shard):
            kind = "all_to_all"
            nbytes = max(
                itemsize * _local_elems(shape, state[:axis] + [a] + state[axis + 1:], mesh, skip=None),
                itemsize * _local_elems(shape, state[:axis] + [b] + state[axis + 1:], mesh, skip=None),
            )
        elif isinstance(a, Shard):
            kind, nbytes = "all_gather", full  # S -> R, and S -> P via R
        elif isinstance(b, Shard):
            kind, nbytes = "reduce_scatter", full  # P -> S
        else:
            kind, nbytes = "all_reduce", full  # P -> R, and P(a) -> P(b) via R
        steps.append(ReshardStep(axis, placement_str(a), placement_str(b), kind, nbytes))
    return steps


def reshard_time(
    src: Sequence[PlacementLike],
    dst: Sequence[PlacementLike],
    shape: Sequence[int],
    itemsize: int,
    mesh_shape: Sequence[int],
    links: Sequence[Link],
) -> float:
    """Seconds to redistribute a tensor from ``src`` to ``dst`` placements.

    Args:
        src, dst: one placement per mesh axis (DTensor objects or JSON strings).
        shape: GLOBAL tensor shape, elements.
        itemsize: bytes per element.
        mesh_shape: logical mesh shape.
        links: one :class:`Link` per mesh axis (see :func:`axis_links`).
    """
    if len(links) != len(tuple(mesh_shape)):
        raise ValueError(f"need one link per mesh axis: mesh {tuple(mesh_shape)}, got {len(links)} links")
    total = 0.0
    for step in reshard_steps(src, dst, shape, itemsize, mesh_shape):
        if step.collective is not None:
            total += collective_time(step.collective, step.nbytes, mesh_shape[step.mesh_axis], links[step.mesh_axis])
    return total
