"""A weight on memory (seconds per byte) makes the ILP minimise seconds plus
weighted bytes: checked against enumeration, with and without checkpointing."""

import itertools
import math

import pytest
from hypothesis import given, settings, strategies as st

from planner.ilp.solve import solve
from test_ilp import checkpoint_problems, memory_problems


def _weighted_optimum(problem) -> float:
    best = math.inf
    for choice in itertools.product(*(range(len(c)) for c in problem.node_costs)):
        for ckpt in itertools.product((False, True), repeat=len(problem.checkpoint_groups)):
            if problem.fits(list(choice), list(ckpt)):
                best = min(best, problem.weighted(list(choice), list(ckpt)))
    return best


@settings(max_examples=120, deadline=None)
@given(st.one_of(memory_problems(), checkpoint_problems()),
       st.sampled_from([1e-3, 0.05, 0.3, 2.0]))
def test_weighted_optimum_equals_enumeration(problem, weight):
    problem.memory_budget = None  # the weight alone prices memory
    problem.memory_weight = weight
    best = _weighted_optimum(problem)
    solution = solve(problem)
    assert solution.status == "OPTIMAL"
    assert problem.weighted(solution.choice, solution.checkpoint) == pytest.approx(
        best, rel=1e-7, abs=1e-9)
    # the reported objective stays seconds
    assert solution.objective_s == pytest.approx(
        problem.evaluate(solution.choice, solution.checkpoint), rel=1e-9, abs=1e-12)


def test_a_larger_weight_never_uses_more_memory():
    """The weighted optimum's memory falls as the weight grows (a Pareto sweep)."""
    from planner.ilp.solve import AssignmentProblem, CheckpointGroup
    problem = AssignmentProblem(
        node_costs=[[1.0, 1.5, 3.0], [0.5, 0.5]],
        edges=[(0, 1, [[0.0, 0.1], [0.1, 0.0], [0.2, 0.2]])],
        node_memory=[[8.0, 4.0, 1.0], [2.0, 2.0]],
        checkpoint_groups=[CheckpointGroup([1], [[1.5, 1.5]], [[0.4, 0.4]], [[0.2, 0.2]])])
    memories = []
    for weight in (0.0, 0.05, 0.2, 1.0, 10.0):
        problem.memory_weight = weight
        s = solve(problem)
        memories.append(problem.memory(s.choice, s.checkpoint))
    assert memories == sorted(memories, reverse=True)
    assert memories[0] > memories[-1]
