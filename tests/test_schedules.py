"""Pipeline schedule models (costmodel.schedules) against closed forms and torch's own orders."""

from __future__ import annotations

import random

import pytest
import torch.distributed.pipelining.schedules as tsched

from costmodel.schedules.specs import SCHEDULE_SPECS
from costmodel.schedules.torch_orders import _RecordingStage
from costmodel.schedules import (
    SCHEDULES,
    ScheduleBook,
    ScheduleOp,
    canonical_schedule,
    default_stages_per_rank,
    load_csv_orders,
    peak_activations,
    rank_orders,
    simulate,
    simulate_orders,
)

MULTI = ["interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble", "zbv", "dualpipev"]
ZERO_BUBBLE = ["interleaved_zero_bubble", "zbv", "dualpipev"]


def _approx(x, y, rel=1e-9):
    return x == pytest.approx(y, rel=rel, abs=1e-12)


# ---------------------------------------------------------------------------------------
# The orders are torch's
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("pp,m", [(2, 2), (3, 5), (4, 8), (4, 4)])
def test_gpipe_trace_matches_torch_pipeline_order(pp, m):
    orders, s2r = rank_orders("gpipe", pp, m)
    ir = tsched.ScheduleGPipe(_RecordingStage(0, pp), m)._get_pipeline_order()
    for r in range(pp):
        assert [str(a) for a in orders[r]] == [str(a) for a in ir[r] if a is not None and a.is_compute_op]
        assert [str(a) for a in orders[r]] == [f"{r}F{j}" for j in range(m)] + [f"{r}B{j}" for j in range(m)]
    assert s2r == {s: s for s in range(pp)}


def test_recording_an_order_leaves_torchs_profiler_ranges_in_place():
    """The recording runs torch's schedule loop without profiler ranges and
    puts torch's ``record_function`` back afterwards."""
    from torch.profiler import record_function

    for name in ("gpipe", "1f1b"):
        orders, _ = rank_orders(name, 3, 7)
        assert sorted(str(a) for a in orders[2]) == sorted(
            [f"2F{j}" for j in range(7)] + [f"2B{j}" for j in range(7)])
    assert tsched.record_function is record_function


@pytest.mark.parametrize("pp,m", [(2, 2), (3, 5), (4, 8), (4, 4)])
def test_1f1b_trace_is_executed_order(pp, m):
    orders, _ = rank_orders("1f1b", pp, m)
    ir = tsched.Schedule1F1B(_RecordingStage(0, pp), m)._get_pipeline_order()
    # torch's _get_pipeline_order IR agrees with what _step_microbatches runs on
    # every rank but the last (there the IR's micro-batch indices are off by one).
    for r in range(pp - 1):
        assert [str(a) for a in orders[r]] == [str(a) for a in ir[r] if a is not None and a.is_compute_op]
    for r in range(pp):
        warm = min(m, pp - r)
        expect = [f"{r}F{j}" for j in range(warm)]
        fwd = warm
        for j in range(m):
            expect.append(f"{r}B{j}")
            if fwd < m:
                expect.append(f"{r}F{fwd}")
                fwd += 1
        assert [str(a) for a in orders[r]] == expect


@pytest.mark.parametrize("name", MULTI)
@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (3, 6)])
def test_multi_stage_orders_are_torch_pipeline_order(name, pp, m):
    orders, s2r = rank_orders(name, pp, m)
    cls = getattr(tsched, SCHEDULE_SPECS[name].torch_class)
    assert cls is SCHEDULE_SPECS[name].torch_type
    # every (stage, micro-batch) has one F and one B or one I + one W, on the stage's rank
    seen: dict[tuple[str, int, int], int] = {}
    for r, ops in orders.items():
        for op in ops:
            assert s2r[op.stage] == r
            key = (op.kind, op.stage, op.microbatch)
            assert key not in seen
            seen[key] = r
    for s in range(2 * pp):
        for j in range(m):
            assert ("F", s, j) in seen
            assert (("B", s, j) in seen) != (("I", s, j) in seen and ("W", s, j) in seen)
    if name in ("zbv", "dualpipev"):  # V placement: rank r holds stages r and 2pp-1-r
        assert all(s2r[r] == r and s2r[2 * pp - 1 - r] == r for r in range(pp))
    else:
        assert all(s2r[s] == s % pp for s in range(2 * pp))
    if name == "interleaved_1f1b" or name == "looped_bfs":
        assert all(op.kind in ("F", "B") for ops in orders.values() for op in ops)
    if name in ("interleaved_zero_bubble", "zbv"):
        assert any(op.kind == "W" for op in orders[0])
    # the order read without torch's lowering is the compute order torch runs:
    # the compute actions of the lowered pipeline_order_with_comms
    from costmodel.schedules.torch_orders import _stub_stages

    lowered = cls(_stub_stages(name, pp, 2), n_microbatches=m).pipeline_order_with_comms
    for r, ops in orders.items():
        runs = [a for a in lowered[r] if a.is_compute_op]
        flat = [sub for a in runs for sub in (a.sub_actions or (a,))]
        assert [(op.kind, op.stage, op.microbatch) for op in ops] == [
            (a.computation_type.value, a.stage_index, a.microbatch_index) for a in flat]


