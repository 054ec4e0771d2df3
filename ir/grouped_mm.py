"""The grouped expert matmul of Hugging Face MoE layers: its FLOPs, its DTensor
sharding, and how a rank runs it sharded.

transformers 5 runs a MoE layer's experts as grouped matmuls over the
(token, expert) pairs sorted by expert (``integrations/moe.py``,
``grouped_mm_experts_forward``); the program torch.export captures calls
``transformers::grouped_mm_fallback(x [S, K], w [E, K, N], offs [E]) -> y [S, N]``:
rows ``offs[e-1]:offs[e]`` of ``x`` times ``w[e]`` (``offs`` the cumulative
row counts, data-dependent; rows past ``offs[-1]`` stay zero). DTensor has no
strategy for it. Per mesh axis this module places it one of these ways
(``offs`` always replicated):

======  =====  =====  =====  =========================================================
kind    x      w      y      what a rank computes
======  =====  =====  =====  =========================================================
``R``   R      R      R      everything
``P``   P      R      P      its partial sum of x, through the (linear) op
``COL`` R      S(2)   S(1)   its columns of every expert
``ROW`` S(1)   S(1)   P      its part of the contraction
``TOK`` S(0)   R      S(0)   its even share of the sorted rows, with every expert
``EP``  S(0)   S(0)   S(0)   expert parallelism: it holds E/n experts; its share of
                             the rows goes to the ranks holding their experts and the
                             products come back, an all-to-all each way whose sizes
                             every rank reads from ``offs``
======  =====  =====  =====  =========================================================

Expert parallelism is on one mesh axis of a strategy (its all-to-all runs on
that axis's process group). The backward op ``grouped_mm_fallback_backward``
(``x, w, offs, dy -> dx, dw``) follows the forward's kinds. Both run through
DTensor's custom op handlers (:func:`ir.torch_compat.register_dtensor_handler`);
the planner reads the forward's strategies from DTensor like any op's and the
cost model prices the ``EP`` all-to-alls (:func:`exchange_axis`). torch's own
kernel, ``aten._grouped_mm``, which transformers calls instead where it runs
(bf16 captures), is sharded with the same kinds by :mod:`ir.grouped_mm_aten`.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import torch
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from ir.torch_compat import register_dtensor_handler, register_sharding_rule

__all__ = ["ATEN_GROUPED_MM", "BACKWARD_EXCHANGES", "GROUPED_MATMULS", "GROUPED_MM",
           "exchange_axis", "gradient_placements", "grouped_forward", "grouped_mm_flops",
           "register_grouped_mm_sharding"]

#: torch's own grouped matmul (``str`` of the op), which transformers calls
#: instead of its fallback where torch's kernel runs (bf16 captures).
ATEN_GROUPED_MM = "aten._grouped_mm.default"

#: The captured node targets of the grouped expert matmuls this package shards
#: (``str`` of the op): transformers' fallback here, torch's own kernel in
#: :mod:`ir.grouped_mm_aten`.
GROUPED_MM = ("transformers.grouped_mm_fallback.default", ATEN_GROUPED_MM)

#: Every grouped matmul target whose FLOPs :func:`grouped_mm_flops` counts.
GROUPED_MATMULS = GROUPED_MM

#: target -> (x-sized, y-sized) all-to-alls of an ``EP`` node's backward:
#: the fallback's backward moves x and dy to the experts and dx back; torch's
#: moves dy twice (its weight gradient and its dx are two calls).
BACKWARD_EXCHANGES = {GROUPED_MM[0]: (2, 1), ATEN_GROUPED_MM: (2, 2)}

_R, _P = Replicate(), Partial()
_S0, _S1, _S2 = Shard(0), Shard(1), Shard(2)

#: kind -> placements of (x, w, y, dy, dx, dw) on one mesh axis (module docstring);
#: ``P`` keeps x's own partial placement.
_KINDS = {
    "R": (_R, _R, _R, _R, _R, _R),
    "P": (_P, _R, _P, _R, _R, _P),
    "COL": (_R, _S2, _S1, _S1, _P, _S2),
    "ROW": (_S1, _S1, _P, _R, _S1, _S1),
    "TOK": (_S0, _R, _S0, _S0, _S0, _P),
    "EP": (_S0, _S0, _S0, _S0, _S0, _S0),
}


def grouped_mm_flops(x_shape: Sequence[int], w_shape: Sequence[int]) -> float:
    """Forward FLOPs of a grouped matmul of ``x`` by ``w``: every row of x
    meets one group's weight. ``x [S, K]`` by ``w [E, K, N]``: ``2 S K N``
    (rows past ``offs[-1]`` counted too); torch's other forms alike (groups
    of rows, of the contraction or of batches: ``2 numel(x) N``), except
    ``x [E, M, K]`` by ``w [K, N]``, groups of N's columns (``2 M K N``)."""
    numel = float(torch.Size([int(d) for d in x_shape]).numel())
    if len(x_shape) == 3 and len(w_shape) == 2:
        numel /= int(x_shape[0])
    return 2.0 * numel * int(w_shape[-1])


