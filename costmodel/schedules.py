"""Pipeline schedule models that follow what torch.distributed.pipelining runs.

Units: seconds (times), bytes (optional activation sizes), counts otherwise.

For one training step of a pipeline with ``pp`` ranks, ``v`` stages per rank
(``S = pp * v`` stages in all) and ``m`` micro-batches, :func:`simulate`
gives the step time, the bubble, per-rank busy and idle time, the peak number
of micro-batch stage activations alive on every rank, and the full timeline
(rank, action, start, end).

Where the per-rank action order comes from
------------------------------------------
The order is always torch's own; nothing here re-derives a schedule.

* ``gpipe``, ``1f1b`` (``ScheduleGPipe``, ``Schedule1F1B``, one stage per
  rank): these classes run ``_step_microbatches`` directly, not from an action
  list. :func:`rank_orders` constructs the torch class on a small recording
  stand-in stage (it answers ``num_stages``/``stage_index``/``is_first``/
  ``is_last``, returns no p2p ops and records every ``forward_one_chunk`` /
  ``backward_one_chunk`` call) and calls torch's ``_step_microbatches`` once
  per rank. The recorded calls *are* the executed order. (Their
  ``_get_pipeline_order()`` IR is torch's visualization of the same thing; the
  tests check that both agree.) Both call ``backward_one_chunk`` with the
  default ``full_backward=True``, i.e. a FULL_BACKWARD ``B``.
* ``interleaved_1f1b``, ``looped_bfs``, ``interleaved_zero_bubble``, ``zbv``,
  ``dualpipev`` (``ScheduleInterleaved1F1B``, ``ScheduleLoopedBFS``,
  ``ScheduleInterleavedZeroBubble``, ``ScheduleZBVZeroBubble``,
  ``ScheduleDualPipeV``): these are ``_PipelineScheduleRuntime`` subclasses
  whose ``__init__`` computes ``pipeline_order`` for *all* ranks (with
  ``_calculate_single_rank_operations``) and lowers it with
  ``_prepare_schedule_with_comms`` to ``pipeline_order_with_comms``, the list
  the runtime's ``_step_microbatches`` walks one action at a time. The
  constructors only read ``num_stages``, ``group_size``, ``group_rank`` and
  ``submod`` (None: skips the torch.compile check) of the stage objects and
  write ``stage_index_to_group_rank``, so they are built here with minimal
  stand-in stages (no process group, no model), and without the lowering,
  which only inserts communication, FSDP UNSHARD/RESHARD and REDUCE_GRAD
  actions around each rank's compute actions (and costs 15-30x the rest). The
  compute actions of ``pipeline_order[rank]`` (F, B, I, W, OVERLAP_F_B), which
  are those of ``pipeline_order_with_comms[rank]`` in the same order (the
  tests check it), are the order used, and
  torch's inferred ``stage_index_to_group_rank`` gives the stage placement
  (loop style ``s % pp``; V style for zbv/dualpipev).

* A custom schedule written as torch's compute-only CSV (what
  ``_PipelineScheduleRuntime._load_csv`` accepts) is read by
  :func:`load_csv_orders` with torch's ``_Action.from_str`` and checked with
  torch's ``_validate_schedule``; :func:`simulate_orders` times any orders.

Torch's validation errors (1F1B with ``m < pp``, DualPipeV with
``m < 2 pp``, interleaved schedules whose ``m`` is not a multiple of
``max(1, m // pp)``, ...) come out as ``ValueError``.

What is written here (the timing model)
---------------------------------------
Torch has no timing model (its ``_simulate_comms_compute`` counts lock-step
slots only), so the timing below is this module's:

* Durations, per *global* stage ``s``: ``F`` takes ``f[s]``; a split backward
  takes ``b[s]`` for BACKWARD_INPUT (``I``) and ``w[s]`` for BACKWARD_WEIGHT
  (``W``); a FULL_BACKWARD (``B``) takes ``b[s] + w[s]``. So ``b`` is the
  input-gradient part and ``w`` the weight-gradient part of one backward, and
  the same (f, b, w) drive split and unsplit schedules.
* Dependencies: ``F(s, j)`` after ``F(s-1, j)``; ``B|I(s, j)`` after
  ``F(s, j)`` and after ``B|I(s+1, j)`` (the action that produces the input
  gradient; for the last stage the loss is computed inside its F);
  ``W(s, j)`` after ``I(s, j)``. A dependency between stages on different
  ranks adds ``p2p[boundary]`` seconds (the same in both directions); stages
  on the same rank (the V-schedule turn at ``pp-1``/``pp``) pass tensors
  locally, as torch does, at no cost.
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

Activation convention
---------------------
One "activation" is one micro-batch's saved state of one stage. It becomes
alive when its ``F`` starts (+1) and is freed when the action that finishes
its backward ends (-1): the ``B`` for a full backward, the ``W`` for a split
one (``I`` keeps the tensors that ``W`` still needs). Actions on a rank run
one at a time, so the running count (and ``peak_activations``) depends only
on torch's order, not on the times. ``activation_bytes[s]`` weights the count
into ``peak_activation_bytes``.

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

import contextlib
import functools
from collections import OrderedDict, deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Union

__all__ = [
    "SCHEDULES",
    "TORCH_SCHEDULE_CLASSES",
    "ScheduleOp",
    "TimedAction",
    "ScheduleResult",
    "canonical_schedule",
    "default_stages_per_rank",
    "load_csv_orders",
    "rank_orders",
    "simulate",
    "simulate_orders",
]

Number = Union[int, float]
PerStage = Union[Number, Sequence[Number]]

#: Canonical schedule name -> torch.distributed.pipelining class name.
TORCH_SCHEDULE_CLASSES: dict[str, str] = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
    "looped_bfs": "ScheduleLoopedBFS",
    "interleaved_zero_bubble": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}
SCHEDULES: tuple[str, ...] = tuple(TORCH_SCHEDULE_CLASSES)

_SINGLE_STAGE = ("gpipe", "1f1b")
_V_STYLE = ("zbv", "dualpipev")

_ALIASES = {
    "gpipe": "gpipe",
    "schedulegpipe": "gpipe",
    "1f1b": "1f1b",
    "schedule1f1b": "1f1b",
    "interleaved1f1b": "interleaved_1f1b",
    "scheduleinterleaved1f1b": "interleaved_1f1b",
    "loopedbfs": "looped_bfs",
    "scheduleloopedbfs": "looped_bfs",
    "interleavedzerobubble": "interleaved_zero_bubble",
    "interleavedzb": "interleaved_zero_bubble",
    "zb1p": "interleaved_zero_bubble",
    "scheduleinterleavedzerobubble": "interleaved_zero_bubble",
    "zbv": "zbv",
    "zbvzerobubble": "zbv",
    "schedulezbvzerobubble": "zbv",
    "dualpipev": "dualpipev",
    "scheduledualpipev": "dualpipev",
}


def canonical_schedule(name: str) -> str:
    """Canonical name (a key of :data:`TORCH_SCHEDULE_CLASSES`) for ``name``.

    Accepts the canonical names, torch's class names and the names of
    ``torch.distributed.pipelining.schedules.get_schedule_class`` ("GPipe",
    "Interleaved1F1B", "ZBVZeroBubble", ...), case-, '-' and '_'-insensitive.
    """
    if not isinstance(name, str):
        raise TypeError(f"schedule name must be a str, got {type(name).__name__}")
    key = name.lower().replace("_", "").replace("-", "").replace(" ", "")
    if key not in _ALIASES:
        raise ValueError(f"unknown pipeline schedule {name!r}; known: {', '.join(SCHEDULES)}")
    return _ALIASES[key]


def default_stages_per_rank(schedule: str) -> int:
    """Stages per rank a schedule uses when none is given (1 or 2)."""
    return 1 if canonical_schedule(schedule) in _SINGLE_STAGE else 2


class ScheduleOp(NamedTuple):
    """One compute action of a rank, as torch labels it.

    ``kind``: "F" (FORWARD), "B" (FULL_BACKWARD), "I" (BACKWARD_INPUT) or
    "W" (BACKWARD_WEIGHT). ``overlap_group``: for the sub-actions of one torch
    OVERLAP_F_B action, the position of that action in the rank's compute
    list; None otherwise.
    """

    kind: str
    stage: int
    microbatch: int
    overlap_group: int | None = None

    def __str__(self) -> str:  # torch's _Action repr, e.g. "3F0", "5W2"
        return f"{self.stage}{self.kind}{self.microbatch}"


# One compute action as the orders are kept: ScheduleOp's fields as a plain
# tuple (kind, stage, micro-batch, overlap group), cheaper to make and to send
# between processes than the named tuple; rank_orders hands out ScheduleOps.
_Op = tuple[str, int, int, "int | None"]
# Per-rank orders and the stage -> rank map of one schedule shape.
TorchOrders = tuple[dict[int, tuple[_Op, ...]], dict[int, int]]


@dataclass(frozen=True)
class TimedAction:
    """One executed action: seconds from the start of the step."""

    rank: int
    action: str  # torch-style label, e.g. "4I1"
    kind: str
    stage: int
    microbatch: int
    start: float
    end: float
    overlap_group: int | None = None


@dataclass
class ScheduleResult:
    """What :func:`simulate` returns. Times in seconds; per-rank lists by rank."""

    schedule: str
    pp: int
    stages_per_rank: int
    num_microbatches: int
    step_time: float
    busy: list[float]
    idle: list[float]
    bubble_ratio: float
    bubble_fraction: float
    peak_activations: list[int]
    peak_activation_bytes: list[float] | None
    stage_to_rank: dict[int, int]
    timeline: list[TimedAction] = field(repr=False)

    @property
    def num_stages(self) -> int:
        return self.pp * self.stages_per_rank

    def rank_timeline(self, rank: int) -> list[TimedAction]:
        """The actions of ``rank`` in execution order."""
        return [a for a in self.timeline if a.rank == rank]


# --------------------------------------------------------------------------------------
# Action orders from torch
# --------------------------------------------------------------------------------------


class _RecordingStage:
    """Stand-in for a PipelineStage that records what a single-stage schedule runs.

    Only what ScheduleGPipe/Schedule1F1B touch on ``self._stage`` during
    ``__init__`` and ``_step_microbatches`` (loss_fn=None, stage pre-marked as
    initialized): no p2p ops, no tensors.
    """

    def __init__(self, stage_index: int, num_stages: int):
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.is_first = stage_index == 0
        self.is_last = stage_index == num_stages - 1
        self.submod = None
        self.output_chunks: list = []
        self.calls: list[_Op] = []

    def get_fwd_recv_ops(self, mb):
        return []

    get_fwd_send_ops = get_bwd_recv_ops = get_bwd_send_ops = get_fwd_recv_ops

    def forward_one_chunk(self, mb, *args, **kwargs):
        self.calls.append(("F", self.stage_index, int(mb), None))
        return None

    def backward_one_chunk(self, mb, loss=None, full_backward=True, last_backward=False):
        kind = "B" if full_backward else "I"
        self.calls.append((kind, self.stage_index, int(mb), None))

    def backward_weight_one_chunk(self, mb, last_backward=False):
        self.calls.append(("W", self.stage_index, int(mb), None))

    def perform_reduce_grad(self, *args, **kwargs):
        pass

    def clear_runtime_states(self):
        pass


class _StubStage:
    """Stand-in stage for constructing a multi-stage torch schedule (no model, no group)."""

    def __init__(self, stage_index: int, num_stages: int, group_size: int, group_rank: int):
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.group_size = group_size
        self.group_rank = group_rank
        self.submod = None  # _check_torch_compile_compatibility skips non-Modules
        self.stage_index_to_group_rank: dict[int, int] | None = None
        self.is_first = stage_index == 0
        self.is_last = stage_index == num_stages - 1


def _torch_ops(action) -> list:
    if action.sub_actions is not None:
        return list(action.sub_actions)
    return [action]


def _stub_stages(name: str, pp: int, num_stages: int) -> list[_StubStage]:
    """Rank 0's stand-in stages of a multi-stage schedule (loop or V placement)."""
    from torch.distributed.pipelining._utils import generate_rank_to_stage_mapping

    style = "v" if name in _V_STYLE else "loop"
    local = generate_rank_to_stage_mapping(pp, num_stages, style=style)[0]
    return [_StubStage(s, num_stages, pp, 0) for s in local]


