"""The assignment ILP finds the true optimum (checked against enumeration)."""

import itertools
import math

import pytest
from hypothesis import given, settings, strategies as st

from planner.ilp.solve import (SOLVERS, AssignmentProblem, InfeasibleError, brute_force, reduced_size,
                         solve)

costs = st.sampled_from([0.0, 0.0, 1e-6, 1e-3, 0.25, 0.5, 1.0, 2.0])


@st.composite
def problems(draw, allow_inf=True):
    n = draw(st.integers(2, 6))
    sizes = [draw(st.integers(1, 4)) for _ in range(n)]
    node_costs = [[draw(costs) for _ in range(k)] for k in sizes]
    edge_cost = st.one_of(costs, st.just(math.inf)) if allow_inf else costs
    edges = []
    for v in range(1, n):
        for u in sorted(set(draw(st.lists(st.integers(0, v - 1), min_size=1, max_size=2)))):
            edges.append((u, v, [[draw(edge_cost) for _ in range(sizes[v])]
                                 for _ in range(sizes[u])]))
    return AssignmentProblem(node_costs, edges)


def _solved_to_optimum(problem):
    """(solver's solution, brute-force optimum), the solution's objective checked
    to be the optimum; None when both find ``problem`` infeasible."""
    try:
        _, best = brute_force(problem)
    except InfeasibleError:
        with pytest.raises(InfeasibleError):
            solve(problem)
        return None
    solution = solve(problem)
    assert solution.objective_s == pytest.approx(best, rel=1e-9, abs=1e-12)
    return solution, best


@settings(max_examples=150, deadline=None)
@given(problems())
def test_ilp_optimum_equals_brute_force(problem):
    solved = _solved_to_optimum(problem)
    if solved is None:
        return
    solution, best = solved
    assert solution.status == "OPTIMAL"
    assert problem.evaluate(solution.choice) == pytest.approx(best, rel=1e-9, abs=1e-12)
    assert solution.gap == pytest.approx(0.0, abs=1e-9)


@pytest.mark.parametrize("solver", SOLVERS)
def test_every_backend_agrees(solver):
    problem = AssignmentProblem(
        node_costs=[[1.0, 0.0], [0.0, 3.0], [2.0, 0.5]],
        edges=[(0, 1, [[0.0, 5.0], [4.0, 0.0]]), (1, 2, [[0.0, 1.0], [1.0, 0.0]])])
    _, best = brute_force(problem)
    assert solve(problem, solver=solver).objective_s == pytest.approx(best)


def test_unknown_solver_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown solver"):
        solve(AssignmentProblem([[0.0]]), solver="gurobi")


@st.composite
def memory_problems(draw):
    problem = draw(problems(allow_inf=False))
    problem.node_memory = [[float(draw(st.integers(0, 8))) for _ in c] for c in problem.node_costs]
    least = sum(min(m) for m in problem.node_memory)
    most = sum(max(m) for m in problem.node_memory)
    problem.memory_budget = float(draw(st.integers(int(least), int(most))))
    return problem


@settings(max_examples=150, deadline=None)
@given(memory_problems())
def test_ilp_with_memory_budget_equals_brute_force(problem):
    choice_bf, best = brute_force(problem)
    solution = solve(problem)
    assert problem.fits(solution.choice)
    assert solution.objective_s == pytest.approx(best, rel=1e-9, abs=1e-12)


def test_time_limit_without_solution_returns_the_warm_start(monkeypatch):
    import planner.ilp.backends as ilp

    _fake_backend(monkeypatch, ilp.pywraplp.Solver.NOT_SOLVED)
    problem = AssignmentProblem([[1.0, 0.0], [0.0, 1.0]], [(0, 1, [[0.0, 1.0], [1.0, 0.0]])])
    sol = solve(problem, hint=[0, 0], reduce=False)  # reduced, the problem needs no MIP
    assert sol.choice == [0, 0] and sol.status == "TIME_LIMIT_WARM_START"
    assert sol.objective_s == pytest.approx(1.0) and sol.gap == pytest.approx(1.0)
    with pytest.raises(InfeasibleError):
        solve(problem, reduce=False)


