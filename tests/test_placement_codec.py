"""The one placement codec (ir.placements) and every reader of its strings.

Every string the codec writes goes through every reader: the codec's own
(``parse_placement``, ``parse_planned``), the cost model's (``reshard_steps``),
the check ``planner show`` and the launcher make of a plan
(``placement_error``), and the list reader the executor and the pipeline
stages read plans with (``parse_placements``); malformed strings are refused by
each with a message that names the string and the accepted forms.
"""

from __future__ import annotations

import json

import pytest
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from costmodel.resharding import reshard_steps
from ir.placements import (MASKED_PARTIAL, parse_placement, parse_placements, parse_planned,
                           placement_str)
from ir.torch_compat import mask_partial_type, strided_shard
from plan.format import Plan, SolverReport, placement_error

#: (plan string, a factory of the torch placement it stands for)
WRITTEN = [
    ("R", Replicate),
    ("S(0)", lambda: Shard(0)),
    ("S(1)", lambda: Shard(1)),
    ("S(2)", lambda: Shard(2)),
    ("S(0)[sf=2]", lambda: strided_shard(0, split_factor=2)),
    ("P", Partial),
    ("P(avg)", lambda: Partial("avg")),
    ("P(max)", lambda: Partial("max")),
    ("P(min)", lambda: Partial("min")),
    (MASKED_PARTIAL, lambda: mask_partial_type()()),
]
REQUESTABLE = [(text, make) for text, make in WRITTEN if text != MASKED_PARTIAL]
PRICED = [text for text, _ in REQUESTABLE if "[sf=" not in text]
MALFORMED = ["S(-1)", "S(x)", "Q", "P(foo)", ""]
ACCEPTED_FORMS = "expected R, S(d), S(d)[sf=k], P or P(op)"
TENSOR_SHAPE = (4, 8, 16)


def _assert_useful(message: str, text: str) -> None:
    """One line naming the placement ``text`` and the accepted forms."""
    assert "\n" not in message
    assert repr(text) in message
    assert ACCEPTED_FORMS in message


def _tiny_plan(placement: str) -> Plan:
    """A plan of one parameter placed ``placement`` on a 1-D mesh of 2,
    read back from its JSON text as a plan.json is."""
    plan = Plan(model={"name": "tiny"}, cluster={}, mesh={"shape": [2], "axis_names": ["tp"]},
                parameters={"w": [placement]}, inputs={}, nodes={}, reshards=[],
                predicted={}, solver=SolverReport("manual", "none", 0.0, 0.0, 0.0, 0.0))
    return Plan.from_dict(json.loads(plan.to_json()))


# ------------------------------------------------------------------ the codec
@pytest.mark.parametrize("text,make", WRITTEN, ids=[t for t, _ in WRITTEN])
def test_codec_writes_each_placement_as_its_string(text, make):
    assert placement_str(make()) == text


@pytest.mark.parametrize("text,make", REQUESTABLE, ids=[t for t, _ in REQUESTABLE])
def test_requestable_strings_round_trip(text, make):
    placement = parse_placement(text)
    assert type(placement) is type(make())
    assert placement == make()
    assert placement_str(placement) == text
    assert placement_str(parse_planned(text)) == text


def test_masked_partial_is_held_but_not_requested():
    assert parse_planned(MASKED_PARTIAL) is None
    with pytest.raises(ValueError, match="masked partial") as err:
        parse_placement(MASKED_PARTIAL)
    _assert_useful(str(err.value), MASKED_PARTIAL)


def test_reader_ignores_whitespace_and_reads_sum_as_p():
    assert parse_placement(" S( 1 ) ") == Shard(1)
    assert placement_str(parse_placement("P(sum)")) == "P"
    assert parse_planned(" P( mask ) ") is None


@pytest.mark.parametrize("text", MALFORMED)
def test_codec_refuses_malformed_strings(text):
    for reader in (parse_placement, parse_planned):
        with pytest.raises(ValueError) as err:
            reader(text)
        _assert_useful(str(err.value), text)


@pytest.mark.parametrize("text,what", [("S(-1)", "shard dim -1"), ("S(x)", "shard dim 'x'"),
                                       ("P(foo)", "reduce op 'foo'"),
                                       ("S(0)[sf=0]", "split factor 0")])
def test_refusal_names_the_wrong_field(text, what):
    with pytest.raises(ValueError, match=what):
        parse_placement(text)


def test_writer_refuses_what_no_reader_takes():
    with pytest.raises(ValueError, match="negative"):
        placement_str(Shard(-1))
    with pytest.raises(ValueError, match="no plan string"):
        placement_str("S(0)")


# ------------------------------------------------------------------ the cost model
@pytest.mark.parametrize("text", PRICED)
def test_cost_model_prices_each_plain_string(text):
    steps = reshard_steps([text], ["R"], TENSOR_SHAPE, 4, (2,))
    assert [s.src for s in steps] == ([] if text == "R" else [text])


def test_cost_model_refuses_a_strided_shard_as_unpriced():
    for given in ("S(0)[sf=2]", strided_shard(0, split_factor=2)):
        with pytest.raises(ValueError, match="strided shard, which the cost model does not price"):
            reshard_steps([given], ["R"], TENSOR_SHAPE, 4, (2,))


def test_cost_model_prices_a_masked_partial_object_as_a_partial():
    steps = reshard_steps([mask_partial_type()()], ["R"], TENSOR_SHAPE, 4, (2,))
    assert [(s.src, s.collective) for s in steps] == [(MASKED_PARTIAL, "all_reduce")]


@pytest.mark.parametrize("text", [*MALFORMED, MASKED_PARTIAL])
def test_cost_model_refuses_malformed_strings(text):
    with pytest.raises(ValueError) as err:
        reshard_steps([text], ["R"], TENSOR_SHAPE, 4, (2,))
    _assert_useful(str(err.value), text)


# ------------------------------------------------------------------ the launcher and executor
@pytest.mark.parametrize("text", [t for t, _ in WRITTEN])
def test_launcher_accepts_every_written_string(text):
    assert placement_error(_tiny_plan(text)) is None


@pytest.mark.parametrize("text", MALFORMED)
def test_launcher_refuses_malformed_strings(text):
    message = placement_error(_tiny_plan(text))
    assert message is not None and message.startswith("parameter w has placement")
    _assert_useful(message, text)


@pytest.mark.parametrize("text,make", REQUESTABLE, ids=[t for t, _ in REQUESTABLE])
def test_executor_list_reader_reads_every_requestable_string(text, make):
    assert parse_placements([text]) == [make()]


@pytest.mark.parametrize("text", [*MALFORMED, MASKED_PARTIAL])
def test_executor_list_reader_refuses_what_cannot_be_requested(text):
    with pytest.raises(ValueError) as err:
        parse_placements([text])
    _assert_useful(str(err.value), text)