def _compute_only(cls: type) -> type:
    """``cls`` (a ``_PipelineScheduleRuntime``) without the lowering of its
    compute order to communication actions: the stage mapping is still
    validated and set. The lowering only inserts actions (UNSHARD/RESHARD,
    REDUCE_GRAD, SEND/RECV) around each rank's compute actions, in their order
    (``tests/test_schedules.py`` checks the orders agree), and at pp=64,
    m=256 it took 3.5-7 s of a 0.1-0.5 s construction."""
    def validate_only(self, actions, format="compute_only"):
        self._validate_and_set_stage_mapping(actions)

    return type(cls.__name__, (cls,), {"_prepare_schedule_with_comms": validate_only})


def _compute_ops(actions) -> tuple[_Op, ...]:
    """A rank's torch actions (``_Action`` or None) as its compute order: the
    compute actions in turn, OVERLAP_F_B flattened into its sub-actions
    (carrying the position of the pair as their overlap group)."""
    ops: list[_Op] = []
    compute = [a for a in actions if a is not None and a.is_compute_op]
    for pos, action in enumerate(compute):
        group = pos if action.sub_actions is not None else None
        for a in _torch_ops(action):
            ops.append((a.computation_type.value, int(a.stage_index), int(a.microbatch_index),
                        group))
    return tuple(ops)


