"""The plan.json form of a DTensor placement: written and read back here only.

A tensor's layout on an N-D mesh is one DTensor placement per mesh axis; a
plan writes each as one string (whitespace inside is ignored on reading)::

    placement := "R"                    Replicate()
               | "S(" d ")"             Shard(d)
               | "S(" d ")[sf=" k "]"   _StridedShard(d, split_factor=k)  (torch private)
               | "P"                    Partial("sum")
               | "P(" op ")"            Partial(op), op in Partial's reduce ops
                                        other than sum (avg, min, max, product)
               | "P(mask)"              DTensor's masked partial  (torch private)
    d := decimal integer >= 0     (the tensor dim sharded)
    k := decimal integer >= 1     (the strided shard's split factor)

:func:`placement_str` writes it, :func:`parse_placement` reads every form a
plan may *request*, :func:`parse_planned` every form a plan may *hold*.
``"P(sum)"`` is read as ``"P"`` (never written). ``"P(mask)"`` is the partial
DTensor makes itself inside an embedding or gather lookup into a row-sharded
table: a plan records it and is checked against it, but it cannot be
requested, so only :func:`parse_planned` takes it (as None).

Shard dims are never negative: DTensor normalizes them (``distribute_tensor``,
``redistribute``, ``from_local`` and its sharding propagation store ``d + ndim``)
and the planner enumerates ``Shard(0)`` to ``Shard(ndim - 1)``, so no plan
holds ``S(-1)``; writing or reading one is refused.

The private placement types come from :mod:`ir.torch_compat`.
"""

from __future__ import annotations

import re
from typing import Sequence

from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from ir.torch_compat import is_mask_partial, is_strided_shard, strided_shard

__all__ = ["MASKED_PARTIAL", "PARTIAL_OPS", "parse_placement", "parse_placements", "parse_planned",
           "placement_str", "placement_strs"]

#: How a plan writes DTensor's masked partial: recorded and checked against,
#: never requested.
MASKED_PARTIAL = "P(mask)"

#: The reduce ops a ``P(op)`` may name (``"sum"`` is written ``P``).
PARTIAL_OPS: tuple[str, ...] = tuple(
    getattr(Partial, "ALL_REDUCE_OPS", ("sum", "avg", "min", "max", "product")))

# the fields of the two forms with arguments, each field any text up to its
# closing bracket: what is wrong with it is told by _count
_SHARD_RE = re.compile(r"S\((?P<dim>[^()]*)\)(?:\[sf=(?P<split>[^\[\]]*)\])?")
_PARTIAL_RE = re.compile(r"P(?:\((?P<op>[^()]*)\))?")

_ACCEPTED = (f"expected R, S(d), S(d)[sf=k], P or P(op) with d >= 0, k >= 1 and op one of "
             f"{', '.join(PARTIAL_OPS)}")


def placement_str(p: Placement) -> str:
    """The plan string of placement ``p`` (see the module's grammar).

    Raises:
        ValueError: ``p`` has no plan string (a negative shard dim, or not a
            DTensor placement).
    """
    kind = type(p)
    # the common types by identity first: a negative isinstance with torch's
    # placement types runs Python code (their metaclass's __instancecheck__)
    if kind is Replicate:
        return "R"
    if kind is Shard:
        return f"S({_written_dim(p)})"
    if kind is Partial:
        return _partial_str(p.reduce_op)
    if is_mask_partial(p):
        return MASKED_PARTIAL
    if is_strided_shard(p):
        return f"S({_written_dim(p)})[sf={p.split_factor}]"
    if isinstance(p, Shard):
        return f"S({_written_dim(p)})"
    if isinstance(p, Replicate):
        return "R"
    if isinstance(p, Partial):
        return _partial_str(p.reduce_op)
    raise ValueError(f"placement {p!r} has no plan string: it is not a DTensor Replicate, "
                     f"Shard, strided shard or Partial")


def placement_strs(placements: Sequence[Placement]) -> list[str]:
    """:func:`placement_str` of each placement (one per mesh axis)."""
    return [placement_str(p) for p in placements]


def _written_dim(p: Placement) -> int:
    if p.dim < 0:
        raise ValueError(f"placement {p!r} has no plan string: its shard dim {p.dim} is "
                         f"negative (plans hold dims normalized to d >= 0)")
    return p.dim


def _partial_str(reduce_op: str) -> str:
    return "P" if reduce_op == "sum" else f"P({reduce_op})"


def parse_placement(text: str) -> Placement:
    """The placement a plan requests with ``text``: ``"R"`` -> ``Replicate()``,
    ``"S(d)"`` -> ``Shard(d)``, ``"S(d)[sf=k]"`` -> a strided shard, ``"P"`` /
    ``"P(op)"`` -> ``Partial(op)``; the inverse of :func:`placement_str`.

    Raises:
        ValueError: ``text`` is ``"P(mask)"`` (DTensor makes it, a plan cannot
            request it) or not in the grammar; one line with the accepted forms.
    """
    if not isinstance(text, str):
        raise ValueError(f"placement must be a string, got {text!r}; {_ACCEPTED}")
    compact = re.sub(r"\s+", "", text)
    if compact == "R":
        return Replicate()
    if compact == MASKED_PARTIAL:
        raise ValueError(f"placement {text!r} is DTensor's masked partial, which it makes itself "
                         f"inside an embedding or gather lookup: a plan may record it, not "
                         f"request it; {_ACCEPTED}")
    shard = _SHARD_RE.fullmatch(compact)
    if shard:
        return _parse_shard(text, shard)
    partial = _PARTIAL_RE.fullmatch(compact)
    if partial:
        return _parse_partial(text, partial.group("op"))
    raise ValueError(f"unknown placement {text!r}; {_ACCEPTED}")


def parse_placements(texts: Sequence[str]) -> list[Placement]:
    """:func:`parse_placement` of each string (one per mesh axis)."""
    return [parse_placement(t) for t in texts]


def parse_planned(text: str) -> Placement | None:
    """A placement as a plan may hold it: :func:`parse_placement`, or None for
    :data:`MASKED_PARTIAL` (recorded and checked against, never requested).

    Raises:
        ValueError: a string no plan holds.
    """
    if isinstance(text, str) and re.sub(r"\s+", "", text) == MASKED_PARTIAL:
        return None
    return parse_placement(text)


def _parse_shard(text: str, match: re.Match) -> Placement:
    dim = _count(text, "shard dim", match.group("dim"), least=0)
    split = match.group("split")
    if split is None:
        return Shard(dim)
    return strided_shard(dim, _count(text, "split factor", split, least=1))


def _parse_partial(text: str, op: str | None) -> Placement:
    if op is None:
        return Partial("sum")
    if op not in PARTIAL_OPS:
        raise ValueError(f"placement {text!r}: unknown reduce op {op!r}; {_ACCEPTED}")
    return Partial(op)


def _count(text: str, what: str, field: str, least: int) -> int:
    """``field`` of placement ``text`` as an int of at least ``least``."""
    if not re.fullmatch(r"-?\d+", field):
        raise ValueError(f"placement {text!r}: {what} {field!r} is not an integer; {_ACCEPTED}")
    value = int(field)
    if value < least:
        raise ValueError(f"placement {text!r}: {what} {value} must be >= {least}; {_ACCEPTED}")
    return value
