"""Solving one assignment problem with OR-Tools, its checkpoint decisions
left to the model (:func:`solve_assignment`): shrunk first by
:func:`planner.ilp.eliminate.eliminate`, then enumerated when every strategy
is fixed, else built as a MIP (:func:`planner.ilp.formulation.build_formulation`) and
answered by its LP relaxation (GLOP) where that is integral, or by the MIP
backend, with the warm start as the floor of a time-limited answer. Times
are seconds."""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from typing import Any, Callable

from ortools.linear_solver import linear_solver_pb2, pywraplp
from ortools.linear_solver.python import model_builder_helper

from planner.ilp.eliminate import eliminate
from planner.ilp.formulation import SCALE, ArrayModel, Formulation, build_formulation
from planner.ilp.problem import AssignmentProblem, InfeasibleError, Solution

SOLVERS = ("CBC", "HIGHS", "SCIP", "CP_SAT")

_STATUS = {
    pywraplp.Solver.OPTIMAL: "OPTIMAL",
    pywraplp.Solver.FEASIBLE: "FEASIBLE",
    pywraplp.Solver.INFEASIBLE: "INFEASIBLE",
    pywraplp.Solver.UNBOUNDED: "UNBOUNDED",
    pywraplp.Solver.ABNORMAL: "ABNORMAL",
    pywraplp.Solver.NOT_SOLVED: "NOT_SOLVED",
}

# With one strategy per node, up to this many checkpoint decisions are enumerated.
_ENUMERATED_GROUPS = 10

# GLOP's dual simplex without presolve: on the llama3-8b stage and layer
# relaxations (~18k variables) 0.016 s against 0.05-0.08 s for the defaults
# (primal simplex after presolve), the same optimum.
_GLOP_PARAMETERS = "use_dual_simplex: true use_preprocessing: false"

# An LP value this close to 0 or 1 counts as integral.
_INTEGRAL_TOLERANCE = 1e-6


def _kept_of(hint_of: Callable[[], list[int] | None],
             kept: list[int]) -> Callable[[], list[int] | None]:
    """The hint of a reduced problem: ``hint_of()``'s strategies of the ``kept`` nodes."""
    def of() -> list[int] | None:
        hint = hint_of()
        return None if hint is None else [hint[v] for v in kept]
    return of


def solve_assignment(problem: AssignmentProblem, time_limit_s: float,
                     hint_of: Callable[[], list[int] | None], name: str,
                     reduce: bool) -> Solution:
    """:func:`planner.ilp.solve.solve` with the checkpoint decisions left to the
    model (backend ``name``, one of :data:`SOLVERS`; ``hint_of`` gives the
    hint). With ``reduce`` the problem is first shrunk exactly by
    :func:`planner.ilp.eliminate.eliminate`; the answer (choice, objective,
    checkpointing) is always for ``problem`` itself."""
    started = solve_assignment_relaxed(problem, time_limit_s, hint_of, name, reduce)
    return started if isinstance(started, Solution) else started.finish(time_limit_s)


class PendingMip:
    """An assignment problem whose LP relaxation was not integral: a lower
    bound of its optimum (:attr:`bound_s`, the weighted seconds of
    :meth:`AssignmentProblem.weighted` of the problem given) and what is
    left, the MIP (:meth:`finish`: the answer :func:`solve_assignment` gives)."""

    def __init__(self, bound_s: float, finish: Callable[[float, float | None], Solution]):
        self.bound_s = bound_s
        self._finish = finish

    def finish(self, time_limit_s: float, since: float | None = None) -> Solution:
        """The MIP solved within ``time_limit_s`` seconds counted from
        ``since`` (``time.monotonic()``; None: from the start of its LP
        relaxation, as :func:`solve_assignment` counts)."""
        return self._finish(time_limit_s, since)


def solve_assignment_relaxed(problem: AssignmentProblem, time_limit_s: float,
                             hint_of: Callable[[], list[int] | None], name: str,
                             reduce: bool) -> Solution | PendingMip:
    """:func:`solve_assignment` up to its MIP: the answer where no MIP is
    needed (every strategy fixed, or an integral LP relaxation), else a
    :class:`PendingMip` with the relaxation's bound, so that a caller
    comparing several problems (:mod:`planner.ilp.checkpointing`) can leave
    out a MIP that cannot win."""
    reduced = eliminate(problem) if reduce else None
    if reduced is None:
        return _solve_model(problem, time_limit_s, hint_of, name)
    started = _solve_model(reduced.problem, time_limit_s, _kept_of(hint_of, reduced.kept), name)
    if isinstance(started, PendingMip):
        return PendingMip(started.bound_s + reduced.offset, lambda limit, since: _expanded(
            problem, reduced, started.finish(limit, since)))
    return _expanded(problem, reduced, started)