@contextlib.contextmanager
def _without_profiler_ranges(module: Any) -> Iterator[None]:
    """``module.record_function`` (torch's schedules open a profiler range
    around each micro-batch's forward and backward) as a range that does
    nothing, while an order is recorded: GPipe at pp=64, m=1536 opens 98k of
    them, 0.9 s of its 1.6 s recording, and gpt3-175b's search recorded
    3.1 s of GPipe orders. Restored afterwards."""
    original = module.record_function
    module.record_function = lambda *args, **kwargs: contextlib.nullcontext()
    try:
        yield
    finally:
        module.record_function = original


def _orders_from_torch(name: str, pp: int, m: int, v: int) -> TorchOrders:
    import torch.distributed.pipelining.schedules as tsched

    cls = getattr(tsched, TORCH_SCHEDULE_CLASSES[name])
    num_stages = pp * v
    orders: dict[int, tuple[_Op, ...]] = {}

    if name in _SINGLE_STAGE:
        # the order is recorded from _step_microbatches; the display order torch
        # builds in __init__ (every rank's actions, per instance) is not needed
        # and costs O(pp^2 m): 8 s of 9 for 1F1B with pp=64, m=256
        recorded = type(cls.__name__, (cls,), {"_get_pipeline_order": lambda self: None})
        with _without_profiler_ranges(tsched):
            for rank in range(pp):
                stage = _RecordingStage(rank, num_stages)
                sched = recorded(stage, n_microbatches=m)
                # loss_fn=None -> no backward-metadata init; mark forward as done so
                # _initialize_pp_stages returns without touching p2p or tensors.
                sched._stage_forward_initialized = True
                sched._step_microbatches()
                orders[rank] = tuple(stage.calls)
        return orders, {s: s for s in range(num_stages)}

    sched = _compute_only(cls)(_stub_stages(name, pp, num_stages), n_microbatches=m)
    stage_to_rank = {int(s): int(r) for s, r in sched.stage_index_to_group_rank.items()}
    for rank in range(pp):
        orders[rank] = _compute_ops(sched.pipeline_order[rank])
    return orders, stage_to_rank


