"""The schedule registry (costmodel.schedules.specs) against torch's classes and orders."""

from __future__ import annotations

import pytest
import torch.distributed.pipelining.schedules as tsched
from torch.distributed.pipelining._utils import generate_rank_to_stage_mapping
from torch.distributed.pipelining.schedules import _Action, _validate_schedule

from costmodel.schedules.specs import (SCHEDULE_SPECS, SCHEDULES, canonical_schedule,
                                      default_stages_per_rank, schedule_spec)
from costmodel.schedules import ScheduleBook, rank_orders

# torch's action type of each kind of a compute order
_KIND_TYPES = {"F": tsched.FORWARD, "B": tsched.FULL_BACKWARD, "I": tsched.BACKWARD_INPUT,
               "W": tsched.BACKWARD_WEIGHT}


@pytest.mark.parametrize("name", SCHEDULES)
def test_spec_names_a_torch_class_and_reads_its_kind(name):
    spec = SCHEDULE_SPECS[name]
    assert spec.name == name and spec.torch_type.__name__ == spec.torch_class
    single = issubclass(spec.torch_type, tsched.PipelineScheduleSingle)
    assert single != issubclass(spec.torch_type, tsched.PipelineScheduleMulti)
    assert spec.single_stage == single
    assert spec.style in ("loop", "v")
    assert spec.default_stages_per_rank == (1 if single else 2)
    assert default_stages_per_rank(name) == spec.default_stages_per_rank


def test_every_name_torch_and_earlier_releases_use_is_known():
    for short in ("1F1B", "Interleaved1F1B", "GPipe", "LoopedBFS", "InterleavedZeroBubble",
                  "ZBVZeroBubble", "DualPipeV"):
        assert schedule_spec(short).torch_type is tsched.get_schedule_class(short)
    for alias, name in {"schedulegpipe": "gpipe", "Schedule1F1B": "1f1b",
                        "interleaved-1f1b": "interleaved_1f1b", "looped bfs": "looped_bfs",
                        "interleavedzb": "interleaved_zero_bubble",
                        "zb1p": "interleaved_zero_bubble", "ZBV": "zbv",
                        "scheduledualpipev": "dualpipev"}.items():
        assert canonical_schedule(alias) == name
    keys = [key for spec in SCHEDULE_SPECS.values() for key in spec.names]
    assert len(keys) == len(set(keys))  # no name for two schedules
    with pytest.raises(ValueError, match="unknown pipeline schedule"):
        canonical_schedule("pipedream")
    with pytest.raises(TypeError):
        canonical_schedule(3)


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("pp", [1, 2, 3, 4])
def test_stage_to_rank_is_torchs_placement(name, pp):
    """The one stage -> rank map is what torch's orders run, and loop (s % pp)
    or V (rank r runs r and 2pp - 1 - r)."""
    spec = SCHEDULE_SPECS[name]
    m = spec.min_microbatches(pp) * 2
    orders, s2r = rank_orders(name, pp, m, book=ScheduleBook())
    assert spec.stage_to_rank(pp) == s2r
    # what torch infers from the order itself
    actions = {r: [_Action(op.stage, _KIND_TYPES[op.kind], op.microbatch) for op in order]
               for r, order in orders.items()}
    assert _validate_schedule(actions, pp, pp * spec.default_stages_per_rank, m) == s2r
    v = spec.default_stages_per_rank
    if spec.style == "v":
        assert all(s2r[r] == r and s2r[2 * pp - 1 - r] == r for r in range(pp))
    else:
        assert s2r == {s: s % pp for s in range(pp * v)}
    for rank in range(pp):
        assert spec.rank_stages(pp, rank) == sorted(s for s, r in s2r.items() if r == rank)


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("pp", [2, 3, 4])
def test_min_microbatches_is_torchs_check(name, pp):
    spec = SCHEDULE_SPECS[name]
    fewest = spec.min_microbatches(pp)
    assert fewest == {"1f1b": pp, "dualpipev": 2 * pp}.get(name, 1)
    rank_orders(name, pp, fewest)
    if fewest > 1:
        with pytest.raises(ValueError, match=spec.torch_class):
            rank_orders(name, pp, fewest - 1)


@pytest.mark.parametrize("name", [n for n in SCHEDULES if SCHEDULE_SPECS[n].style == "v"])
@pytest.mark.parametrize("v", [1, 3])
def test_v_schedules_run_two_stages_per_rank_as_torch_checks(name, v):
    spec = SCHEDULE_SPECS[name]
    with pytest.raises(ValueError, match="exactly 2 stages per rank"):
        spec.stages_per_rank(v)
    pp = 2

    class Stub:
        def __init__(self, s):
            self.stage_index, self.num_stages, self.group_size, self.group_rank = s, v * pp, pp, 0
            self.submod, self.stage_index_to_group_rank = None, None

    stubs = [Stub(s) for s in generate_rank_to_stage_mapping(pp, v * pp, style="v")[0]]
    with pytest.raises(ValueError, match="exactly 2 stages per rank"):
        spec.torch_type(stubs, 8)


@pytest.mark.parametrize("name", [n for n in SCHEDULES if SCHEDULE_SPECS[n].single_stage])
def test_single_stage_schedules_refuse_more_stages_per_rank(name):
    spec = SCHEDULE_SPECS[name]
    assert spec.stages_per_rank(None) == spec.stages_per_rank(1) == 1
    with pytest.raises(ValueError, match="one stage per rank"):
        spec.stages_per_rank(2)
    with pytest.raises(ValueError, match="integer >= 1"):
        spec.stages_per_rank(0)
