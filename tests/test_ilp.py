"""The assignment ILP finds the true optimum (checked against enumeration)."""

import math

import pytest
from hypothesis import given, settings, strategies as st

from planner.ilp import SOLVERS, AssignmentProblem, InfeasibleError, brute_force, solve

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


def _solve_and_enumerate(problem):
    """(solver's solution, brute-force optimum); None when both find it infeasible."""
    try:
        _, best = brute_force(problem)
    except InfeasibleError:
        with pytest.raises(InfeasibleError):
            solve(problem)
        return None
    return solve(problem), best


@settings(max_examples=150, deadline=None)
@given(problems())
def test_ilp_optimum_equals_brute_force(problem):
    solved = _solve_and_enumerate(problem)
    if solved is None:
        return
    solution, best = solved
    assert solution.status == "OPTIMAL"
    assert solution.objective_s == pytest.approx(best, rel=1e-9, abs=1e-12)
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
    import planner.ilp as ilp

    class NeverSolves:
        def __init__(self, real):
            self.real = real

        def __getattr__(self, name):
            return getattr(self.real, name)

        def Solve(self, *args):
            return ilp.pywraplp.Solver.NOT_SOLVED

    create = ilp.pywraplp.Solver.CreateSolver
    monkeypatch.setattr(ilp.pywraplp.Solver, "CreateSolver",
                        staticmethod(lambda name: NeverSolves(create(name))))
    problem = AssignmentProblem([[1.0, 0.0], [0.0, 1.0]], [(0, 1, [[0.0, 1.0], [1.0, 0.0]])])
    sol = solve(problem, hint=[0, 0])
    assert sol.choice == [0, 0] and sol.status == "TIME_LIMIT_WARM_START"
    assert sol.objective_s == pytest.approx(1.0) and sol.gap == pytest.approx(1.0)
    with pytest.raises(InfeasibleError):
        solve(problem)


@st.composite
def checkpoint_problems(draw):
    from planner.ilp import CheckpointGroup

    problem = draw(memory_problems())
    n = len(problem.node_costs)
    nodes = sorted(set(draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=3))))
    saved = [[float(draw(st.integers(0, int(m)))) for m in problem.node_memory[v]] for v in nodes]
    recompute = [[draw(costs) for _ in problem.node_costs[v]] for v in nodes]
    problem.checkpoint_groups = [CheckpointGroup(nodes, saved, recompute,
                                                 kept=float(draw(st.integers(0, 2))))]
    most = sum(max(m) for m in problem.node_memory) + 2
    problem.memory_budget = float(draw(st.integers(0, int(most))))
    return problem


@settings(max_examples=150, deadline=None)
@given(checkpoint_problems())
def test_ilp_with_checkpointing_decision_equals_brute_force(problem):
    solved = _solve_and_enumerate(problem)
    if solved is None:
        return
    solution, best = solved
    assert problem.fits(solution.choice, solution.checkpoint)
    assert solution.objective_s == pytest.approx(best, rel=1e-9, abs=1e-12)