def _expanded(problem: AssignmentProblem, reduced: Any, sol: Solution) -> Solution:
    """The answer ``sol`` of ``reduced`` (:func:`eliminate` of ``problem``) for ``problem``."""
    choice = reduced.expand(sol.choice)
    checkpoint = sol.checkpoint if reduced.kept_groups else [False] * len(problem.checkpoint_groups)
    value = problem.evaluate(choice, checkpoint)
    bound = value if sol.status == "OPTIMAL" else min(value, sol.bound_s + reduced.offset)
    return dataclasses.replace(sol, choice=choice, objective_s=value, bound_s=bound,
                               checkpoint=checkpoint)


def _solve_model(problem: AssignmentProblem, time_limit_s: float,
                 hint_of: Callable[[], list[int] | None], name: str) -> Solution | PendingMip:
    """:func:`solve_assignment_relaxed` without the reduction: the checkpoint
    decisions enumerated when every strategy is fixed, else the MIP (its LP
    relaxation first with CBC: a :class:`PendingMip` where that is not
    integral)."""
    if (all(len(c) == 1 for c in problem.node_costs)
            and len(problem.checkpoint_groups) <= _ENUMERATED_GROUPS):
        return _solve_fixed(problem, name)
    formulation = build_formulation(problem, integral_edges=name == "CP_SAT")
    started = time.monotonic()
    if name == "CBC":
        bound: list[float] = []
        integral = _integral_relaxation(problem, formulation.model, formulation.x,
                                        formulation.ckpt, time_limit_s, bound)
        if integral is not None:
            return integral
        if bound:  # the relaxation's optimum, fractional
            return PendingMip(bound[0], lambda limit, since: _solve_mip(
                problem, formulation, limit, started if since is None else since, hint_of,
                name))
    return _solve_mip(problem, formulation, time_limit_s, started, hint_of, name)


def _solve_fixed(problem: AssignmentProblem, name: str) -> Solution:
    """A problem whose strategies are all fixed: only the checkpoint decisions are
    left, so every combination is tried (exact, and far quicker than a MIP)."""
    choice = [0] * len(problem.node_costs)
    best: tuple[float, list[bool]] | None = None
    for ckpt in itertools.product((False, True), repeat=len(problem.checkpoint_groups)):
        if not problem.fits(choice, list(ckpt)):
            continue
        value = problem.weighted(choice, list(ckpt))
        if math.isfinite(value) and (best is None or value < best[0]):
            best = (value, list(ckpt))
    if best is None:
        raise InfeasibleError("the fixed strategies fit no checkpointing choice")
    seconds = problem.evaluate(choice, best[1])
    return Solution(choice=choice, objective_s=seconds, bound_s=seconds, status="OPTIMAL",
                    solver=name, num_variables=len(choice) + len(best[1]), num_constraints=0,
                    checkpoint=best[1])


def _integral_relaxation(problem: AssignmentProblem, model: ArrayModel,
                         x: list[list[int]], ckpt: list[int],
                         time_limit_s: float, bound: list[float] | None = None
                         ) -> Solution | None:
    """The MIP's optimum when its LP relaxation (solved by GLOP, the simplex)
    has an optimal vertex with every strategy and checkpoint variable at 0 or
    1; None otherwise (the caller then runs the MIP).

    Exact: the relaxation's optimum is a lower bound of the MIP's, and an
    integral vertex is a feasible assignment that attains it. The assignment's
    own weighted cost is checked against the LP objective, so a vertex that
    only looks integral within the tolerance is never taken. Without a memory
    budget (every profile and weighted solve) the relaxation of this
    formulation was integral on all 78 llama3-8b layer problems of a search,
    at 0.07 s each where CBC took 0.48 s; a budget that binds makes it
    fractional, and CBC decides."""
    lp = model_builder_helper.ModelSolverHelper("glop")
    lp.set_solver_specific_parameters(_GLOP_PARAMETERS)
    lp.set_time_limit_in_seconds(time_limit_s)
    lp.solve(model.solver_helper())
    if lp.status() != model_builder_helper.SolveStatus.OPTIMAL:
        return None
    if bound is not None:  # told to the caller: a lower bound of the MIP's optimum
        bound.append(lp.objective_value() / SCALE)
    solution = lp.variable_values().tolist()
    values = [[solution[i] for i in xs] for xs in x]
    decisions = [solution[i] for i in ckpt]
    if any(_INTEGRAL_TOLERANCE < v < 1 - _INTEGRAL_TOLERANCE
           for v in itertools.chain(decisions, *values)):
        return None
    choice = [max(range(len(vs)), key=vs.__getitem__) for vs in values]
    checkpoint = [d > 0.5 for d in decisions]
    bound = lp.objective_value() / SCALE
    weighted = problem.weighted(choice, checkpoint)
    if not (problem.fits(choice, checkpoint)
            and weighted <= bound + 1e-9 * max(1.0, abs(bound)) + 1e-12):
        return None
    value = problem.evaluate(choice, checkpoint)
    return Solution(choice=choice, objective_s=value, bound_s=value, status="OPTIMAL",
                    solver="GLOP", num_variables=len(model.objective),
                    num_constraints=len(model.row_lower), checkpoint=checkpoint)