class _OrdersMemo:
    """Torch's orders by schedule shape ``(name, pp, m, v)``, the most recent
    :data:`ORDERS_MEMO_SIZE` kept (one per process: a pure function's memo).
    A shape can be filed from elsewhere (:func:`adopt_orders`)."""

    def __init__(self, size: int):
        self.size = size
        self._known: OrderedDict[tuple, TorchOrders] = OrderedDict()

    def get(self, key: tuple) -> TorchOrders | None:
        found = self._known.get(key)
        if found is not None:
            self._known.move_to_end(key)
        return found

    def put(self, key: tuple, orders: TorchOrders) -> None:
        self._known[key] = orders
        self._known.move_to_end(key)
        while len(self._known) > self.size:
            self._known.popitem(last=False)

    def clear(self) -> None:
        self._known.clear()


# How many schedule shapes' orders a process keeps (a search asks for ~100).
ORDERS_MEMO_SIZE = 512
_ORDERS = _OrdersMemo(ORDERS_MEMO_SIZE)


def rank_orders(
    schedule: str,
    pp: int,
    num_microbatches: int,
    stages_per_rank: int | None = None,
) -> tuple[dict[int, list[ScheduleOp]], dict[int, int]]:
    """Per-rank compute-action order torch executes, and the stage -> rank map.

    Returns ``(orders, stage_to_rank)``; ``orders[rank]`` lists that rank's
    :class:`ScheduleOp` in execution order, with torch's OVERLAP_F_B actions
    flattened into their sub-actions (F first, as torch runs them). See the
    module docstring for how each schedule's order is obtained. Results are
    cached.
    """
    orders, s2r = torch_orders(schedule, pp, num_microbatches, stages_per_rank)
    return {r: [ScheduleOp._make(op) for op in o] for r, o in orders.items()}, dict(s2r)


