"""Resharding cost: the collectives DTensor's ``redistribute`` issues, priced.

Units: seconds, bytes.

A tensor's layout on an N-D mesh is one DTensor placement per mesh axis
(``Replicate()``, ``Shard(d)``, ``Partial(op)``, the only ones priced), given
as DTensor objects or as plan strings (``"R"``, ``"S(d)"``, ``"P"`` /
``"P(avg)"``: :mod:`ir.placements`).

:func:`reshard_steps` replays DTensor's greedy planner
(``torch/distributed/tensor/_redistribute.py``,
``generate_greedy_transform_infos``): on a 1-D mesh one direct step; on an
N-D mesh, if the source is sharded, first a pass from the last mesh axis to
the first that also replicates "nested" shardings that do not line up with
the target, then a pass from first to last for whatever is left. Each step
changes one mesh axis and is priced as the collective below, at the link's
fits for DTensor's own path where ``planner profile`` measured them
(:attr:`costmodel.cluster.Link.per_redistribute`: the functional collective,
DTensor's host work and its layout copies):

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
from dataclasses import dataclass
from typing import Sequence, Union

from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from ir.placements import parse_placement, placement_str
from ir.torch_compat import is_strided_shard

from .cluster import Link, check_mesh_shape
from .collectives import collective_time

__all__ = ["ReshardStep", "ReshardPricer", "reshard_collectives", "reshard_steps",
           "reshard_staging_bytes", "reshard_time", "gradient_placements",
           "weight_gradient_placements"]

PlacementLike = Union[Placement, str]


def gradient_placements(placements: Sequence[PlacementLike]) -> tuple[PlacementLike, ...]:
    """Placements of the gradient that flows back into a tensor of
    ``placements``: the same, with a partial sum replicated (the gradient of
    a value that is reduced later reaches every rank whole)."""
    return tuple(Replicate() if isinstance(_as_placement(p), Partial) else p
                 for p in placements)


def weight_gradient_placements(src: Sequence[PlacementLike], dst: Sequence[PlacementLike]
                               ) -> tuple[PlacementLike, ...]:
    """Placements of the gradient that flows back into a weight (a parameter
    or a view of one) moved from ``src`` to ``dst`` placements: those of
    :func:`gradient_placements` of ``dst``, but a pending sum on mesh axis 0
    where the move gathers it whole there (``Shard`` to ``Replicate``). Its
    users' rows are split over the data-parallel axis 0, so its gradient is
    the sum over those ranks, which DTensor's backward of the gather
    reduce-scatters in each micro-batch (a weight replicated on axis 0 keeps
    the sum pending until the step's end)."""
    back = gradient_placements(dst)
    if isinstance(_as_placement(src[0]), Shard) and isinstance(_as_placement(dst[0]), Replicate):
        back = (Partial(),) + tuple(back[1:])
    return back


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
    """``p`` as a placement the cost model prices: a plan string is read
    (:func:`ir.placements.parse_placement`), a Replicate subclass is read as
    ``Replicate()``, a Partial subclass (DTensor's masked partial) as the
    partial it is.

    Raises:
        ValueError: a malformed plan string, a strided shard (the cost model
            does not price it) or no DTensor placement.
    """
    if type(p) in _PLAIN_PLACEMENTS:
        return p
    given = p
    if isinstance(p, str):
        p = parse_placement(p)
        if type(p) in _PLAIN_PLACEMENTS:
            return p
    if is_strided_shard(p) or isinstance(p, Shard):  # a Shard subclass: Shard itself returned above
        raise ValueError(f"placement {given!r} is a strided shard, which the cost model does not "
                         f"price; it prices R, S(d), P and P(op)")
    if isinstance(p, Replicate):
        return Replicate()
    if isinstance(p, Partial):
        return p
    raise ValueError(f"placement {p!r} is not a DTensor Replicate, Shard or Partial, nor its "
                     f"plan string")


# the placement types the cost model takes as they are
_PLAIN_PLACEMENTS = frozenset({Replicate, Shard, Partial})


def _normalize(placements: Sequence[PlacementLike], ndim: int, what: str) -> list[Placement]:
    out: list[Placement] = []
    for p in placements:
        p = _as_placement(p)
        if type(p) is Shard:
            if not -ndim <= p.dim < ndim:
                raise ValueError(f"{what} placement {p!r} shards dim {p.dim} of a {ndim}-D tensor")
            if p.dim < 0:
                p = Shard(p.dim % ndim)
        out.append(p)
    return out


def _same(a: Placement, b: Placement) -> bool:
    """``a == b``, the types compared first: torch's ``==`` between placements
    of two types takes ~2.6 us (against ~0.3 us for one type), and the
    transform lists of a search compare ~10^5 pairs."""
    return type(a) is type(b) and a == b


def _transforms(src: list[Placement], dst: list[Placement], mesh_shape: tuple[int, ...]) -> list[tuple[int, Placement, Placement, list[Placement]]]:
    """DTensor's greedy transform list: (axis, from, to, placements before the step)."""
    if len(mesh_shape) == 1:
        return [] if _same(src[0], dst[0]) else [(0, src[0], dst[0], list(src))]
    cur, tgt = list(src), list(dst)
    out: list[tuple[int, Placement, Placement, list[Placement]]] = []
    num_shards = math.prod(m for p, m in zip(src, mesh_shape) if type(p) is Shard)
    if num_shards > 1:
        for i in reversed(range(len(cur))):
            target = tgt[i]
            if type(target) is Shard:
                cur_axes = [j for j in range(i) if type(cur[j]) is Shard and cur[j].dim == target.dim]
                tgt_axes = [j for j in range(i) if type(tgt[j]) is Shard and tgt[j].dim == target.dim]
                if cur_axes != tgt_axes:
                    target = Replicate()  # clear the misaligned nested sharding first
            if not _same(cur[i], target):
                out.append((i, cur[i], target, list(cur)))
                cur[i] = target
    for i in range(len(cur)):
        if not _same(cur[i], tgt[i]):
            out.append((i, cur[i], tgt[i], list(cur)))
            cur[i] = tgt[i]
    return out


def _divisors(placements: Sequence[Placement], mesh_shape: tuple[int, ...], ndim: int,
              skip: int | None) -> tuple[int, ...]:
    """Per tensor dim, the product of the mesh sizes sharding it (every axis but ``skip``)."""
    div = [1] * ndim
    for j, (p, m) in enumerate(zip(placements, mesh_shape)):
        if j != skip and type(p) is Shard:
            div[p.dim] *= m
    return tuple(div)


def _local_elems(shape: tuple[int, ...], divisors: tuple[int, ...]) -> int:
    """Elements one device holds when dim d is split ``divisors[d]`` ways (ceil, like
    DTensor's padded chunks; ceil(ceil(x/a)/b) == ceil(x/(a*b)), so one division
    per dim equals sharding axis by axis)."""
    n = 1
    for s, k in zip(shape, divisors):
        n *= -(-s // k)
    return n


@dataclass(frozen=True)
class _PlannedStep:
    """One transform of :func:`_plan`, its bytes still a function of the shape:
    ``itemsize * max(_local_elems(shape, d) for d in sizes)`` (0 when no ``sizes``)."""

    mesh_axis: int
    src: Placement
    dst: Placement
    collective: str | None
    sizes: tuple[tuple[int, ...], ...]

    def nbytes(self, shape: tuple[int, ...], itemsize: int) -> int:
        return max((itemsize * _local_elems(shape, d) for d in self.sizes), default=0)


def _plan(src: Sequence[PlacementLike], dst: Sequence[PlacementLike], ndim: int,
          mesh: tuple[int, ...]) -> tuple[_PlannedStep, ...]:
    """DTensor's transforms from ``src`` to ``dst`` for any ``ndim``-D tensor, each
    with its collective (see the table in the module docstring). Placements
    are told apart by their exact types (:func:`_as_placement` admits no
    subclass of ``Shard``; a subclass of ``Partial`` is a partial): a
    negative ``isinstance`` with torch's placement types runs Python code."""
    srcp = _normalize(src, ndim, "src")
    dstp = _normalize(dst, ndim, "dst")
    steps = []
    for axis, a, b, state in _transforms(srcp, dstp, mesh):
        full = (_divisors(state, mesh, ndim, skip=axis),)  # gathered over `axis`
        if type(a) is Replicate:
            kind, sizes = None, ()  # R -> S: local slice; R -> P: local zeroing
        elif type(a) is Shard and type(b) is Shard:
            kind = "all_to_all"  # the per-device shard, larger of before/after
            sizes = (_divisors(state[:axis] + [a] + state[axis + 1:], mesh, ndim, skip=None),
                     _divisors(state[:axis] + [b] + state[axis + 1:], mesh, ndim, skip=None))
        elif type(a) is Shard:
            kind, sizes = "all_gather", full  # S -> R, and S -> P via R
        elif type(b) is Shard:
            kind, sizes = "reduce_scatter", full  # P -> S
        else:
            kind, sizes = "all_reduce", full  # P -> R, and P(a) -> P(b) via R
        steps.append(_PlannedStep(axis, a, b, kind, sizes))
    return tuple(steps)


def _check_tensor(shape: tuple[int, ...], itemsize: int) -> None:
    if any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in shape):
        raise ValueError(f"shape must be non-negative integers, got {shape!r}")
    if isinstance(itemsize, bool) or not isinstance(itemsize, int) or itemsize < 1:
        raise ValueError(f"itemsize must be a positive integer (bytes), got {itemsize!r}")


def _check_placements(src, dst, mesh: tuple[int, ...]) -> None:
    if len(src) != len(mesh) or len(dst) != len(mesh):
        raise ValueError(
            f"need one placement per mesh axis: mesh {mesh} has {len(mesh)} axes, src has {len(src)}, dst has {len(dst)}"
        )


def _check(src, dst, shape: tuple[int, ...], itemsize: int, mesh_shape) -> tuple[int, ...]:
    """The mesh shape, checked with the tensor and the placements."""
    _check_tensor(shape, itemsize)
    mesh = check_mesh_shape(mesh_shape)
    _check_placements(src, dst, mesh)
    return mesh


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
    mesh = _check(src, dst, shape, itemsize, mesh_shape)
    return [ReshardStep(s.mesh_axis, placement_str(s.src), placement_str(s.dst), s.collective,
                        s.nbytes(shape, itemsize))
            for s in _plan(src, dst, len(shape), mesh)]


def reshard_collectives(src: Sequence[PlacementLike], dst: Sequence[PlacementLike],
                        mesh_shape: Sequence[int]) -> list[str]:
    """The collectives (``all_gather``...) DTensor issues to take a tensor
    from ``src`` to ``dst`` placements on a mesh of ``mesh_shape``, in order;
    a step on an axis of one device moves nothing and is left out."""
    mesh = tuple(mesh_shape)
    shard_dims = [p.dim for p in _normalize([*src, *dst], 64, "src/dst") if type(p) is Shard]
    ndim = max(shard_dims, default=0) + 1
    return [s.collective for s in _plan(src, dst, ndim, mesh)
            if s.collective is not None and mesh[s.mesh_axis] > 1]


def reshard_staging_bytes(steps: Sequence[ReshardStep], mesh_shape: Sequence[int],
                          backend: str) -> int:
    """Bytes per device a redistribute of ``steps`` (:func:`reshard_steps`)
    allocates while it runs, its result included: an all-gather's gathered
    tensor, and where it gathers a dim other than the first a second one
    (the gathered pieces lie along the first dim; a ``cat`` moves them); an
    all-to-all over gloo gathers the whole tensor and cuts its piece out of
    the concatenation (``all_gather`` + ``cat``, 2 x the axis size x the
    shard), elsewhere a contiguous input and an output (2 shards); an
    all-reduce or a reduce-scatter a tensor of its input's size. Summed over
    the steps; a step over an axis of one device moves nothing."""
    total = 0
    for st in steps:
        if mesh_shape[st.mesh_axis] == 1:
            continue
        if st.collective == "all_gather":
            dim = parse_placement(st.src).dim
            total += st.nbytes if dim == 0 else 2 * st.nbytes
        elif st.collective == "all_to_all":
            total += 2 * st.nbytes * (mesh_shape[st.mesh_axis] if backend == "gloo" else 1)
        elif st.collective is not None:
            total += st.nbytes
    return total


def _plan_time(plan: Sequence[_PlannedStep], shape: tuple[int, ...], itemsize: int,
               mesh: tuple[int, ...], links: Sequence[Link],
               memo: dict[tuple[str, int, int], float] | None = None) -> float:
    """Seconds of the collectives of ``plan`` for a tensor of ``shape`` over
    ``links`` (as DTensor's redistribute sees them: :meth:`Link.for_redistribute`);
    ``memo`` keeps each collective's seconds by (kind, bytes, mesh axis)."""
    total = 0.0
    for step in plan:
        if step.collective is None:
            continue
        nbytes, axis = step.nbytes(shape, itemsize), step.mesh_axis
        if memo is None:
            total += collective_time(step.collective, nbytes, mesh[axis], links[axis])
            continue
        key = (step.collective, nbytes, axis)
        t = memo.get(key)
        if t is None:
            t = memo[key] = collective_time(step.collective, nbytes, mesh[axis], links[axis])
        total += t
    return total


def _check_links(mesh_shape: Sequence[int], links: Sequence[Link]) -> None:
    if len(links) != len(tuple(mesh_shape)):
        raise ValueError(f"need one link per mesh axis: mesh {tuple(mesh_shape)}, got {len(links)} links")


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
    _check_links(mesh_shape, links)
    shape = tuple(shape)
    mesh = _check(src, dst, shape, itemsize, mesh_shape)
    return _plan_time(_plan(src, dst, len(shape), mesh), shape, itemsize, mesh,
                      [link.for_redistribute() for link in links])


class ReshardPricer:
    """:func:`reshard_time` on one mesh, memoised for planners that ask for the same
    pairs many times. Placement tuples are interned to small ints once
    (:meth:`spec_id`); DTensor's transform list is planned once per (src, dst,
    tensor rank), each collective priced once per (kind, bytes, axis), and each
    (src, dst, shape, itemsize) once. Returns exactly the floats of
    :func:`reshard_time` (seconds).
    """

    def __init__(self, mesh_shape: Sequence[int], links: Sequence[Link]):
        _check_links(mesh_shape, links)
        check_mesh_shape(mesh_shape)
        self.mesh_shape = tuple(mesh_shape)
        self.links = list(links)
        self._redistribute_links = [link.for_redistribute() for link in links]
        self.specs: list[tuple[PlacementLike, ...]] = []  # id -> placements
        self._ids: dict[tuple[PlacementLike, ...], int] = {}
        self._by_object: dict[int, tuple[tuple, int]] = {}  # id(tuple) -> (tuple, spec id)
        self._plans: dict[tuple[int, int, int], tuple[_PlannedStep, ...]] = {}
        self._times: dict[tuple, float] = {}
        self._collectives: dict[tuple[str, int, int], float] = {}
        self._checked: set[tuple] = set()  # (shape, itemsize) already validated
        self._gradient_ids: dict[int, int] = {}  # spec id -> id of gradient_placements
        # (src, dst) spec ids -> id of weight_gradient_placements
        self._weight_gradient_ids: dict[tuple[int, int], int] = {}
        # edge_seconds' matrices by (srcs, dsts, shape, itemsize, with_gradient)
        self._edges: dict[tuple, tuple[tuple[float, ...], ...]] = {}
        self._memos: dict[str, dict] = {}  # see memo

    def memo(self, name: str) -> dict:
        """A dict named ``name`` that lives as long as this pricer: for callers
        that derive prices of their own objects on this mesh and keep them
        beside its prices (e.g. ``planner.ilp.intra_op``'s edge matrices)."""
        return self._memos.setdefault(name, {})

    def spec_id(self, placements: Sequence[PlacementLike]) -> int:
        """A small int naming ``placements`` (one per mesh axis); equal placements
        get equal ids. A tuple asked for before is recognised by identity
        (hashing placements runs Python code per placement: most of what
        pricing the edges of a layer cost)."""
        seen = self._by_object.get(id(placements))
        if seen is not None and seen[0] is placements:
            return seen[1]
        key = tuple(placements)
        i = self._ids.get(key)
        if i is None:
            _check_placements(key, key, self.mesh_shape)
            i = self._ids[key] = len(self.specs)
            self.specs.append(key)
        if isinstance(placements, tuple):  # kept alive here, so its id stays its own
            self._by_object[id(placements)] = (placements, i)
        return i

    def gradient_id(self, spec: int) -> int:
        """The id of :func:`gradient_placements` of the placements with id ``spec``."""
        i = self._gradient_ids.get(spec)
        if i is None:
            i = self._gradient_ids[spec] = self.spec_id(gradient_placements(self.specs[spec]))
        return i

    def gradient_seconds(self, src: int, dst: int, shape: tuple[int, ...], itemsize: int,
                         weight: bool = False) -> float:
        """Seconds of the gradient's way back over an edge that moves a tensor
        from placements ``src`` to ``dst`` (ids of :meth:`spec_id`): from
        :func:`gradient_placements` of ``dst`` to that of ``src``, or for a
        ``weight`` from :func:`weight_gradient_placements`."""
        if weight:
            back = self._weight_gradient_ids.get((src, dst))
            if back is None:
                back = self._weight_gradient_ids[src, dst] = self.spec_id(
                    weight_gradient_placements(self.specs[src], self.specs[dst]))
        else:
            back = self.gradient_id(dst)
        to = self.gradient_id(src)
        return 0.0 if back == to else self.time_ids(back, to, shape, itemsize)

    def edge_seconds(self, srcs: tuple[int, ...], dsts: tuple[int, ...], shape: tuple[int, ...],
                     itemsize: int, with_gradient: bool, weight: bool = False
                     ) -> tuple[tuple[float, ...], ...]:
        """Seconds of an edge between ops, ``[i][j]`` for a tensor that leaves
        its producer placed as ``srcs[i]`` and enters its consumer as
        ``dsts[j]`` (ids of :meth:`spec_id`): the forward reshard, plus with
        ``with_gradient`` the reverse reshard of its gradient
        (:meth:`gradient_seconds`; ``weight``: of a weight). Memoised as a
        whole: the blocks of a model and the stages searched on one mesh ask
        for the same matrices many times (llama3-8b on 64 GPUs: 8 times each)."""
        key = (srcs, dsts, shape, itemsize, with_gradient, weight)
        matrix = self._edges.get(key)
        if matrix is not None:
            return matrix
        rows = []
        for a in srcs:
            row = []
            for b in dsts:
                t = 0.0 if a == b else self.time_ids(a, b, shape, itemsize)
                if with_gradient and a != b:
                    t += self.gradient_seconds(a, b, shape, itemsize, weight)
                row.append(t)
            rows.append(tuple(row))
        matrix = self._edges[key] = tuple(rows)
        return matrix

    def time(self, src: Sequence[PlacementLike], dst: Sequence[PlacementLike],
             shape: Sequence[int], itemsize: int) -> float:
        """Seconds to redistribute a tensor of GLOBAL ``shape`` (elements) with
        ``itemsize`` bytes per element from ``src`` to ``dst`` placements."""
        return self.time_ids(self.spec_id(src), self.spec_id(dst), tuple(shape), itemsize)

    def time_ids(self, src: int, dst: int, shape: tuple[int, ...], itemsize: int) -> float:
        """:meth:`time` with placements given by :meth:`spec_id` and ``shape`` a tuple."""
        key = (src, dst, shape, itemsize)
        t = self._times.get(key)
        if t is not None:
            return t
        if (shape, itemsize) not in self._checked:
            _check_tensor(shape, itemsize)
            self._checked.add((shape, itemsize))
        pkey = (src, dst, len(shape))
        plan = self._plans.get(pkey)
        if plan is None:
            plan = self._plans[pkey] = _plan(self.specs[src], self.specs[dst], len(shape),
                                             self.mesh_shape)
        t = _plan_time(plan, shape, itemsize, self.mesh_shape, self._redistribute_links,
                       self._collectives)
        self._times[key] = t
        return t
