"""Pipeline schedule models that follow what torch.distributed.pipelining runs.

Units: seconds (times), bytes (optional activation sizes), counts otherwise.

The face of the schedule modules, one job each:

* :mod:`costmodel.schedules.specs`: the schedules and their traits;
* :mod:`costmodel.schedules.types`: a rank's compute actions
  (:class:`ScheduleOp`) and a timed step (:class:`ScheduleResult`);
* :mod:`costmodel.schedules.torch_orders`: torch's per-rank compute orders, made by
  torch's own schedule classes on stand-in stages, and orders read from a
  compute-only CSV (:func:`load_csv_orders`);
* :mod:`costmodel.schedules.book`: a planning session's
  :class:`ScheduleBook` of orders per shape, :func:`rank_orders`,
  :func:`torch_orders` and :func:`peak_activations`;
* :mod:`costmodel.schedules.dependency`: the order in which every rank's
  actions can be timed in one pass;
* :mod:`costmodel.schedules.peaks`: peak live activations per rank;
* :mod:`costmodel.schedules.timing`: the timing model, :func:`simulate` and
  :func:`simulate_orders`.
"""

from __future__ import annotations

from costmodel.schedules.book import (ScheduleBook, peak_activations, rank_orders, schedule_shape,
                                     torch_orders)
from costmodel.schedules.specs import SCHEDULES, canonical_schedule, default_stages_per_rank
from costmodel.schedules.timing import simulate, simulate_orders
from costmodel.schedules.torch_orders import load_csv_orders
from costmodel.schedules.types import ScheduleOp, ScheduleResult, TimedAction

__all__ = [
    "SCHEDULES",
    "ScheduleBook",
    "ScheduleOp",
    "TimedAction",
    "ScheduleResult",
    "canonical_schedule",
    "default_stages_per_rank",
    "load_csv_orders",
    "peak_activations",
    "rank_orders",
    "schedule_shape",
    "simulate",
    "simulate_orders",
    "torch_orders",
]