def _solve_mip(problem: AssignmentProblem, formulation: Formulation, time_limit_s: float,
               started: float, hint_of: Callable[[], list[int] | None], name: str) -> Solution:
    """The MIP on backend ``name``, warm-started with ``hint_of()``, within
    ``time_limit_s`` counted from ``started`` (``time.monotonic()``)."""
    mip = _load(name, formulation.model.proto())
    hint = hint_of()
    x = [[mip.variable(i) for i in xs] for xs in formulation.x]
    ckpt = [mip.variable(i) for i in formulation.ckpt]
    if hint is not None:
        mip.SetHint([var for xs in x for var in xs],
                    [1.0 if j == hint[v] else 0.0 for v, xs in enumerate(x) for j in range(len(xs))])
    mip.SetTimeLimit(int(max(time_limit_s - (time.monotonic() - started), 0.05) * 1000))
    params = pywraplp.MPSolverParameters()
    params.SetDoubleParam(params.RELATIVE_MIP_GAP, 1e-9)
    status = mip.Solve(params)
    return _mip_answer(problem, mip, status, x, ckpt, hint, name)


def _mip_answer(problem: AssignmentProblem, mip: pywraplp.Solver, status: int,
                x: list[list[pywraplp.Variable]], ckpt: list[pywraplp.Variable],
                hint: list[int] | None, name: str) -> Solution:
    """The answer of a MIP that ended with ``status``: the warm start where
    the time limit left nothing, or something worse (the anytime floor
    :func:`planner.ilp.solve.solve` promises), else the solver's assignment."""
    fallback = warm_start_value(problem, hint) if hint is not None else None
    if status not in (pywraplp.Solver.OPTIMAL, pywraplp.Solver.FEASIBLE):
        if status == pywraplp.Solver.NOT_SOLVED and fallback is not None:
            # anytime answer: the time limit passed before the solver found anything,
            # so the warm start is the answer
            return _warm_start_solution(hint, fallback, 0.0, name, mip)
        raise InfeasibleError(f"{name} ended with status {_STATUS.get(status, status)}")
    choice = [max(range(len(xs)), key=lambda i: xs[i].solution_value()) for xs in x]
    checkpoint = [c.solution_value() > 0.5 for c in ckpt]
    value = problem.evaluate(choice, checkpoint)
    bound = mip.Objective().BestBound() / SCALE if status != pywraplp.Solver.OPTIMAL else value
    if (status != pywraplp.Solver.OPTIMAL and fallback is not None
            and problem.weighted(hint, fallback[1]) < problem.weighted(choice, checkpoint)):
        # CBC does not start from the hint (see planner.ilp.solve.solve): an answer cut off
        # by the time limit can be worse than the warm start, which is then the answer
        return _warm_start_solution(hint, fallback, min(fallback[0], bound), name, mip)
    return Solution(choice=choice, objective_s=value, bound_s=min(value, bound),
                    status=_STATUS[status], solver=name, num_variables=mip.NumVariables(),
                    num_constraints=mip.NumConstraints(), checkpoint=checkpoint)


def _load(name: str, proto: linear_solver_pb2.MPModelProto) -> pywraplp.Solver:
    """An OR-Tools solver of backend ``name`` holding the model ``proto``."""
    solver = pywraplp.Solver.CreateSolver(name)
    if solver is None:
        raise ValueError(f"OR-Tools was built without the {name} backend; use another solver")
    solver.SuppressOutput()
    error = solver.LoadModelFromProto(proto)
    if error:
        raise RuntimeError(f"OR-Tools rejected the model: {error}")
    return solver


def warm_start_value(problem: AssignmentProblem, hint: list[int]) -> tuple[float, list[bool]] | None:
    """(seconds, checkpoint decisions) of the warm start ``hint``: without
    checkpointing, or with every group checkpointed, whichever fits the memory
    budget and is cheaper; None when neither fits or the hint uses a forbidden pair."""
    options = []
    for on in (False, True):
        checkpoint = [on] * len(problem.checkpoint_groups)
        value = problem.evaluate(hint, checkpoint)
        if problem.fits(hint, checkpoint) and math.isfinite(value):
            options.append((value, checkpoint))
        if not problem.checkpoint_groups:
            break
    return min(options, key=lambda o: o[0]) if options else None


def _warm_start_solution(hint: list[int], fallback: tuple[float, list[bool]], bound_s: float,
                         name: str, mip: pywraplp.Solver) -> Solution:
    """The warm start as the answer (status ``TIME_LIMIT_WARM_START``):
    ``fallback`` is its (seconds, checkpoint decisions), ``bound_s`` a lower
    bound of the optimum's seconds."""
    return Solution(choice=list(hint), objective_s=fallback[0], bound_s=bound_s,
                    status="TIME_LIMIT_WARM_START", solver=name,
                    num_variables=mip.NumVariables(), num_constraints=mip.NumConstraints(),
                    checkpoint=list(fallback[1]))