@st.composite
def checkpoint_problems(draw):
    from planner.ilp.solve import CheckpointGroup

    problem = draw(memory_problems())
    n = len(problem.node_costs)
    nodes = sorted(set(draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=3))))
    saved = [[float(draw(st.integers(0, int(m)))) for m in problem.node_memory[v]] for v in nodes]
    recompute = [[draw(costs) for _ in problem.node_costs[v]] for v in nodes]
    kept = [[float(draw(st.integers(0, 2))) for _ in problem.node_costs[v]] for v in nodes]
    problem.checkpoint_groups = [CheckpointGroup(nodes, saved, recompute, kept)]
    most = sum(max(m) for m in problem.node_memory) + 2
    problem.memory_budget = float(draw(st.integers(0, int(most))))
    return problem


@settings(max_examples=150, deadline=None)
@given(checkpoint_problems())
def test_ilp_with_checkpointing_decision_equals_brute_force(problem):
    solved = _solved_to_optimum(problem)
    if solved is not None:
        assert problem.fits(solved[0].choice, solved[0].checkpoint)


@st.composite
def weighted_checkpoint_problems(draw):
    """Memory priced at a weight (no budget) and up to two checkpoint groups:
    how the search's layer profiles trade time for memory."""
    from planner.ilp.solve import CheckpointGroup

    problem = draw(memory_problems())
    problem.memory_budget = None
    problem.memory_weight = draw(st.sampled_from([0.01, 0.1, 1.0, 10.0]))
    n = len(problem.node_costs)
    nodes = sorted(set(draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=4))))
    split = draw(st.integers(1, len(nodes)))
    for members in (nodes[:split], nodes[split:]):
        if not members:
            continue
        saved = [[float(draw(st.integers(0, int(m)))) for m in problem.node_memory[v]]
                 for v in members]
        recompute = [[draw(costs) for _ in problem.node_costs[v]] for v in members]
        kept = [[float(draw(st.integers(0, 2))) for _ in problem.node_costs[v]]
                for v in members]
        problem.checkpoint_groups.append(CheckpointGroup(members, saved, recompute, kept))
    return problem


@settings(max_examples=150, deadline=None)
@given(weighted_checkpoint_problems())
def test_weighted_checkpointing_skips_only_combinations_that_cannot_win(problem):
    """Without a budget, checkpoint combinations that cannot beat the
    all-checkpointed optimum go unsolved: the answer is the weighted optimum
    (brute force), and the same one as solving every combination."""
    import planner.ilp.checkpointing as ilp

    best = min(problem.weighted(list(choice), list(ckpt))
               for choice in itertools.product(*(range(len(c)) for c in problem.node_costs))
               for ckpt in itertools.product((False, True), repeat=len(problem.checkpoint_groups)))
    solution = solve(problem)
    assert problem.weighted(solution.choice, solution.checkpoint) == pytest.approx(
        best, rel=1e-9, abs=1e-12)
    every = ilp._least_change
    try:
        ilp._least_change = lambda *args: -math.inf  # nothing skipped
        unskipped = solve(problem)
    finally:
        ilp._least_change = every
    assert (unskipped.choice, unskipped.checkpoint) == (solution.choice, solution.checkpoint)


def _fake_backend(monkeypatch, status):
    """CreateSolver returns solvers whose Solve only reports ``status`` (all
    variables stay 0, so every node reads as taking strategy 0), and the LP
    relaxation never answers, so that the MIP backend decides."""
    import planner.ilp.backends as ilp

    monkeypatch.setattr(ilp, "_integral_relaxation", lambda *args: None)

    class Fake:
        def __init__(self, real):
            self.real = real

        def __getattr__(self, name):
            return getattr(self.real, name)

        def Solve(self, *args):
            return status

    create = ilp.pywraplp.Solver.CreateSolver
    monkeypatch.setattr(ilp.pywraplp.Solver, "CreateSolver",
                        staticmethod(lambda name: Fake(create(name))))