def test_dualpipev_overlap_pairs_are_timed_as_their_sum():
    pp, m = 4, 8
    orders, _ = rank_orders("dualpipev", pp, m)
    groups = {op.overlap_group for ops in orders.values() for op in ops} - {None}
    assert groups  # torch emits OVERLAP_F_B actions for DualPipeV
    res = simulate("dualpipev", pp, m, f=1.0, b=2.0, w=0.5)
    by_group: dict[tuple[int, int], list] = {}
    for a in res.timeline:
        if a.overlap_group is not None:
            by_group.setdefault((a.rank, a.overlap_group), []).append(a)
    assert by_group
    for pair in by_group.values():
        assert [a.kind for a in pair] == ["F", "B"]  # F first, as torch's runtime runs them
        assert pair[1].start >= pair[0].end
        assert _approx(sum(a.end - a.start for a in pair), 1.0 + 2.0 + 0.5)


# ---------------------------------------------------------------------------------------
# Closed forms
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("pp,m", [(2, 2), (2, 8), (4, 4), (4, 8), (4, 16), (8, 8), (8, 32)])
@pytest.mark.parametrize("f,b,w", [(1.0, 1.0, 0.0), (1.0, 2.0, 0.5)])
def test_bubble_gpipe_1f1b_closed_form(name, pp, m, f, b, w):
    res = simulate(name, pp, m, f, b, w)
    assert _approx(res.bubble_ratio, (pp - 1) / m)
    assert _approx(res.step_time, (m + pp - 1) * (f + b + w))
    assert all(_approx(x, m * (f + b + w)) for x in res.busy)
    assert _approx(res.bubble_fraction, (pp - 1) / (m + pp - 1))


@pytest.mark.parametrize(
    "pp,m,v", [(2, 4, 2), (2, 6, 3), (3, 6, 2), (4, 8, 2), (4, 8, 3), (4, 12, 4), (4, 16, 2), (8, 16, 2)]
)
@pytest.mark.parametrize("f,b,w", [(1.0, 1.0, 0.0), (1.0, 2.0, 0.5)])
def test_bubble_interleaved_closed_form(pp, m, v, f, b, w):
    res = simulate("interleaved_1f1b", pp, m, f, b, w, stages_per_rank=v)
    assert res.num_stages == pp * v
    assert _approx(res.bubble_ratio, (pp - 1) / (v * m))
    # same model cut into v chunks per rank: interleaving divides the 1F1B bubble by v
    one = simulate("1f1b", pp, m, f * v, b * v, w * v)
    assert _approx(one.step_time - res.step_time, (pp - 1) * (f + b + w) * (v - 1))


@pytest.mark.parametrize("name", ZERO_BUBBLE)
@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (4, 16), (8, 16)])
def test_zero_bubble_beats_1f1b(name, pp, m):
    # same model: one stage per rank costs (1, 1, 1); two chunks per rank cost half each
    base = simulate("1f1b", pp, m, 1.0, 1.0, 1.0)
    inter = simulate("interleaved_1f1b", pp, m, 0.5, 0.5, 0.5)
    zb = simulate(name, pp, m, 0.5, 0.5, 0.5)
    assert all(_approx(x, y) for x, y in zip(zb.busy, base.busy))
    assert zb.bubble_ratio < base.bubble_ratio
    assert zb.step_time < base.step_time
    assert zb.bubble_ratio < inter.bubble_ratio
    # F = I = W: only the unavoidable fill of the last rank is left, (pp-1) chunk forwards
    assert _approx(zb.step_time, m * 3.0 + (pp - 1) * 0.5)


