"""A planning session's schedule orders: torch's per-rank orders of each
schedule shape it asks for, kept with their dependency order and peaks.

Units: counts (ranks, micro-batches, stages, activations).

Nothing is kept between calls unless the caller passes a
:class:`ScheduleBook` (``book=``): it keeps each shape's orders, their
dependency order and peaks for as long as the caller holds it (a search
times one shape with many stage times). Without one, a throw-away book makes
them afresh for the call.
"""

from __future__ import annotations

from costmodel.schedules.dependency import DependencyOrder, dependency_order
from costmodel.schedules.peaks import live_activation_peaks
from costmodel.schedules.specs import SCHEDULE_SPECS, canonical_schedule
from costmodel.schedules.torch_orders import orders_from_torch
from costmodel.schedules.types import ScheduleOp, TorchOrders

__all__ = ["ScheduleBook", "Shape", "book_or_throwaway", "peak_activations", "rank_orders",
           "schedule_shape", "torch_orders"]


# A schedule shape: (canonical name, pp, micro-batches, stages per rank), as
# schedule_shape checks it.
Shape = tuple[str, int, int, int]


def schedule_shape(schedule: str, pp: int, num_microbatches: int,
                   stages_per_rank: int | None = None) -> Shape:
    """``(canonical name, pp, m, v)`` of a schedule, checked (``v``: the
    schedule's default when None); ``ValueError`` for counts that are not
    positive integers or stages per rank the schedule does not run. Whether
    torch accepts ``m`` is torch's to say, when its orders are made."""
    name = canonical_schedule(schedule)
    for label, val in (("pp", pp), ("num_microbatches", num_microbatches)):
        if isinstance(val, bool) or not isinstance(val, int) or val < 1:
            raise ValueError(f"{label} must be an integer >= 1, got {val!r}")
    return name, pp, num_microbatches, SCHEDULE_SPECS[name].stages_per_rank(stages_per_rank)


class ScheduleBook:
    """What one planning session keeps of each schedule shape (:data:`Shape`)
    it asks for: torch's orders and stage map, their dependency order and
    their peak live activations per rank, made on first use. It lives as
    long as its owner (a search's :class:`planner.search.context.SearchContext`;
    gpt3-175b on 1024 GPUs: ~100 shapes, ~400 MB) and is dropped with it.

    A forked worker fills its own copy; what it made comes back as values
    (:func:`torch_orders`), which :meth:`adopt` files here."""

    def __init__(self) -> None:
        self._orders: dict[Shape, TorchOrders] = {}
        self._dependency: dict[Shape, DependencyOrder] = {}
        self._peaks: dict[Shape, tuple[int, ...]] = {}

    def holds(self, schedule: str, pp: int, num_microbatches: int,
              stages_per_rank: int | None = None) -> bool:
        """Whether torch's orders of this shape are here already."""
        return schedule_shape(schedule, pp, num_microbatches, stages_per_rank) in self._orders

    def adopt(self, schedule: str, pp: int, num_microbatches: int,
              stages_per_rank: int | None, orders: TorchOrders) -> None:
        """File ``orders``, what :func:`torch_orders` gave for this shape in
        another process (a forked worker), so that torch is not asked again."""
        self._orders[schedule_shape(schedule, pp, num_microbatches, stages_per_rank)] = orders

    def orders(self, shape: Shape) -> TorchOrders:
        """Torch's orders and stage map of a checked ``shape``; torch's
        rejection as a ``ValueError``. Do not modify them."""
        found = self._orders.get(shape)
        if found is None:
            name, pp, m, v = shape
            try:
                found = orders_from_torch(name, pp, m, v)
            except (ValueError, AssertionError) as exc:
                raise ValueError(
                    f"torch's {SCHEDULE_SPECS[name].torch_class} rejects pp={pp}, "
                    f"num_microbatches={m}, stages_per_rank={v}: {exc}") from exc
            self._orders[shape] = found
        return found

    def dependency_order(self, shape: Shape) -> DependencyOrder:
        """:func:`costmodel.schedules.dependency.dependency_order` of the
        shape's orders (a search times one shape with many stage times)."""
        found = self._dependency.get(shape)
        if found is None:
            orders, s2r = self.orders(shape)
            found = self._dependency[shape] = dependency_order(orders, s2r, shape[0])
        return found

    def peaks(self, shape: Shape) -> tuple[int, ...]:
        """Per-rank peak live activations of the shape's orders."""
        found = self._peaks.get(shape)
        if found is None:
            peaks = live_activation_peaks(self.orders(shape)[0], shape[1], None)[0]
            found = self._peaks[shape] = tuple(peaks)
        return found


def book_or_throwaway(book: ScheduleBook | None) -> ScheduleBook:
    """``book``, or a throw-away one (nothing is kept beyond the call)."""
    return ScheduleBook() if book is None else book


def rank_orders(
    schedule: str,
    pp: int,
    num_microbatches: int,
    stages_per_rank: int | None = None,
    *,
    book: ScheduleBook | None = None,
) -> tuple[dict[int, list[ScheduleOp]], dict[int, int]]:
    """Per-rank compute-action order torch executes, and the stage -> rank map.

    Returns ``(orders, stage_to_rank)``; ``orders[rank]`` lists that rank's
    :class:`ScheduleOp` in execution order, with torch's OVERLAP_F_B actions
    flattened into their sub-actions (F first, as torch runs them). See
    :mod:`costmodel.schedules.torch_orders` for how each schedule's order is
    obtained. ``book`` keeps torch's orders for later calls (none: made
    afresh).
    """
    orders, s2r = torch_orders(schedule, pp, num_microbatches, stages_per_rank, book=book)
    return {r: [ScheduleOp._make(op) for op in o] for r, o in orders.items()}, dict(s2r)


def torch_orders(schedule: str, pp: int, num_microbatches: int,
                 stages_per_rank: int | None = None, *,
                 book: ScheduleBook | None = None) -> TorchOrders:
    """:func:`rank_orders` as ``book`` keeps them: each action a plain
    ``(kind, stage, micro-batch, overlap group)`` tuple. The value pickles
    quickly, for :meth:`ScheduleBook.adopt` in another process. Do not
    modify it."""
    shape = schedule_shape(schedule, pp, num_microbatches, stages_per_rank)
    return book_or_throwaway(book).orders(shape)


def peak_activations(schedule: str, pp: int, num_microbatches: int,
                     stages_per_rank: int | None = None, *,
                     book: ScheduleBook | None = None) -> tuple[list[int], dict[int, int]]:
    """Peak number of live activations per rank, and the stage -> rank map, of
    a schedule: what :func:`costmodel.schedules.simulate` reports as
    ``peak_activations``, from torch's order alone (the count changes only at
    a rank's own actions, so no timing is needed; a tenth of a simulation's
    cost at pp=64, m=256).
    ``book``: as for :func:`costmodel.schedules.simulate`."""
    shape = schedule_shape(schedule, pp, num_microbatches, stages_per_rank)
    book = book_or_throwaway(book)
    return list(book.peaks(shape)), dict(book.orders(shape)[1])