def torch_orders(schedule: str, pp: int, num_microbatches: int,
                 stages_per_rank: int | None = None) -> TorchOrders:
    """:func:`rank_orders` as this module keeps them: each action a plain
    ``(kind, stage, micro-batch, overlap group)`` tuple. Cached; the value
    pickles quickly, for :func:`adopt_orders` in another process. Do not
    modify it."""
    name = canonical_schedule(schedule)
    pp, m, v = _check_shape(name, pp, num_microbatches, stages_per_rank)
    return _torch_orders(name, pp, m, v)


def adopt_orders(schedule: str, pp: int, num_microbatches: int, stages_per_rank: int | None,
                 orders: TorchOrders) -> None:
    """File ``orders``, what :func:`torch_orders` gave for this shape in
    another process (a forked worker), so that this process does not ask
    torch for them again."""
    name = canonical_schedule(schedule)
    pp, m, v = _check_shape(name, pp, num_microbatches, stages_per_rank)
    _ORDERS.put((name, pp, m, v), orders)


def release_orders() -> None:
    """Forget the orders, dependency orders and peaks of every schedule shape
    this process keeps; they are made again when asked for. A search keeps
    those of all its shapes (gpt3-175b on 1024 GPUs: ~400 MB), which its
    caller need not hold on to."""
    _ORDERS.clear()
    _torch_dependency_order.cache_clear()
    _torch_peaks.cache_clear()


def orders_cached(schedule: str, pp: int, num_microbatches: int,
                  stages_per_rank: int | None = None) -> bool:
    """Whether this process holds :func:`torch_orders` of this shape already."""
    name = canonical_schedule(schedule)
    pp, m, v = _check_shape(name, pp, num_microbatches, stages_per_rank)
    return _ORDERS.get((name, pp, m, v)) is not None


def _torch_orders(name: str, pp: int, m: int, v: int) -> TorchOrders:
    """The cached orders and stage map; torch's rejection as a ``ValueError``."""
    key = (name, pp, m, v)
    found = _ORDERS.get(key)
    if found is not None:
        return found
    try:
        found = _orders_from_torch(name, pp, m, v)
    except (ValueError, AssertionError) as exc:
        raise ValueError(
            f"torch's {TORCH_SCHEDULE_CLASSES[name]} rejects pp={pp}, num_microbatches={m}, "
            f"stages_per_rank={v}: {exc}"
        ) from exc
    _ORDERS.put(key, found)
    return found


def _check_shape(name: str, pp, m, v) -> tuple[int, int, int]:
    for label, val in (("pp", pp), ("num_microbatches", m)):
        if isinstance(val, bool) or not isinstance(val, int) or val < 1:
            raise ValueError(f"{label} must be an integer >= 1, got {val!r}")
    if v is None:
        v = default_stages_per_rank(name)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"stages_per_rank must be an integer >= 1, got {v!r}")
    if name in _SINGLE_STAGE and v != 1:
        raise ValueError(f"{name} runs one stage per rank, got stages_per_rank={v}")
    if name in _V_STYLE and v != 2:
        raise ValueError(f"{name} runs exactly two stages per rank, got stages_per_rank={v}")
    return pp, m, v