def exchange_axis(target: str, inputs: Sequence[Sequence[Any]],
                  ranks: Sequence[int] | None = None) -> int | None:
    """The mesh axis whose all-to-all a grouped matmul node ``target`` runs
    under a strategy whose input placements are ``inputs`` (x, w, offs): the
    axis where x and w are both ``Shard(0)`` (``EP``); None for other ops and
    strategies. ``ranks``: the number of dims of x and w, needed for torch's
    op, whose forms other than x 2-D by w 3-D exchange nothing (its 3-D by
    3-D batches shard dim 0 of both too).

    Raises:
        ValueError: ``ranks`` not given for torch's op.
    """
    if target not in GROUPED_MM or len(inputs) < 2:
        return None
    if target == ATEN_GROUPED_MM:
        if ranks is None:
            raise ValueError(f"exchange_axis: {target} needs the ranks of x and w")
        if tuple(ranks[:2]) != (2, 3):
            return None
    for a, (px, pw) in enumerate(zip(inputs[0], inputs[1])):
        if _is_shard(px, 0) and _is_shard(pw, 0):
            return a
    return None


def register_grouped_mm_sharding() -> bool:
    """Give DTensor transformers' grouped matmul's strategies and its sharded
    runs (forward and backward), once per process; False when the op is not
    registered (transformers not imported yet). torch's own op:
    :func:`ir.grouped_mm_aten.register_aten_grouped_mm_sharding`."""
    ops = _ops()
    if ops is not None:
        _register(*ops)
    return ops is not None


@functools.lru_cache(maxsize=1)
def _register(forward: Any, backward: Any) -> None:
    register_sharding_rule(forward, _rule, keep=_one_expert_axis)
    register_dtensor_handler(forward, _run_forward)
    register_dtensor_handler(backward, _run_backward)


def _ops() -> tuple[Any, Any] | None:
    namespace = torch.ops.transformers
    if not (hasattr(namespace, "grouped_mm_fallback")
            and hasattr(namespace, "grouped_mm_fallback_backward")):
        return None
    return namespace.grouped_mm_fallback.default, namespace.grouped_mm_fallback_backward.default


def _is_shard(p: Any, dim: int) -> bool:
    return isinstance(p, Shard) and p.dim == dim


def _rule(x: Any, w: Any, offs: Any) -> list[tuple[list, list]]:  # noqa: ARG001 - op signature
    """The single-axis strategies: ``([y], [x, w, offs])`` of each kind."""
    return [([y], [px, pw, _R]) for px, pw, y, *_ in _KINDS.values()]


def _one_expert_axis(inputs: list[tuple]) -> bool:
    """Keep combinations sharding the experts on one mesh axis at most."""
    return sum(_is_shard(p, 0) for p in inputs[1]) <= 1


def _kinds(x_placements: Sequence[Any], w_placements: Sequence[Any]) -> list[str]:
    """Each mesh axis's kind, read from where x and w are: the weight's
    placement decides (experts sharded on the first such axis only; x follows
    it), and where w is whole, x's (rows sharded: ``TOK``; a partial sum:
    ``P``; otherwise ``R``)."""
    kinds, expert_axis = [], False
    for px, pw in zip(x_placements, w_placements):
        if _is_shard(pw, 0) and not expert_axis:
            kind, expert_axis = "EP", True
        elif _is_shard(pw, 2):
            kind = "COL"
        elif _is_shard(pw, 1):
            kind = "ROW"
        elif _is_shard(px, 0):
            kind = "TOK"
        else:
            kind = "P" if isinstance(px, Partial) else "R"
        kinds.append(kind)
    return kinds


def _placements(kinds: list[str], which: int, keep: Sequence[Any] | None = None) -> tuple:
    """Placements of tensor ``which`` (0 x, 1 w, 2 y, 3 dy, 4 dx, 5 dw) for
    ``kinds``; on ``P`` axes a partial placement of ``keep`` (x's) is kept."""
    out = []
    for a, kind in enumerate(kinds):
        p = _KINDS[kind][which]
        if isinstance(p, Partial) and keep is not None and isinstance(keep[a], Partial):
            p = keep[a]
        out.append(p)
    return tuple(out)


def _placed(value: Any, placements: tuple) -> Any:
    return value if tuple(value.placements) == placements else value.redistribute(
        value.device_mesh, placements)


