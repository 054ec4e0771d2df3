"""The timing of one training step of a pipeline schedule: the model.

Units: seconds (times), bytes (optional activation sizes), counts otherwise.

For one training step of a pipeline with ``pp`` ranks, ``v`` stages per rank
(``S = pp * v`` stages in all) and ``m`` micro-batches, :func:`simulate`
times torch's own per-rank order (:mod:`costmodel.schedules.torch_orders`) and
:func:`simulate_orders` any given orders: the step time, the bubble, per-rank
busy and idle time, the peak number of micro-batch stage activations alive
on every rank (:mod:`costmodel.schedules.peaks`) and the full timeline (rank,
action, start, end).

Torch has no timing model (its ``_simulate_comms_compute`` counts lock-step
slots only), so the timing below is this module's:

* Durations, per *global* stage ``s``: ``F`` takes ``f[s]``; a split backward
  takes ``b[s]`` for BACKWARD_INPUT (``I``) and ``w[s]`` for BACKWARD_WEIGHT
  (``W``); a FULL_BACKWARD (``B``) takes ``b[s] + w[s]``. So ``b`` is the
  input-gradient part and ``w`` the weight-gradient part of one backward, and
  the same (f, b, w) drive split and unsplit schedules.
* Dependencies (:mod:`costmodel.schedules.dependency`): ``F(s, j)`` after
  ``F(s-1, j)``; ``B|I(s, j)`` after ``F(s, j)`` and after ``B|I(s+1, j)``;
  ``W(s, j)`` after ``I(s, j)``. A dependency between stages on different
  ranks adds ``p2p[boundary]`` seconds (the same in both directions); stages
  on the same rank pass tensors locally, as torch does, at no cost.
* Each rank executes its actions in torch's order, one at a time, each as
  soon as the previous one on that rank has ended and its inputs have
  arrived (in-order list scheduling). Sends are asynchronous and never block
  the sender (the runtime ``isend``s and waits for sends only at the end of
  the step); transfers do not occupy compute.
* OVERLAP_F_B (DualPipeV): torch's default runtime executes the two
  sub-actions one after the other (``for sub_a in action.sub_actions:
  _perform_action(sub_a)``), so they are timed as F then B in sequence, each
  waiting for its own inputs: the pair costs the *sum*. Their timeline entries
  carry the same ``overlap_group``. (Real overlap needs a custom function
  registered with ``register_custom_function``; not modelled.)

Bubble definitions
------------------
* ``bubble_ratio`` = (step_time - ideal) / ideal, ideal = the busiest rank's
  compute time: the Megatron-LM ``t_bubble / t_ideal``. With equal stages and
  no p2p it is ``(pp-1)/m`` for GPipe and 1F1B and ``(pp-1)/(v m)`` for
  interleaved 1F1B.
* ``bubble_fraction`` = total idle device-time / (pp * step_time): the share
  of device-seconds spent waiting.

Not modelled (differences from a real run)
------------------------------------------
* Schedule1F1B fuses its p2p into ``batch_isend_irecv`` pairs (fwd-send with
  bwd-recv, bwd-send with fwd-recv) and waits for the whole batch, so a rank
  also waits until its *send* is matched. This rendezvous is not modelled:
  sends are treated as fire-and-forget like in ``_PipelineScheduleRuntime``.
* No contention between transfers, no compute slowdown from concurrent
  communication, no REDUCE_GRAD / FSDP unshard time, no loss-function time
  beyond what is folded into the last stage's ``f``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Union

from costmodel.schedules.book import ScheduleBook, book_or_throwaway, schedule_shape
from costmodel.schedules.dependency import DependencyOrder, dependency_order
from costmodel.schedules.peaks import live_activation_peaks
from costmodel.schedules.types import ScheduleOp, ScheduleResult, TimedAction

__all__ = ["PerStage", "simulate", "simulate_orders"]

Number = Union[int, float]
PerStage = Union[Number, Sequence[Number]]


def _per_stage(values: PerStage, n: int, label: str, allow_none: bool = False) -> list[float] | None:
    """``values`` (``label``: its name in errors) as ``n`` checked finite
    values >= 0: a number repeated, or a sequence of ``n``; None stays None
    where ``allow_none``."""
    if values is None and allow_none:
        return None
    if isinstance(values, (int, float)) and not isinstance(values, bool):
        out = [float(values)] * n
    else:
        try:
            out = [float(x) for x in values]  # type: ignore[union-attr]
        except TypeError:
            raise TypeError(f"{label} must be a number or a sequence of numbers, got {values!r}") from None
        if len(out) != n:
            unit = "stage boundary" if label == "p2p" else "stage"
            raise ValueError(f"{label} needs {n} values (one per {unit}), got {len(out)}")
    for x in out:
        if not x >= 0 or x == float("inf"):
            raise ValueError(f"{label} must be finite and >= 0, got {x!r}")
    return out


def simulate(
    schedule: str,
    pp: int,
    num_microbatches: int,
    f: PerStage,
    b: PerStage,
    w: PerStage = 0.0,
    p2p: PerStage = 0.0,
    stages_per_rank: int | None = None,
    activation_bytes: PerStage | None = None,
    timeline: bool = True,
    *,
    book: ScheduleBook | None = None,
) -> ScheduleResult:
    """Time one training step of a pipeline schedule as torch executes it.

    Args:
        schedule: a name of :data:`costmodel.schedules.specs.SCHEDULES` (or
            torch's class / short name).
        pp: pipeline ranks.
        num_microbatches: micro-batches per step, ``m``.
        f, b, w: seconds of forward, backward-input and backward-weight of one
            micro-batch, per global stage (a number for all stages, or
            ``pp * stages_per_rank`` values in stage order). A full backward
            (torch's B) takes ``b + w``.
        p2p: seconds to move one micro-batch's activation (or its gradient)
            across stage boundary ``s -> s+1`` when the two stages are on
            different ranks: a number, or ``num_stages - 1`` values.
        stages_per_rank: ``v``; default 1 for gpipe/1f1b, 2 otherwise
            (zbv and dualpipev require 2).
        activation_bytes: optional bytes one micro-batch's saved activations
            take per stage; gives ``peak_activation_bytes``.
        timeline: build the result's per-action timeline (else it is empty).
        book: keeps torch's orders, their dependency order and peaks for
            later calls of the same shape (none: made afresh, not kept).

    Returns:
        :class:`ScheduleResult`. See the module docstring for the model.
    """
    shape = schedule_shape(schedule, pp, num_microbatches, stages_per_rank)
    name, pp, m, v = shape
    book = book_or_throwaway(book)
    orders, s2r = book.orders(shape)
    return _simulate_order(book.dependency_order(shape), orders, s2r,
                           *_stage_values(pp * v, f, b, w, p2p, activation_bytes),
                           name, m, timeline, list(book.peaks(shape)))


def simulate_orders(
    orders: dict[int, Sequence[ScheduleOp]],
    stage_to_rank: dict[int, int],
    f: PerStage,
    b: PerStage,
    w: PerStage = 0.0,
    p2p: PerStage = 0.0,
    activation_bytes: PerStage | None = None,
    schedule: str = "custom",
    num_microbatches: int | None = None,
    timeline: bool = True,
) -> ScheduleResult:
    """The timing model of :func:`simulate` applied to given per-rank orders.

    ``orders[rank]`` is that rank's compute actions in execution order (as
    :func:`costmodel.schedules.book.rank_orders` or
    :func:`costmodel.schedules.torch_orders.load_csv_orders` return them) and
    ``stage_to_rank`` places every global stage. Raises ``ValueError`` when the
    orders deadlock (an action waits for one that can never run). Without
    ``timeline`` the result's timeline is empty (the step and busy times are
    the same; a search that needs only them skips building it).
    """
    name = schedule
    s2r = {int(s): int(r) for s, r in stage_to_rank.items()}
    pp = len(orders)
    if sorted(orders) != list(range(pp)):
        raise ValueError(f"orders must be keyed by ranks 0..{pp - 1}, got {sorted(orders)}")
    if sorted(s2r) != list(range(len(s2r))) or not s2r:
        raise ValueError(f"stage_to_rank must map stages 0..S-1, got {sorted(s2r)}")
    S = len(s2r)
    if S % pp != 0:
        raise ValueError(f"{S} stages do not divide evenly over {pp} ranks")
    if num_microbatches is None:
        num_microbatches = 1 + max((op.microbatch for o in orders.values() for op in o), default=0)
    m = num_microbatches
    for r, order in orders.items():
        for op in order:
            if op.kind not in ("F", "B", "I", "W"):
                raise ValueError(f"rank {r}: unexpected action kind {op.kind!r} in {op}")
            if not isinstance(op.microbatch, int) or op.microbatch < 0:
                raise ValueError(f"rank {r}: micro-batch index of {op} must be an int >= 0")
            if s2r.get(op.stage) != r:
                raise ValueError(
                    f"rank {r}: action {op} is for stage {op.stage}, "
                    f"which stage_to_rank puts on rank {s2r.get(op.stage)}"
                )
    order = dependency_order(orders, s2r, name)
    return _simulate_order(order, orders, s2r, *_stage_values(S, f, b, w, p2p, activation_bytes),
                           name, m, timeline)


def _stage_values(S: int, f: PerStage, b: PerStage, w: PerStage, p2p: PerStage,
                  activation_bytes: PerStage | None) -> tuple:
    """(f, b, w, p2p, activation bytes) as lists: one value per stage (per
    boundary for p2p; None for absent activation bytes), checked."""
    return (_per_stage(f, S, "f"), _per_stage(b, S, "b"), _per_stage(w, S, "w"),
            _per_stage(p2p, max(S - 1, 0), "p2p") if S > 1 else [],
            _per_stage(activation_bytes, S, "activation_bytes", allow_none=True))


def _simulate_order(order: DependencyOrder, orders: dict[int, Sequence[ScheduleOp]],
                    s2r: dict[int, int], fs: list[float], bs: list[float], ws: list[float],
                    lat: list[float], act_b: list[float] | None, name: str, m: int,
                    with_timeline: bool, peaks: list[int] | None = None) -> ScheduleResult:
    """Time ``order`` (from :func:`costmodel.schedules.dependency.dependency_order`):
    each action starts when its rank is free and what it waits for has ended
    (plus the p2p latency across ranks), and lasts its stage's f, b, w or
    b + w seconds.
    ``peaks``: the orders' peak live activations per rank when known."""
    pp = len(orders)
    v = len(s2r) // pp
    # seconds by duration code (kind * stages + stage, kinds F B I W as in
    # DependencyOrder.steps); p2p seconds by boundary, the last entry 0.0
    # for "no boundary" (-1)
    duration = [*fs, *(b + w for b, w in zip(bs, ws)), *bs, *ws]
    delay = [*lat, 0.0]
    ends: list[float] = []
    end_at = ends.append
    starts: list[float] = []
    start_at = starts.append if with_timeline else None
    free_at = [0.0] * pp
    busy = [0.0] * pp
    for r, code, a1, b1, a2, b2 in order.steps:
        start = free_at[r]
        if a1 >= 0:
            t = ends[a1] + delay[b1]
            if t > start:
                start = t
            if a2 >= 0:
                t = ends[a2] + delay[b2]
                if t > start:
                    start = t
        end = start + duration[code]
        end_at(end)
        if start_at is not None:
            start_at(start)
        free_at[r] = end
        busy[r] += end - start
    timeline = [TimedAction(step[0], str(op), op.kind, op.stage, op.microbatch, starts[k],
                            ends[k], op.overlap_group)
                for k, (step, op) in enumerate(zip(order.steps, map(ScheduleOp._make, order.ops)))
                ] if with_timeline else []
    # a rank's actions end in order, so its last ends latest
    step_time = max(free_at, default=0.0)
    idle = [step_time - x for x in busy]
    ideal = max(busy) if busy else 0.0
    bubble_ratio = (step_time - ideal) / ideal if ideal > 0 else 0.0
    bubble_fraction = sum(idle) / (pp * step_time) if step_time > 0 else 0.0

    if peaks is None or act_b is not None:
        peaks, peak_bytes = live_activation_peaks(orders, pp, act_b)
    else:
        peak_bytes = None
    timeline.sort(key=lambda a: a.rank)  # stable: each rank keeps its execution order
    return ScheduleResult(
        schedule=name,
        pp=pp,
        stages_per_rank=v,
        num_microbatches=m,
        step_time=step_time,
        busy=busy,
        idle=idle,
        bubble_ratio=bubble_ratio,
        bubble_fraction=bubble_fraction,
        peak_activations=peaks,
        peak_activation_bytes=peak_bytes,
        stage_to_rank=dict(s2r),
        timeline=timeline,
    )