# --------------------------------------------------------------------------------------
# Timing simulation
# --------------------------------------------------------------------------------------


def _per_stage(values: PerStage, n: int, label: str, allow_none: bool = False) -> list[float] | None:
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
) -> ScheduleResult:
    """Time one training step of a pipeline schedule as torch executes it.

    Args:
        schedule: a name of :data:`SCHEDULES` (or torch's class / short name).
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

    Returns:
        :class:`ScheduleResult`. See the module docstring for the model.
    """
    name = canonical_schedule(schedule)
    pp, m, v = _check_shape(name, pp, num_microbatches, stages_per_rank)
    orders, s2r, order = _torch_dependency_order(name, pp, m, v)
    return _simulate_order(order, orders, s2r,
                           *_stage_values(pp * v, f, b, w, p2p, activation_bytes),
                           name, m, timeline, list(_torch_peaks(name, pp, m, v)))


@functools.lru_cache(maxsize=512)
def _torch_dependency_order(name: str, pp: int, m: int, v: int) -> tuple:
    """Torch's orders, stage map and their :func:`_dependency_order` (one per
    schedule shape: a search times the same shape with many stage times)."""
    orders, s2r = _torch_orders(name, pp, m, v)
    return orders, s2r, _dependency_order(orders, s2r, name)


def peak_activations(schedule: str, pp: int, num_microbatches: int,
                     stages_per_rank: int | None = None) -> tuple[list[int], dict[int, int]]:
    """Peak number of live activations per rank, and the stage -> rank map, of
    a schedule: what :func:`simulate` reports as ``peak_activations``, from
    torch's order alone (the count changes only at a rank's own actions, so
    no timing is needed; a tenth of a simulation's cost at pp=64, m=256)."""
    name = canonical_schedule(schedule)
    pp, m, v = _check_shape(name, pp, num_microbatches, stages_per_rank)
    return list(_torch_peaks(name, pp, m, v)), dict(_torch_orders(name, pp, m, v)[1])


@functools.lru_cache(maxsize=512)
def _torch_peaks(name: str, pp: int, m: int, v: int) -> tuple[int, ...]:
    """Per-rank peak live activations of torch's orders (cached like them)."""
    return tuple(_peaks(_torch_orders(name, pp, m, v)[0], pp, None)[0])


def _peaks(orders: dict[int, Sequence[ScheduleOp]], pp: int, act_b: list[float] | None
           ) -> tuple[list[int], list[float] | None]:
    """Per-rank peak count of live activations (and, given bytes per stage
    ``act_b``, peak bytes): +1 at an F, -1 at the B or W that ends its backward."""
    peaks: list[int] = []
    peak_bytes: list[float] | None = [] if act_b is not None else None
    for r in range(pp):
        alive = peak = 0
        alive_b = peak_b = 0.0
        for op in orders[r]:
            kind = op[0]
            if kind == "F":
                alive += 1
                peak = max(peak, alive)
                if act_b is not None:
                    alive_b += act_b[op[1]]
                    peak_b = max(peak_b, alive_b)
            elif kind in ("B", "W"):
                alive -= 1
                if act_b is not None:
                    alive_b -= act_b[op[1]]
        peaks.append(peak)
        if peak_bytes is not None:
            peak_bytes.append(peak_b)
    return peaks, peak_bytes