# ---------------------------------------------------------------------------------------
# Activations
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("pp,m", [(2, 2), (2, 8), (4, 4), (4, 16), (8, 8), (8, 32)])
def test_peak_activations_1f1b_vs_gpipe(pp, m):
    one = simulate("1f1b", pp, m, 1.0, 2.0)
    gp = simulate("gpipe", pp, m, 1.0, 2.0)
    assert one.peak_activations[0] == min(pp, m)
    assert one.peak_activations == [min(pp - r, m) for r in range(pp)]
    assert gp.peak_activations == [m] * pp
    sized = simulate("1f1b", pp, m, 1.0, 2.0, activation_bytes=3.0e6)
    assert sized.peak_activation_bytes == [3.0e6 * k for k in one.peak_activations]
    assert one.peak_activation_bytes is None


@pytest.mark.parametrize("pp,m,v", [(2, 4, 2), (4, 4, 2), (4, 6, 2), (4, 8, 2), (4, 12, 4), (8, 16, 2)])
def test_peak_activations_interleaved(pp, m, v):
    # torch's _get_warmup_ops forwards, +1 for the first steady-state forward
    res = simulate("interleaved_1f1b", pp, m, 1.0, 2.0, stages_per_rank=v)
    mpr = m // max(1, m // pp)
    assert res.peak_activations == [min((v - 1) * mpr + 2 * (pp - 1 - r) + 1, v * m) for r in range(pp)]


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (4, 16), (8, 16)])
def test_zero_bubble_peak_activations(pp, m):
    # split backward: an activation lives until its W, so ZB1P's deferred W keep as many
    # chunk activations as 1F1B keeps full-rank ones on rank 0 (ZB paper: same memory)
    zb = simulate("interleaved_zero_bubble", pp, m, 1.0, 1.0, 1.0)
    assert zb.peak_activations == [2 * pp] * pp
    assert simulate("zbv", pp, m, 1.0, 1.0, 1.0).peak_activations == [2 * pp] * pp
    # DualPipeV: one more chunk in flight (DeepSeek-V3 report: PP + 1 activations)
    assert simulate("dualpipev", pp, m, 1.0, 1.0, 1.0).peak_activations == [2 * pp + 1] * pp
    # the I before a deferred W frees nothing: freeing at I would lower the last ranks
    orders, _ = rank_orders("interleaved_zero_bubble", pp, m)
    alive = peak = 0
    for op in orders[pp - 1]:
        alive += op.kind == "F"
        peak = max(peak, alive)
        alive -= op.kind == "I"
    assert peak < zb.peak_activations[pp - 1]


# ---------------------------------------------------------------------------------------
# p2p and unbalanced stages
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", SCHEDULES)
def test_step_time_increases_with_p2p(name):
    pp, m = 4, 8
    times = [simulate(name, pp, m, 1.0, 1.0, 0.5, p2p=x).step_time for x in (0.0, 0.01, 0.1, 0.5, 2.0)]
    assert all(a < b for a, b in zip(times, times[1:]))


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (8, 16)])
def test_gpipe_p2p_closed_form(pp, m):
    x = 0.3
    res = simulate("gpipe", pp, m, 1.0, 2.0, 0.5, p2p=x)
    assert _approx(res.step_time, (m + pp - 1) * 3.5 + 2 * (pp - 1) * x)


def test_p2p_free_between_stages_on_one_rank():
    # ZBV's V turn (stages pp-1 and pp on the last rank) is local: charging only that
    # boundary changes nothing.
    pp, m = 4, 8
    lat = [0.0] * (2 * pp - 1)
    base = simulate("zbv", pp, m, 1.0, 1.0, 1.0).step_time
    lat[pp - 1] = 5.0
    assert _approx(simulate("zbv", pp, m, 1.0, 1.0, 1.0, p2p=lat).step_time, base)
    lat[pp - 1], lat[0] = 0.0, 5.0
    assert simulate("zbv", pp, m, 1.0, 1.0, 1.0, p2p=lat).step_time > base


