"""Pipeline schedule models that follow what torch.distributed.pipelining runs.

Units: seconds (times), bytes (optional activation sizes), counts otherwise.

The face of the schedule modules, one job each:

* :mod:`costmodel.schedule_specs`: the schedules and their traits;
* :mod:`costmodel.schedule_types`: a rank's compute actions
  (:class:`ScheduleOp`) and a timed step (:class:`ScheduleResult`);
* :mod:`costmodel.schedule_torch`: torch's per-rank compute orders, made by
  torch's own schedule classes on stand-in stages, and orders read from a
  compute-only CSV (:func:`load_csv_orders`);
* :mod:`costmodel.schedule_book`: a planning session's
  :class:`ScheduleBook` of orders per shape, :func:`rank_orders`,
  :func:`torch_orders` and :func:`peak_activations`;
* :mod:`costmodel.schedule_dependency`: the order in which every rank's
  actions can be timed in one pass;
* :mod:`costmodel.schedule_peaks`: peak live activations per rank;
* :mod:`costmodel.schedule_timing`: the timing model, :func:`simulate` and
  :func:`simulate_orders`.
"""

from __future__ import annotations

from costmodel.schedule_book import (ScheduleBook, peak_activations, rank_orders, schedule_shape,
                                     torch_orders)
from costmodel.schedule_specs import SCHEDULES, canonical_schedule, default_stages_per_rank
from costmodel.schedule_timing import simulate, simulate_orders
from costmodel.schedule_torch import load_csv_orders
from costmodel.schedule_types import ScheduleOp, ScheduleResult, TimedAction

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