def test_time_limited_answer_is_never_worse_than_the_warm_start(monkeypatch):
    """A search cut off with a FEASIBLE answer worse than the hint returns the hint."""
    import planner.ilp.backends as ilp

    _fake_backend(monkeypatch, ilp.pywraplp.Solver.FEASIBLE)
    problem = AssignmentProblem([[1.0, 0.0], [0.0, 1.0]], [(0, 1, [[2.0, 5.0], [1.0, 0.0]])])
    sol = solve(problem, hint=[1, 0], reduce=False)  # 0 + 0 + 1; the all-zero answer costs 3
    assert sol.choice == [1, 0] and sol.status == "TIME_LIMIT_WARM_START"
    assert sol.objective_s == pytest.approx(1.0)
    # a hint that is worse than the solver's answer (7 s) is not taken
    sol = solve(problem, hint=[0, 1], reduce=False)
    assert sol.choice == [0, 0] and sol.status == "FEASIBLE"


def test_warm_start_checkpoints_when_that_is_what_fits(monkeypatch):
    import planner.ilp.backends as ilp
    from planner.ilp.solve import CheckpointGroup

    _fake_backend(monkeypatch, ilp.pywraplp.Solver.NOT_SOLVED)
    problem = AssignmentProblem([[1.0, 0.0], [0.0, 1.0]], [(0, 1, [[0.0, 1.0], [1.0, 0.0]])],
                                node_memory=[[4.0, 4.0], [4.0, 4.0]], memory_budget=6.0,
                                checkpoint_groups=[CheckpointGroup([0], [[3.0, 3.0]], [[0.5, 0.5]],
                                                                   [[1.0, 1.0]])])
    sol = solve(problem, hint=[0, 0], reduce=False)
    assert sol.status == "TIME_LIMIT_WARM_START" and sol.checkpoint == [True]
    assert sol.objective_s == pytest.approx(1.5) and problem.fits(sol.choice, sol.checkpoint)


def test_greedy_assignment_follows_allowed_and_producers():
    from planner.ilp.solve import greedy_assignment

    problem = AssignmentProblem(
        node_costs=[[0.0, 0.0], [1.0, 1.0, 0.5], [0.0, 0.0]],
        edges=[(0, 1, [[0.0, 2.0, 2.0], [2.0, 0.0, 2.0]]), (1, 2, [[0.0, 1.0], [1.0, 0.0], [1.0, 1.0]])])
    # node 0 pinned to strategy 1: node 1 follows it (1 + 0 < 0.5 + 2), node 2 follows node 1
    assert greedy_assignment(problem, [[1], None, None]) == [1, 1, 1]
    # unpinned, ties go to the lowest index
    assert greedy_assignment(problem) == [0, 0, 0]


@settings(max_examples=100, deadline=None)
@given(checkpoint_problems())
def test_elimination_keeps_the_optimum(problem):
    """Solving the eliminated problem gives the optimum of the original one, with
    and without a memory budget."""
    import dataclasses

    for p in (problem, dataclasses.replace(problem, memory_budget=None)):
        try:
            _, best = brute_force(p)
        except InfeasibleError:
            with pytest.raises(InfeasibleError):
                solve(p)
            continue
        sol = solve(p)
        assert p.fits(sol.choice, sol.checkpoint)
        assert sol.objective_s == pytest.approx(best, rel=1e-9, abs=1e-12)
        assert p.evaluate(sol.choice, sol.checkpoint) == pytest.approx(sol.objective_s)