@pytest.mark.parametrize("seed", range(6))
def test_gpipe_unbalanced_closed_form(seed):
    rng = random.Random(seed)
    pp, m = rng.choice([2, 3, 4, 6]), rng.choice([1, 3, 8, 16])
    f = [rng.uniform(0.5, 2.0) for _ in range(pp)]
    b = [rng.uniform(0.5, 3.0) for _ in range(pp)]
    w = [rng.uniform(0.0, 1.0) for _ in range(pp)]
    bw = [x + y for x, y in zip(b, w)]
    res = simulate("gpipe", pp, m, f, b, w)
    # flow shop of identical jobs, forward then backward
    assert _approx(res.step_time, sum(f) + sum(bw) + (m - 1) * (max(f) + max(bw)))


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 4), (4, 16), (8, 16)])
def test_1f1b_slowest_stage_dominates(pp, m):
    for k in range(pp):
        f, b = [1.0] * pp, [2.0] * pp
        f[k], b[k] = 4.0, 8.0
        t = [x + y for x, y in zip(f, b)]
        res = simulate("1f1b", pp, m, f, b)
        # the slow stage never waits once its first micro-batch arrives; after its last
        # backward the gradient still crosses the stages before it
        assert _approx(res.step_time, m * t[k] + sum(t[:k]))
        assert _approx(res.idle[k], sum(t[:k]))
        assert max(res.idle) > res.idle[k]
    slow = simulate("1f1b", pp, 64, [1.0] * (pp - 1) + [10.0], 1.0)
    assert slow.step_time / (64 * 11.0) < 1.05


@pytest.mark.parametrize("name", SCHEDULES)
def test_timeline_is_consistent(name):
    pp, m = 4, 8
    x = 0.2
    num_stages = pp * (1 if name in ("gpipe", "1f1b") else 2)
    res = simulate(name, pp, m, [1.0 + 0.1 * s for s in range(num_stages)], 1.5, 0.5, p2p=x)
    orders, s2r = rank_orders(name, pp, m)
    end = {}
    for r in range(pp):
        tl = res.rank_timeline(r)
        assert [a.action for a in tl] == [str(op) for op in orders[r]]
        for a, nxt in zip(tl, tl[1:]):
            assert nxt.start >= a.end - 1e-12  # one at a time, in torch's order
        assert _approx(sum(a.end - a.start for a in tl) + res.idle[r], res.step_time)
        for a in tl:
            end[(a.kind, a.stage, a.microbatch)] = a.end
    for a in res.timeline:
        s, j = a.stage, a.microbatch
        hop = lambda t: x if s2r[t] != s2r[s] else 0.0  # noqa: E731
        if a.kind == "F" and s > 0:
            assert a.start >= end[("F", s - 1, j)] + hop(s - 1) - 1e-12
        if a.kind in ("B", "I"):
            assert a.start >= end[("F", s, j)] - 1e-12
            if s + 1 < res.num_stages:
                up = end.get(("B", s + 1, j), end.get(("I", s + 1, j)))
                assert a.start >= up + hop(s + 1) - 1e-12
        if a.kind == "W":
            assert a.start >= end[("I", s, j)] - 1e-12
    assert _approx(res.step_time, max(a.end for a in res.timeline))


# ---------------------------------------------------------------------------------------
# Inputs, errors, CSV
# ---------------------------------------------------------------------------------------


def test_names_and_errors():
    assert canonical_schedule("Interleaved1F1B") == "interleaved_1f1b"
    assert canonical_schedule("ScheduleZBVZeroBubble") == "zbv"
    assert canonical_schedule("DualPipeV") == "dualpipev"
    with pytest.raises(ValueError, match="unknown pipeline schedule"):
        canonical_schedule("pipedream")
    with pytest.raises(ValueError, match="Schedule1F1B"):
        simulate("1f1b", 4, 2, 1.0, 1.0)  # torch: 1F1B needs m >= pp
    with pytest.raises(ValueError, match="ScheduleDualPipeV"):
        simulate("dualpipev", 4, 6, 1.0, 1.0)  # torch: DualPipeV needs m >= 2 pp
    with pytest.raises(ValueError, match="exactly 2 stages"):
        simulate("zbv", 4, 8, 1.0, 1.0, stages_per_rank=3)
    with pytest.raises(ValueError, match="4 values"):
        simulate("gpipe", 4, 8, [1.0, 1.0], 1.0)
    with pytest.raises(ValueError, match=">= 0"):
        simulate("gpipe", 2, 2, -1.0, 1.0)