def load_csv_orders(
    path: str, pp: int, num_microbatches: int, num_stages: int
) -> tuple[dict[int, list[ScheduleOp]], dict[int, int]]:
    """Per-rank orders from a compute-only schedule CSV, read the way torch reads it.

    The file format is ``PipelineScheduleMulti._dump_csv`` / ``_load_csv``
    "compute_only": one row per rank, one torch action string per cell
    ("0F0", "3I1", "3W1", "" for an idle slot). Cells are parsed with torch's
    ``_Action.from_str`` and checked (and the stage -> rank map inferred) with
    torch's ``_validate_schedule``, as ``_load_csv`` does. Returns what
    :func:`rank_orders` returns, for :func:`simulate_orders`.
    """
    import csv

    from torch.distributed.pipelining.schedules import _Action, _validate_schedule

    actions: dict[int, list] = {}
    with open(path, newline="") as fh:
        for rank, row in enumerate(csv.reader(fh)):
            actions[rank] = [_Action.from_str(cell) for cell in row]
    try:
        s2r = _validate_schedule(actions, pp, num_stages, num_microbatches)
    except AssertionError as exc:
        raise ValueError(f"invalid schedule CSV {path}: {exc}") from exc
    orders = {rank: [ScheduleOp._make(op) for op in _compute_ops(actions[rank])]
              for rank in range(pp)}
    return orders, {int(s): int(r) for s, r in s2r.items()}


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
    :func:`rank_orders` or :func:`load_csv_orders` return them) and
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
    order = _dependency_order(orders, s2r, name)
    return _simulate_order(order, orders, s2r, *_stage_values(S, f, b, w, p2p, activation_bytes),
                           name, m, timeline)


def _stage_values(S: int, f: PerStage, b: PerStage, w: PerStage, p2p: PerStage,
                  activation_bytes: PerStage | None) -> tuple:
    """(f, b, w, p2p, activation bytes) as lists: one value per stage (per
    boundary for p2p; None for absent activation bytes), checked."""
    return (_per_stage(f, S, "f"), _per_stage(b, S, "b"), _per_stage(w, S, "w"),
            _per_stage(p2p, max(S - 1, 0), "p2p") if S > 1 else [],
            _per_stage(activation_bytes, S, "activation_bytes", allow_none=True))


# One action of a dependency-respecting order of all ranks' actions, stored
# column-wise (lists indexed by position in the order; timing walks them
# together): see _DependencyOrder.
_KIND_CODE = {"F": 0, "B": 1, "I": 2, "W": 3}


@dataclass(frozen=True)
class _DependencyOrder:
    """Every rank's actions in one order in which each comes after its
    rank's earlier actions and after the actions it waits for, column-wise:
    at position ``k`` the action ``ops[k]`` of rank ``ranks[k]``; ``codes[k]``
    = kind code (F 0, B 1, I 2, W 3) * stages + stage, which picks its
    duration; it waits for the actions at positions ``first[k]`` and
    ``second[k]`` (-1: none), each plus the p2p latency of stage boundary
    ``first_boundary[k]`` / ``second_boundary[k]`` (-1: same rank, none)."""

    ranks: list[int]
    codes: list[int]
    first: list[int]
    first_boundary: list[int]
    second: list[int]
    second_boundary: list[int]
    ops: list[_Op]


