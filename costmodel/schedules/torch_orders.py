"""Torch's per-rank compute orders of a pipeline schedule, as torch makes them.

The order is always torch's own; nothing here re-derives a schedule.

* ``gpipe``, ``1f1b`` (``ScheduleGPipe``, ``Schedule1F1B``, one stage per
  rank): these classes run ``_step_microbatches`` directly, not from an action
  list. :func:`orders_from_torch` constructs the torch class on a small
  recording stand-in stage (it answers ``num_stages``/``stage_index``/
  ``is_first``/``is_last``, returns no p2p ops and records every
  ``forward_one_chunk`` / ``backward_one_chunk`` call) and calls torch's
  ``_step_microbatches`` once per rank. The recorded calls *are* the executed
  order. (Their ``_get_pipeline_order()`` IR is torch's visualization of the
  same thing; the tests check that both agree.) Both call
  ``backward_one_chunk`` with the default ``full_backward=True``, i.e. a
  FULL_BACKWARD ``B``.
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
  tests check it), are the order used, and the stage placement is the
  :class:`costmodel.schedules.specs.ScheduleSpec` placement (loop style
  ``s % pp``; V style for zbv/dualpipev), which is what torch's
  ``_validate_schedule`` infers from the order (tests check).

* A custom schedule written as torch's compute-only CSV (what
  ``_PipelineScheduleRuntime._load_csv`` accepts) is read by
  :func:`load_csv_orders` with torch's ``_Action.from_str`` and checked with
  torch's ``_validate_schedule``.

Torch's validation errors (1F1B with ``m < pp``, DualPipeV with
``m < 2 pp``, interleaved schedules whose ``m`` is not a multiple of
``max(1, m // pp)``, ...) come out of :func:`load_csv_orders` and of
:class:`costmodel.schedules.book.ScheduleBook` as ``ValueError``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from costmodel.schedules.specs import SCHEDULE_SPECS
from costmodel.schedules.types import OpTuple, ScheduleOp, TorchOrders

__all__ = ["load_csv_orders", "orders_from_torch"]


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
        self.calls: list[OpTuple] = []

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


def _stub_stages(name: str, pp: int, v: int) -> list[_StubStage]:
    """Rank 0's stand-in stages of a multi-stage schedule (loop or V placement)."""
    num_stages = pp * v
    return [_StubStage(s, num_stages, pp, 0)
            for s in SCHEDULE_SPECS[name].rank_stages(pp, 0, v)]


def _compute_only(cls: type, stage_to_rank: dict[int, int]) -> type:
    """``cls`` (a ``_PipelineScheduleRuntime``) without the lowering of its
    compute order to communication actions, its stages placed by
    ``stage_to_rank`` (the schedule's :class:`costmodel.schedules.specs.ScheduleSpec`
    placement, which is what torch's ``_validate_schedule`` infers from the
    order: ``tests/test_schedule_specs.py`` checks it). The lowering only
    inserts actions (UNSHARD/RESHARD, REDUCE_GRAD, SEND/RECV) around each
    rank's compute actions, in their order (``tests/test_schedules.py``
    checks the orders agree), and at pp=64, m=256 it took 3.5-7 s of a
    0.1-0.5 s construction; the inference walks every action once more."""
    def placed_only(self, actions, format="compute_only"):
        self.stage_index_to_group_rank = dict(stage_to_rank)
        for stage in self._stages:
            stage.stage_index_to_group_rank = self.stage_index_to_group_rank

    return type(cls.__name__, (cls,), {"_prepare_schedule_with_comms": placed_only})


def _compute_kinds() -> tuple[dict[int, str], int]:
    """Torch's compute action types by ``id``: the kind letter of F, B, I and
    W, and the ``id`` of OVERLAP_F_B (a pair whose sub-actions are those).
    By ``id``, because an Enum member hashes in Python code, and the lookup
    runs once per action (~400k for zbv at pp=16, m=4096)."""
    import torch.distributed.pipelining.schedules as tsched

    kinds = {id(t): t.value for t in (tsched.FORWARD, tsched.FULL_BACKWARD,
                                      tsched.BACKWARD_INPUT, tsched.BACKWARD_WEIGHT)}
    return kinds, id(tsched.OVERLAP_F_B)


def _compute_ops(actions) -> tuple[OpTuple, ...]:
    """A rank's torch actions (``_Action`` or None) as its compute order: the
    compute actions in turn, OVERLAP_F_B flattened into its sub-actions
    (carrying the position of the pair among the compute actions as their
    overlap group)."""
    kinds, overlap = _compute_kinds()
    ops: list[OpTuple] = []
    append = ops.append
    pos = 0  # position among the compute actions
    for action in actions:
        if action is None:
            continue
        stage, ctype, mb, subs = action
        kind = kinds.get(id(ctype))
        if kind is not None and subs is None:
            append((kind, stage, mb, None))
        elif kind is not None or id(ctype) == overlap:
            for sub in subs:
                append((kinds[id(sub.computation_type)], sub.stage_index,
                        sub.microbatch_index, pos))
        else:
            continue
        pos += 1
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


def orders_from_torch(name: str, pp: int, m: int, v: int) -> TorchOrders:
    """Torch's per-rank compute orders and stage -> rank map of the checked
    shape ``(name, pp, m, v)`` (see the module docstring)."""
    import torch.distributed.pipelining.schedules as tsched

    spec = SCHEDULE_SPECS[name]
    cls = spec.torch_type
    num_stages = pp * v
    orders: dict[int, tuple[OpTuple, ...]] = {}

    if spec.single_stage:
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
        return orders, spec.stage_to_rank(pp, v)

    stage_to_rank = spec.stage_to_rank(pp, v)
    sched = _compute_only(cls, stage_to_rank)(_stub_stages(name, pp, v), n_microbatches=m)
    for rank in range(pp):
        orders[rank] = _compute_ops(sched.pipeline_order[rank])
    return orders, stage_to_rank


def load_csv_orders(
    path: str, pp: int, num_microbatches: int, num_stages: int
) -> tuple[dict[int, list[ScheduleOp]], dict[int, int]]:
    """Per-rank orders from a compute-only schedule CSV, read the way torch reads it.

    The file format is ``PipelineScheduleMulti._dump_csv`` / ``_load_csv``
    "compute_only": one row per rank, one torch action string per cell
    ("0F0", "3I1", "3W1", "" for an idle slot). Cells are parsed with torch's
    ``_Action.from_str`` and checked (and the stage -> rank map inferred) with
    torch's ``_validate_schedule``, as ``_load_csv`` does. Returns what
    :func:`costmodel.schedules.rank_orders` returns, for
    :func:`costmodel.schedules.simulate_orders`.
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