def test_deadlocking_order_is_reported():
    orders = {
        0: [ScheduleOp("F", 0, 0), ScheduleOp("B", 0, 0)],
        1: [ScheduleOp("B", 1, 0), ScheduleOp("F", 1, 0)],  # backward before its forward
    }
    with pytest.raises(ValueError, match="deadlock"):
        simulate_orders(orders, {0: 0, 1: 1}, 1.0, 1.0)
    good = {0: orders[0], 1: [ScheduleOp("F", 1, 0), ScheduleOp("B", 1, 0)]}
    assert _approx(simulate_orders(good, {0: 0, 1: 1}, 1.0, 1.0).step_time, 4.0)


def test_repeated_action_is_reported():
    # a micro-batch's backward twice, or as both a full backward and an input gradient
    for second in (ScheduleOp("B", 0, 0), ScheduleOp("I", 0, 0)):
        orders = {0: [ScheduleOp("F", 0, 0), ScheduleOp("B", 0, 0), second]}
        with pytest.raises(ValueError, match="appears twice"):
            simulate_orders(orders, {0: 0}, 1.0, 1.0)
    with pytest.raises(ValueError, match="micro-batch index"):
        simulate_orders({0: [ScheduleOp("F", 0, -1), ScheduleOp("B", 0, -1)]}, {0: 0}, 1.0, 1.0)


def test_csv_round_trip(tmp_path):
    pp, m = 4, 8
    from torch.distributed.pipelining._utils import generate_rank_to_stage_mapping

    class Stub:
        def __init__(self, s):
            self.stage_index, self.num_stages, self.group_size, self.group_rank = s, 2 * pp, pp, 0
            self.submod, self.stage_index_to_group_rank = None, None

    local = generate_rank_to_stage_mapping(pp, 2 * pp, style="v")[0]
    sched = tsched.ScheduleZBVZeroBubble([Stub(s) for s in local], m)
    path = tmp_path / "zbv.csv"
    sched._dump_csv(str(path), format="compute_only")  # torch's own writer
    orders, s2r = load_csv_orders(str(path), pp, m, 2 * pp)
    assert (orders, s2r) == rank_orders("zbv", pp, m)
    a = simulate_orders(orders, s2r, 1.0, 1.0, 1.0, p2p=0.1)
    assert _approx(a.step_time, simulate("zbv", pp, m, 1.0, 1.0, 1.0, p2p=0.1).step_time)


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (4, 16)])
def test_peak_activations_without_timing_equal_the_simulation(name, pp, m):
    stages = pp * default_stages_per_rank(canonical_schedule(name))
    result = simulate(name, pp, m, [1.0 + s % 3 for s in range(stages)], 2.0, 0.5, p2p=0.25)
    peaks, stage_to_rank = peak_activations(name, pp, m)
    assert peaks == result.peak_activations
    assert stage_to_rank == result.stage_to_rank


def test_adopted_orders_stand_in_for_torchs(monkeypatch):
    # orders made in another process (here: a pickled copy) are used as torch's
    import pickle

    from costmodel.schedules import book as schedule_book
    shape = ("interleaved_1f1b", 3, 12, 2)
    made = pickle.loads(pickle.dumps(schedule_book.orders_from_torch(*shape)))
    book = ScheduleBook()
    assert not book.holds(*shape)
    book.adopt(*shape, made)

    def torch_asked(*args):
        raise AssertionError("torch was asked again")

    monkeypatch.setattr(schedule_book, "orders_from_torch", torch_asked)
    assert book.holds(*shape)
    assert not ScheduleBook().holds(*shape)  # a book is its owner's only
    result = simulate("interleaved_1f1b", 3, 12, 1.0, 2.0, stages_per_rank=2, book=book)
    orders, s2r = rank_orders("interleaved_1f1b", 3, 12, 2, book=book)
    assert result == simulate_orders(orders, s2r, 1.0, 2.0, schedule="interleaved_1f1b",
                                     num_microbatches=12)