def _dependency_order(orders: dict[int, Sequence[ScheduleOp]], s2r: dict[int, int],
                      name: str) -> _DependencyOrder:
    """Every rank's actions in one order in which each comes after its rank's
    earlier actions and after the actions it waits for: an F after the F of
    the previous stage, a B or I after its F and the gradient of the next
    stage (that stage's B or I), a W after its I. Timing is then one pass over
    it. Raises ``ValueError`` when the orders deadlock or an action repeats.

    Actions are named by ints, ``stage * M + micro-batch`` (M: one more than
    the largest micro-batch index), and where each was placed is kept in
    lists per kind (F, gradient = B or I, I, and B and W to catch repeats):
    a search orders schedules of ~150k actions (gpt3-175b, m = 1536)."""
    S = len(s2r)
    M = 1 + max((op[2] for o in orders.values() for op in o), default=0)
    size = S * M
    placed = {kind: [-1] * size for kind in "FGIBW"}
    pos_f, pos_g, pos_i = placed["F"], placed["G"], placed["I"]
    # the p2p boundary a dependency on the next (previous) stage crosses, or -1
    cross_next = [s if s + 1 < S and s2r[s + 1] != s2r[s] else -1 for s in range(S)]
    waiting: dict[tuple[str, int], list[int]] = {}
    out = _DependencyOrder([], [], [], [], [], [], [])
    ranks, codes, first, first_b, second, second_b, ops = (
        out.ranks, out.codes, out.first, out.first_boundary, out.second,
        out.second_boundary, out.ops)
    ptr = {r: 0 for r in orders}
    ready = deque(sorted(orders))
    queued = set(orders)
    while ready:
        r = ready.popleft()
        queued.discard(r)
        order = orders[r]
        p = ptr[r]
        while p < len(order):
            op = order[p]
            kind, s, j = op[0], op[1], op[2]
            at = s * M + j
            a2 = b2 = -1
            if kind == "F":
                if s == 0:
                    a1 = b1 = -1
                else:
                    a1, b1 = pos_f[at - M], cross_next[s - 1]
                    if a1 < 0:
                        waiting.setdefault(("F", at - M), []).append(r)
                        break
            elif kind == "W":
                a1, b1 = pos_i[at], -1
                if a1 < 0:
                    waiting.setdefault(("I", at), []).append(r)
                    break
            else:  # B or I: after its F and the gradient from the next stage
                a1, b1 = pos_f[at], -1
                if a1 < 0:
                    waiting.setdefault(("F", at), []).append(r)
                    break
                if s < S - 1:
                    a2, b2 = pos_g[at + M], cross_next[s]
                    if a2 < 0:
                        waiting.setdefault(("G", at + M), []).append(r)
                        break
            p += 1
            k = len(ranks)
            ranks.append(r)
            codes.append(_KIND_CODE[kind] * S + s)
            first.append(a1)
            first_b.append(b1)
            second.append(a2)
            second_b.append(b2)
            ops.append(op)
            done = (kind, "G") if kind in ("B", "I") else (kind,)
            for key in done:
                where = placed[key]
                if where[at] >= 0:
                    raise ValueError(f"rank {r}: action {ScheduleOp._make(op)} appears "
                                     f"twice in torch's order")
                where[at] = k
                for other in waiting.pop((key, at), ()):
                    if other not in queued:
                        queued.add(other)
                        ready.append(other)
        ptr[r] = p
    stuck = {r: str(ScheduleOp._make(orders[r][ptr[r]])) for r in sorted(orders)
             if ptr[r] < len(orders[r])}
    if stuck:
        raise ValueError(f"{name}: schedule deadlocks; ranks blocked at {stuck}")
    return out


def _simulate_order(order: _DependencyOrder, orders: dict[int, Sequence[ScheduleOp]],
                    s2r: dict[int, int], fs: list[float], bs: list[float], ws: list[float],
                    lat: list[float], act_b: list[float] | None, name: str, m: int,
                    with_timeline: bool, peaks: list[int] | None = None) -> ScheduleResult:
    """Time ``order`` (from :func:`_dependency_order`): each action starts
    when its rank is free and what it waits for has ended (plus the p2p
    latency across ranks), and lasts its stage's f, b, w or b + w seconds.
    ``peaks``: the orders' peak live activations per rank when known."""
    pp = len(orders)
    v = len(s2r) // pp
    # seconds by duration code (kind * stages + stage); p2p seconds by
    # boundary, the last entry 0.0 for "no boundary" (-1)
    duration = [*fs, *(b + w for b, w in zip(bs, ws)), *bs, *ws]
    delay = [*lat, 0.0]
    ends = [0.0] * len(order.ranks)
    starts = [0.0] * len(order.ranks)
    free_at = [0.0] * pp
    busy = [0.0] * pp
    for k, (r, code, a1, b1, a2, b2) in enumerate(zip(
            order.ranks, order.codes, order.first, order.first_boundary, order.second,
            order.second_boundary)):
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
        starts[k] = start
        ends[k] = free_at[r] = end
        busy[r] += end - start
    timeline = [TimedAction(r, str(op), op.kind, op.stage, op.microbatch, starts[k], ends[k],
                            op.overlap_group)
                for k, (r, op) in enumerate(zip(order.ranks, map(ScheduleOp._make, order.ops)))
                ] if with_timeline else []
    step_time = max(ends, default=0.0)
    idle = [step_time - x for x in busy]
    ideal = max(busy) if busy else 0.0
    bubble_ratio = (step_time - ideal) / ideal if ideal > 0 else 0.0
    bubble_fraction = sum(idle) / (pp * step_time) if step_time > 0 else 0.0

    if peaks is None or act_b is not None:
        peaks, peak_bytes = _peaks(orders, pp, act_b)
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