def test_elimination_collapses_a_chain_but_not_memory_under_a_budget():
    from planner.ilp.solve import eliminate

    swap = [[0.0, 1.0, 2.0], [1.0, 0.0, 1.0], [2.0, 1.0, 0.0]]
    problem = AssignmentProblem(
        node_costs=[[0.0, 1.0, 1.0], [3.0, 0.0, 3.0], [2.0, 2.0, 0.5], [0.0, 0.0, 0.0],
                    [1.0, 0.0, 1.0]],
        edges=[(v, v + 1, swap) for v in range(4)] + [(0, 4, swap)],  # a ring of 5
        node_memory=[[1.0] * 3, [0.0] * 3, [0.0] * 3, [2.0, 1.0, 1.0], [0.0] * 3],
        memory_budget=10.0)
    reduced = eliminate(problem)
    assert reduced is not None and reduced.kept == [0, 3]  # the memory-holding nodes stay
    assert len(reduced.problem.node_costs) == 2 and len(reduced.problem.edges) == 1
    choice, best = brute_force(problem)
    sol = solve(problem)
    assert sol.objective_s == pytest.approx(best) and sol.status == "OPTIMAL"
    assert reduced_size(problem) < problem.size()
    # no budget: memory does not matter and the whole ring goes
    import dataclasses
    free = dataclasses.replace(problem, memory_budget=None)
    assert eliminate(free).kept == [] and solve(free).objective_s == pytest.approx(best)


def test_integral_relaxation_answers_without_the_mip_and_a_binding_budget_uses_it():
    """Without a budget the LP relaxation of this chain is integral, so GLOP's
    vertex is the answer; a budget that cuts the LP optimum in half (a knapsack)
    leaves a fractional vertex, and CBC finds the integral optimum."""
    chain = AssignmentProblem(
        node_costs=[[1.0, 0.0], [0.0, 3.0], [2.0, 0.5]],
        edges=[(0, 1, [[0.0, 5.0], [4.0, 0.0]]), (1, 2, [[0.0, 1.0], [1.0, 0.0]])])
    unconstrained = solve(chain, reduce=False)
    assert unconstrained.solver == "GLOP" and unconstrained.status == "OPTIMAL"
    assert unconstrained.objective_s == pytest.approx(brute_force(chain)[1])

    knapsack = AssignmentProblem(node_costs=[[0.0, 3.0], [0.0, 2.0], [0.0, 2.0]],
                                 node_memory=[[4.0, 0.0], [3.0, 0.0], [3.0, 0.0]],
                                 memory_budget=5.0)
    solution = solve(knapsack, reduce=False)
    assert solution.solver == "CBC"
    assert solution.objective_s == pytest.approx(brute_force(knapsack)[1])  # 4.0
    assert knapsack.fits(solution.choice)


def test_a_hint_given_as_a_function_is_made_only_when_a_mip_runs():
    """A warm start may be a function: the search passes one, since making
    it costs time and the LP relaxation is integral on almost every layer
    problem. It is called once where the MIP runs, never where GLOP answers,
    and the answers are those of the hint given as a list."""
    made = []

    def hint_of(hint):
        return lambda: made.append(hint) or hint

    chain = AssignmentProblem(
        node_costs=[[1.0, 0.0], [0.0, 3.0], [2.0, 0.5]],
        edges=[(0, 1, [[0.0, 5.0], [4.0, 0.0]]), (1, 2, [[0.0, 1.0], [1.0, 0.0]])])
    assert solve(chain, hint=hint_of([0, 0, 0])) == solve(chain, hint=[0, 0, 0])
    assert made == []
    knapsack = AssignmentProblem(node_costs=[[0.0, 3.0], [0.0, 2.0], [0.0, 2.0]],
                                 node_memory=[[4.0, 0.0], [3.0, 0.0], [3.0, 0.0]],
                                 memory_budget=5.0)
    lazily = solve(knapsack, hint=hint_of([1, 1, 1]), reduce=False)
    assert made == [[1, 1, 1]]
    assert lazily.solver == "CBC" and lazily == solve(knapsack, hint=[1, 1, 1], reduce=False)