def test_a_book_asks_torch_once_per_shape(monkeypatch):
    """Orders, dependency order and peaks are made once per shape in a book
    (the same objects come back) and afresh without one."""
    from costmodel.schedules import book as schedule_book
    asked = []
    made = schedule_book.orders_from_torch
    monkeypatch.setattr(schedule_book, "orders_from_torch",
                        lambda *shape: asked.append(shape) or made(*shape))
    book = ScheduleBook()
    first = simulate("zbv", 3, 6, 1.0, 1.0, 1.0, book=book)
    assert simulate("ScheduleZBVZeroBubble", 3, 6, 1.0, 1.0, 1.0, book=book) == first
    assert peak_activations("zbv", 3, 6, book=book) == (first.peak_activations,
                                                         first.stage_to_rank)
    shape = schedule_book.schedule_shape("zbv", 3, 6)
    assert book.dependency_order(shape) is book.dependency_order(shape)
    assert book.peaks(shape) is book.peaks(shape)
    assert asked == [("zbv", 3, 6, 2)]
    simulate("zbv", 3, 6, 1.0, 1.0, 1.0)
    simulate("zbv", 3, 6, 1.0, 1.0, 1.0)
    assert len(asked) == 3


def test_no_module_level_memo():
    """No module of costmodel or planner keeps a process-wide memo (an
    lru_cache'd function): what a search remembers, its context holds (the
    schedule orders: a ScheduleBook)."""
    import functools
    import importlib
    import pkgutil

    import costmodel
    import planner

    for package in (costmodel, planner):
        for info in pkgutil.iter_modules(package.__path__, package.__name__ + "."):
            module = importlib.import_module(info.name)
            memos = [name for name, value in vars(module).items()
                     if isinstance(value, functools._lru_cache_wrapper)]
            assert not memos, (info.name, memos)


@pytest.mark.parametrize("name", SCHEDULES)
def test_splits_backward_is_what_torch_runs(name):
    """A schedule's ``splits_backward`` trait says whether torch's order for it
    has separate input- and weight-gradient actions (``I``/``W``)."""
    from costmodel.schedules.torch_orders import orders_from_torch

    spec = SCHEDULE_SPECS[name]
    pp, v = 2, spec.default_stages_per_rank
    orders, _ = orders_from_torch(name, pp, 2 * pp * v, v)
    kinds = {op[0] for ops in orders.values() for op in ops}
    assert spec.splits_backward == bool(kinds & {"I", "W"})
    assert (spec.zero_stage_problem(3) is not None) == spec.splits_backward
    assert spec.zero_stage_problem(2) is None


# ---------------------------------------------------------------------------------------
# Each stage's share of its rank's peak
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("pp,m,v", [(4, 8, 2), (4, 4, 3), (16, 32, 8)])
def test_stage_counts_at_peak_add_up_to_the_ranks_peak(pp, m, v):
    """The stages' counts at their rank's peak sum to the rank's peak count,
    and the last stage (the loss) holds one micro-batch at a time under
    interleaved 1F1B, whatever the rank's other stages hold."""
    from costmodel.schedules.peaks import stage_counts_at_peak

    orders, s2r = rank_orders("interleaved_1f1b", pp, m, v)
    peaks, _ = peak_activations("interleaved_1f1b", pp, m, v)
    counts = stage_counts_at_peak(orders, pp)
    for r in range(pp):
        assert sum(c for s, c in counts.items() if s2r[s] == r) == peaks[r]
    assert counts[pp * v - 1] == 1
    assert counts[0] > 1


def test_stage_counts_follow_the_bytes_weighted_peak():
    """With one stage far heavier per micro-batch, the peak is where it holds
    most: its own maximum, not the count peak's share."""
    from costmodel.schedules.peaks import live_activation_peaks, stage_counts_at_peak

    pp, m, v = 4, 8, 2
    orders, s2r = rank_orders("interleaved_1f1b", pp, m, v)
    heavy = 0  # rank 0's first stage
    act_b = {s: (1000.0 if s == heavy else 1.0) for s in s2r}
    counts = stage_counts_at_peak(orders, pp, act_b)
    own_max, alive = 0, 0
    for op in orders[0]:
        if op[1] == heavy and op[0] == "F":
            alive += 1
            own_max = max(own_max, alive)
        elif op[1] == heavy and op[0] in ("B", "W"):
            alive -= 1
    assert counts[heavy] == own_max
    _, peak_b = live_activation_peaks(orders, pp, [act_b[s] for s in range(pp * v)])
    assert sum(act_b[s] * c for s, c in counts.items() if s2r[s] == 0) == peak_b[0]