def _block(size: int, placements: Sequence[Any], mesh_shape: Sequence[int],
           coordinate: Sequence[int]) -> tuple[int, int]:
    """``[lo, hi)`` of dim 0 that the rank at ``coordinate`` holds of a tensor
    of ``size`` rows under ``placements`` (DTensor's chunks, mesh axes in order)."""
    lo, n = 0, size
    for p, count, c in zip(placements, mesh_shape, coordinate):
        if _is_shard(p, 0):
            chunk = -(-n // count)
            start = min(c * chunk, n)
            lo, n = lo + start, min(n, start + chunk) - start
    return lo, lo + n


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> int:
    return max(0, min(a[1], b[1]) - max(a[0], b[0]))


class _Rows:
    """Which sorted rows and experts this rank computes, and (``EP``) the
    all-to-all that brings its share of the rows to the ranks holding their
    experts and back.

    Args:
        mesh: the DeviceMesh.
        kinds: each axis's kind (:func:`_kinds`).
        rows, row_placements: the number of sorted rows (x's dim 0) and
            their placements (x's, placed).
        expert_placements: placements whose ``Shard(0)`` axes split the
            experts (the placed weight's).
        ends: ``offs`` as Python ints (one per expert).
    """

    def __init__(self, mesh: Any, kinds: list[str], rows: int, row_placements: Sequence[Any],
                 expert_placements: Sequence[Any], ends: list[int]):
        coordinate = list(mesh.get_coordinate())
        shape, experts = tuple(mesh.shape), len(ends)
        x_p, w_p = row_placements, expert_placements
        self.ends = ends
        self.mine = _block(rows, x_p, shape, coordinate)
        self.experts = _block(experts, w_p, shape, coordinate)
        self.axis = kinds.index("EP") if "EP" in kinds else None
        self.group = None if self.axis is None else mesh.get_group(self.axis)
        if self.axis is None:
            self.send = self.recv = []
            self.counts = [_overlap(self.mine, self._rows_of(e)) for e in range(*self.experts)]
            return
        peers = []
        for j in range(shape[self.axis]):
            coordinate[self.axis] = j
            peers.append((_block(rows, x_p, shape, coordinate),
                          self._expert_rows(_block(experts, w_p, shape, coordinate))))
        own_rows = self._expert_rows(self.experts)
        self.send = [_overlap(self.mine, theirs) for _, theirs in peers]
        self.recv = [_overlap(held, own_rows) for held, _ in peers]
        self.counts = [sum(_overlap(held, self._rows_of(e)) for held, _ in peers)
                       for e in range(*self.experts)]

    def _rows_of(self, e: int) -> tuple[int, int]:
        return (self.ends[e - 1] if e else 0), self.ends[e]

    def _expert_rows(self, experts: tuple[int, int]) -> tuple[int, int]:
        lo, hi = experts
        return (self._rows_of(lo)[0], self._rows_of(hi - 1)[1]) if hi > lo else (0, 0)

    def offsets(self, device: torch.device) -> torch.Tensor:
        """The local experts' cumulative row counts among the rows computed here."""
        counts = torch.tensor(self.counts, dtype=torch.int64, device=device)
        return torch.cumsum(counts, 0).to(torch.int32)

    def to_experts(self, local: torch.Tensor) -> torch.Tensor:
        """This rank's rows ``local`` -> the rows of its experts (``EP``)."""
        if self.axis is None:
            return local
        return self._all_to_all(local[:sum(self.send)], self.send, self.recv)

    def from_experts(self, computed: torch.Tensor, rows: int) -> torch.Tensor:
        """The rows of its experts ``computed`` -> this rank's ``rows`` rows
        (rows of no expert stay zero)."""
        if self.axis is None:
            return computed
        back = self._all_to_all(computed, self.recv, self.send)
        if back.shape[0] == rows:
            return back
        out = back.new_zeros((rows,) + tuple(back.shape[1:]))
        out[:back.shape[0]] = back
        return out

    def _all_to_all(self, t: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        import torch.distributed as dist

        t = t.contiguous()
        out = t.new_empty((sum(recv),) + tuple(t.shape[1:]))
        dist.all_to_all_single(out, t, output_split_sizes=recv, input_split_sizes=send,
                               group=self.group)
        return out


def _arguments(args: tuple, kwargs: dict, names: Sequence[str]) -> list[Any]:
    bound = dict(zip(names, args))
    bound.update(kwargs)
    return [bound[n] for n in names]


def _as_dtensor(value: Any, mesh: Any) -> Any:
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return value
    return DTensor.from_local(value, mesh, [_R] * mesh.ndim, run_check=False)


def _wrap(local: torch.Tensor, mesh: Any, placements: tuple, shape: Sequence[int]) -> Any:
    from torch.distributed.tensor import DTensor

    shape = tuple(int(d) for d in shape)
    stride = tuple(int(torch.Size(shape[i + 1:]).numel()) for i in range(len(shape)))
    return DTensor.from_local(local.contiguous(), mesh, placements, run_check=False,
                              shape=shape, stride=stride)


def _prepare(x: Any, w: Any, offs: Any) -> tuple[list[str], Any, Any, _Rows]:
    """x, w and offs brought to a strategy's placements; the kinds and rows."""
    kinds = _kinds(x.placements, w.placements)
    x = _placed(x, _placements(kinds, 0, x.placements))
    w = _placed(w, _placements(kinds, 1))
    return kinds, x, w, _rows(kinds, x, w.placements, offs)


def _rows(kinds: list[str], x: Any, expert_placements: Sequence[Any], offs: Any) -> _Rows:
    """The :class:`_Rows` of placed ``x`` (the sorted rows on dim 0) and
    experts placed as ``expert_placements``; ``offs`` read on every rank."""
    mesh = x.device_mesh
    ends = _placed(_as_dtensor(offs, mesh), (_R,) * mesh.ndim).to_local().tolist()
    rows = _Rows(mesh, kinds, int(x.shape[0]), x.placements, expert_placements,
                 [int(e) for e in ends])
    if x.to_local().shape[0] != rows.mine[1] - rows.mine[0]:
        raise RuntimeError(f"grouped matmul: this rank holds {x.to_local().shape[0]} rows of "
                           f"x {list(x.shape)} {list(x.placements)}, expected rows "
                           f"{rows.mine[0]}:{rows.mine[1]}")
    return rows


def _run_forward(op: Any, args: tuple, kwargs: dict) -> Any:
    """``grouped_mm_fallback`` on DTensors (the module docstring's kinds)."""
    x, w, offs = _arguments(args, kwargs, ("input", "weight", "offs"))
    return grouped_forward(op, x, w, offs)


def grouped_forward(call: Any, x: Any, w: Any, offs: Any) -> Any:
    """``y = call(x, w, offs)`` of the forward form (``x [S, K]`` by
    ``w [E, K, N]``) on DTensors x and w, placed by their kinds (the module
    docstring's); ``call`` runs on the local tensors. Rows past ``offs[-1]``
    come out zero."""
    with torch.no_grad():
        kinds, x, w, rows = _prepare(x, w, offs)
        xl, wl = x.to_local(), w.to_local()
        y = call(rows.to_experts(xl), wl, rows.offsets(xl.device))
        if y.shape[0] > sum(rows.counts):
            y[sum(rows.counts):] = 0
        y = rows.from_experts(y, xl.shape[0])
        return _wrap(y, x.device_mesh, _placements(kinds, 2, x.placements),
                     (x.shape[0], w.shape[2]))


def gradient_placements(kinds: list[str], dy: Sequence[Any],
                        keep: Sequence[Any]) -> tuple[tuple, tuple, tuple]:
    """Placements of ``(dy, dx, dw)`` under ``kinds`` (the module docstring's
    table), dy's partial sum kept where everything is replicated (dx and dw
    come out partial) and ``keep``'s (x's) on ``P`` axes of dw."""
    want = list(_placements(kinds, 3))
    dx_p, dw_p = list(_placements(kinds, 4)), list(_placements(kinds, 5, keep))
    for a, kind in enumerate(kinds):
        if kind == "R" and isinstance(dy[a], Partial):
            want[a] = dx_p[a] = dw_p[a] = dy[a]
    return tuple(want), tuple(dx_p), tuple(dw_p)


def _run_backward(op: Any, args: tuple, kwargs: dict) -> Any:
    """``grouped_mm_fallback_backward`` on DTensors: the gradient of y brought
    to the placements the forward's kinds give it (:func:`gradient_placements`)."""
    x, w, offs, dy = _arguments(args, kwargs, ("input", "weight", "offs", "grad_output"))
    with torch.no_grad():
        kinds, x, w, rows = _prepare(x, w, offs)
        want, dx_p, dw_p = gradient_placements(kinds, dy.placements, x.placements)
        dy = _placed(dy, want)
        xl, wl, dyl = x.to_local(), w.to_local(), dy.to_local()
        dx, dw = op(rows.to_experts(xl), wl, rows.offsets(xl.device), rows.to_experts(dyl))
        dx = rows.from_experts(dx, xl.shape[0])
        mesh = x.device_mesh
        return (_wrap(dx, mesh, dx_p, x.shape), _wrap(dw, mesh, dw_p, w.shape))
