"""The strategy-assignment ILP, solved with OR-Tools (CBC by default).

Abstract form (Alpa's intra-op formulation): pick one strategy per node to
minimise the sum of node costs plus, on every edge (u, v), the cost of the pair
of strategies chosen at its ends. All costs are seconds.

Before solving, nodes that cannot matter to the memory budget and have at most
two neighbours are eliminated exactly (:func:`eliminate`: chains of views,
element-wise ops and tuple projections collapse into one edge). Edge matrices
are then compressed exactly: producer strategies with an identical cost row (and
consumer strategies with an identical column) share edge variables, and an edge
whose cost depends on one end only is folded into that node's cost. The MIP is
kept as arrays (a scipy sparse matrix of its rows) and handed to OR-Tools in one
call: its LP relaxation through the model builder, the MIP as an ``MPModelProto``.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Union

import numpy as np
import scipy.sparse
from ortools.linear_solver import linear_solver_pb2, pywraplp
from ortools.linear_solver.python import model_builder_helper

# Costs enter the solver in microseconds, so solver tolerances (about 1e-6 in
# objective units) are far below any cost difference that matters.
_SCALE = 1e6
_STATUS = {
    pywraplp.Solver.OPTIMAL: "OPTIMAL",
    pywraplp.Solver.FEASIBLE: "FEASIBLE",
    pywraplp.Solver.INFEASIBLE: "INFEASIBLE",
    pywraplp.Solver.UNBOUNDED: "UNBOUNDED",
    pywraplp.Solver.ABNORMAL: "ABNORMAL",
    pywraplp.Solver.NOT_SOLVED: "NOT_SOLVED",
}


class InfeasibleError(RuntimeError):
    """No assignment satisfies the constraints."""


@dataclass
class CheckpointGroup:
    """Nodes whose saved activations may be dropped together and recomputed in
    backward (activation checkpointing of one layer, or of all copies of a tied one).

    Attributes:
        nodes: problem node indices.
        saved: ``saved[k][i]``: bytes of ``node_memory[nodes[k]][i]`` that
            checkpointing frees.
        recompute: ``recompute[k][i]``: seconds to recompute node ``nodes[k]``
            under strategy i in backward.
        kept: ``kept[k][i]``: bytes per device the group keeps for the backward
            when checkpointed and node ``nodes[k]`` runs strategy i (the layer
            inputs that node reads, as it reads them); empty: nothing kept.
    """

    nodes: list[int]
    saved: list[list[float]]
    recompute: list[list[float]]
    kept: list[list[float]] = field(default_factory=list)

    def net_freed(self, k: int) -> list[float]:
        """Bytes per device checkpointing frees at node ``nodes[k]``, per strategy:
        what it saves less what it keeps (negative where it keeps more)."""
        if not self.kept:
            return list(self.saved[k])
        return [s - h for s, h in zip(self.saved[k], self.kept[k])]


class EdgeMatrix(list):
    """An edge's cost matrix as :class:`AssignmentProblem` holds it (a list
    of rows, seconds) that keeps its numpy copy once made: one problem is
    solved many times over (memory weights, checkpoint combinations), and
    :func:`eliminate` reads every matrix as an array each time (~0.2 s of a
    llama3-8b search)."""

    @functools.cached_property
    def array(self) -> np.ndarray:
        return np.asarray(self, dtype=float)


def _as_array(m: list[list[float]]) -> np.ndarray:
    """An edge's cost matrix as a float array (kept by an :class:`EdgeMatrix`)."""
    return m.array if isinstance(m, EdgeMatrix) else np.asarray(m, dtype=float)


@dataclass
class AssignmentProblem:
    """Strategy choice problem.

    Attributes:
        node_costs: ``node_costs[v][i]``: seconds if node v takes strategy i.
        edges: ``(u, v, cost)`` with ``cost[i][j]`` seconds when u takes i and
            v takes j; ``math.inf`` forbids the pair.
        node_memory: ``node_memory[v][i]``: bytes per device node v holds under
            strategy i (optional).
        memory_budget: bytes per device the chosen strategies may hold in total.
        checkpoint_groups: groups the solver may checkpoint (a yes/no decision each).
        memory_weight: seconds per byte the solver adds to its objective for the
            memory of the assignment (a Lagrange multiplier of the memory: a
            larger weight trades time for memory without a budget row, whose
            knapsack structure is what makes a MIP slow). Reported objectives
            stay seconds (:meth:`evaluate`); the solver minimises
            :meth:`weighted`.
    """

    node_costs: list[list[float]]
    edges: list[tuple[int, int, list[list[float]]]] = field(default_factory=list)
    node_memory: list[list[float]] | None = None
    memory_budget: float | None = None
    checkpoint_groups: list[CheckpointGroup] = field(default_factory=list)
    memory_weight: float = 0.0

    @property
    def memory_matters(self) -> bool:
        """Whether memory enters the answer (a budget, or a weight on memory)."""
        return self.node_memory is not None and (self.memory_budget is not None
                                                 or self.memory_weight > 0)

    def weighted(self, choice: list[int], checkpoint: list[bool] | None = None) -> float:
        """What the solver minimises: seconds plus ``memory_weight`` x bytes."""
        value = self.evaluate(choice, checkpoint)
        if self.memory_weight > 0:
            value += self.memory_weight * self.memory(choice, checkpoint)
        return value

    def memory(self, choice: list[int], checkpoint: list[bool] | None = None) -> float:
        """Bytes per device of an assignment (0 when the problem has no memory model)."""
        if self.node_memory is None:
            return 0.0
        total = float(sum(m[i] for m, i in zip(self.node_memory, choice)))
        for g, on in zip(self.checkpoint_groups, checkpoint or ()):
            if on:
                total -= sum(g.net_freed(k)[choice[v]] for k, v in enumerate(g.nodes))
        return total

    def size(self, reduce: bool = True) -> tuple[int, int]:
        """(variables, constraints) of the MIP :func:`solve` builds for this problem
        (after :func:`eliminate` unless ``reduce`` is False)."""
        reduced = eliminate(self) if reduce else None
        if reduced is not None:
            return reduced.problem.size(reduce=False)
        variables = sum(len(c) for c in self.node_costs)
        constraints = len(self.node_costs) + (1 if self.memory_budget is not None else 0)
        for _, _, m in self.edges:
            rows, _, cols, _ = _compress(m)
            if len(rows) > 1 and len(cols) > 1:
                variables += sum(math.isfinite(x) for col in cols for x in col)
                constraints += len(rows) + len(cols)
        return variables, constraints

    def fits(self, choice: list[int], checkpoint: list[bool] | None = None) -> bool:
        return self.memory_budget is None or self.memory(choice, checkpoint) <= self.memory_budget

    def evaluate(self, choice: list[int], checkpoint: list[bool] | None = None) -> float:
        """Total seconds of an assignment (inf if it uses a forbidden pair)."""
        total = sum(c[i] for c, i in zip(self.node_costs, choice))
        for u, v, m in self.edges:
            total += m[choice[u]][choice[v]]
        for g, on in zip(self.checkpoint_groups, checkpoint or ()):
            if on:
                total += sum(g.recompute[k][choice[v]] for k, v in enumerate(g.nodes))
        return total


@dataclass
class Solution:
    choice: list[int]
    objective_s: float
    bound_s: float
    status: str
    solver: str
    num_variables: int
    num_constraints: int
    checkpoint: list[bool] = field(default_factory=list)

    @property
    def gap(self) -> float:
        if self.objective_s <= 0:
            return 0.0
        return max(0.0, (self.objective_s - self.bound_s) / self.objective_s)


def _groups(vectors: list[tuple[float, ...]]) -> tuple[list[tuple[float, ...]], list[int]]:
    """Distinct vectors (in first-seen order) and the group index of each input."""
    index: dict[tuple[float, ...], int] = {}
    of = []
    for v in vectors:
        of.append(index.setdefault(v, len(index)))
    return list(index), of


def _compress(matrix: list[list[float]]):
    """Distinct rows of ``matrix`` and distinct columns of those rows, with the
    group of every original row and column: ``cols[c][r]`` is the compressed cost.

    Rows that are one list object (as :func:`planner.intra_op.build_problem` shares
    them between strategies with the same output placement) are compared once."""
    objects: dict[int, int] = {}  # id(row) -> index among distinct row objects
    distinct = []
    for r in matrix:
        if objects.setdefault(id(r), len(distinct)) == len(distinct):
            distinct.append(r)
    rows, object_row = _groups([tuple(r) for r in distinct])
    row_of = [object_row[objects[id(r)]] for r in matrix]
    cols, col_of = _groups([tuple(c) for c in zip(*rows)])
    return rows, row_of, cols, col_of


SOLVERS = ("CBC", "HIGHS", "SCIP", "CP_SAT")

# A warm start (one strategy index per node), a function giving it, or none.
Hint = Union[list[int], Callable[[], Optional[list[int]]], None]


def _made_once(hint: Hint) -> Callable[[], list[int] | None]:
    """``hint`` as a function that makes it at most once."""
    return functools.cache(hint) if callable(hint) else lambda: hint


def _kept_of(hint_of: Callable[[], list[int] | None],
             kept: list[int]) -> Callable[[], list[int] | None]:
    """The hint of a reduced problem: ``hint_of()``'s strategies of the ``kept`` nodes."""
    def of() -> list[int] | None:
        hint = hint_of()
        return None if hint is None else [hint[v] for v in kept]
    return of


def solve(problem: AssignmentProblem, *, time_limit_s: float = 10.0,
          hint: Hint = None, solver: str = "CBC", reduce: bool = True) -> Solution:
    """Solve the assignment problem with an OR-Tools backend.

    ``solver`` is one of :data:`SOLVERS`. CBC is the default: on a 3-node case SCIP
    reported a non-optimal answer as OPTIMAL, and HiGHS violated the memory row by
    its tolerance (and prints a banner). The MIP backends (CBC, HiGHS, SCIP) are
    deterministic, so the same problem always gives the same answer; edge
    variables are continuous there because the transport constraints make them
    integral once the node variables are.

    ``hint`` (one strategy index per node, or a function giving it, called
    only when a MIP runs: where the LP relaxation is integral no hint is
    made) is the warm start and the anytime
    answer: passed to the backend with ``SetHint``, and returned (status
    ``TIME_LIMIT_WARM_START``, with no checkpointing or with every group
    checkpointed, whichever fits and is cheaper) when the time limit ends the
    search with nothing, or with something worse. So the answer is never worse
    than a hint that fits the memory budget. Measured (OR-Tools 9.15, a
    llama3-8b layer on an 8x8 mesh, ~39k variables, the optimum as the hint):
    CBC through pywraplp ignores the hint - with time limits of 0.05 to 0.5 s it
    still ends NOT_SOLVED after its root LP (~0.7 s; it does not stop during
    the root LP), where a honoured hint would be a FEASIBLE incumbent; SCIP also
    ended NOT_SOLVED up to 1 s. The hint is therefore a floor applied here, not a
    way of speeding the solver up.

    With ``reduce`` the problem is first shrunk exactly by :func:`eliminate`; the
    answer (choice, objective, checkpointing) is always for ``problem`` itself.

    Raises:
        InfeasibleError: when every assignment uses a forbidden pair.
    """
    name = solver.upper().replace("-", "_")
    if name not in SOLVERS:
        raise ValueError(f"unknown solver '{solver}'; choose one of {', '.join(SOLVERS)}")
    groups = len(problem.checkpoint_groups)
    hint_of = _made_once(hint)
    if problem.memory_matters and groups <= _CHECKPOINT_COMBINATIONS_GROUPS and (
            problem.memory_weight > 0 if groups == 0
            else not all(len(c) == 1 for c in problem.node_costs)):
        return _solve_per_checkpointing(problem, time_limit_s, hint_of, name, reduce)
    reduced = eliminate(problem) if reduce else None
    if reduced is None:
        return _solve(problem, time_limit_s, hint_of, name)
    sol = _solve(reduced.problem, time_limit_s, _kept_of(hint_of, reduced.kept), name)
    choice = reduced.expand(sol.choice)
    checkpoint = sol.checkpoint if reduced.kept_groups else [False] * len(problem.checkpoint_groups)
    value = problem.evaluate(choice, checkpoint)
    bound = value if sol.status == "OPTIMAL" else min(value, sol.bound_s + reduced.offset)
    return dataclasses.replace(sol, choice=choice, objective_s=value, bound_s=bound,
                               checkpoint=checkpoint)


# Up to this many checkpoint groups are decided by enumeration when memory
# matters (each combination is an assignment problem without checkpoint terms).
_CHECKPOINT_COMBINATIONS_GROUPS = 4


def _solve_per_checkpointing(problem: AssignmentProblem, time_limit_s: float,
                             hint: Callable[[], list[int] | None], name: str,
                             reduce: bool) -> Solution:
    """Solve once per combination of checkpoint decisions and keep the best
    (exact). With the decisions fixed, recomputation and the memory a
    checkpoint frees fold into node costs and node memory, and a memory weight
    into node costs, leaving an assignment problem (with at most the budget
    row): the MIP solves that about as fast as an unconstrained one, where the
    linearised checkpoint terms (``x AND ckpt``) make CBC crawl (a llama3-8b
    layer on 8x8: 10 s FEASIBLE per weighted solve before, 0.7 s OPTIMAL now).
    The combinations share ``time_limit_s``: each gets an equal part of what is left.

    Without a budget, the combination that checkpoints every group (the
    usual winner under a memory weight) is solved first, and a combination
    that provably cannot beat its optimum (:func:`_least_change`) is not
    solved: a llama3-8b search skipped 97 of 115 such solves. The answer is
    the same: a skipped combination is worse than one that was solved."""
    combos = list(itertools.product((False, True), repeat=len(problem.checkpoint_groups)))
    bounded = problem.memory_budget is not None  # then each combination has its own budget
    order = combos if bounded else [combos[-1], *combos[:-1]]
    solved: dict[tuple[bool, ...], tuple[float, Solution]] = {}
    deadline = time.monotonic() + time_limit_s  # the caller's limit covers every combination
    for done, combo in enumerate(order):
        first = solved.get(order[0])
        if not bounded and first is not None and first[1].status == "OPTIMAL":
            tolerance = 1e-9 * max(1.0, abs(first[0]))
            if _least_change(problem, order[0], combo) > tolerance:
                continue  # worse than the first combination's optimum, whatever it chose
        sub = _with_checkpointing(problem, combo)
        if sub.memory_budget is not None and sum(min(m) for m in sub.node_memory) > \
                sub.memory_budget:
            continue  # nothing fits with these decisions
        try:
            share = max(deadline - time.monotonic(), 0.0) / (len(combos) - done)
            sol = solve(sub, time_limit_s=max(share, 0.05), hint=hint, solver=name, reduce=reduce)
        except InfeasibleError:
            continue
        if problem.fits(sol.choice, list(combo)):
            solved[combo] = (problem.weighted(sol.choice, list(combo)), sol)
    # the first best in the order of the combinations (as solving them all in order)
    kept = [(combo, *solved[combo]) for combo in combos if combo in solved]
    if not kept:
        raise InfeasibleError("no assignment fits the memory budget or every one uses a "
                              "forbidden pair")
    combo, _, sol = min(kept, key=lambda item: item[1])
    checkpoint = list(combo)
    statuses = [s.status for _, _, s in kept]
    seconds = problem.evaluate(sol.choice, checkpoint)
    optimal = all(s == "OPTIMAL" for s in statuses)
    return dataclasses.replace(sol, objective_s=seconds, status=sol.status if optimal else
                               next(s for s in statuses if s != "OPTIMAL"),
                               bound_s=seconds if optimal else min(seconds, sol.bound_s),
                               checkpoint=checkpoint)


def _with_checkpointing(problem: AssignmentProblem, combo: tuple[bool, ...]) -> AssignmentProblem:
    """``problem`` with its checkpoint groups decided by ``combo`` (one bool
    per group): the recomputation a checkpointed group pays added to its nodes'
    costs, the memory it frees taken from their memory and what it keeps from
    the budget, and memory priced into node costs at the problem's weight."""
    costs = [list(c) for c in problem.node_costs]
    memory = [list(m) for m in problem.node_memory]
    budget = problem.memory_budget
    for g, on in zip(problem.checkpoint_groups, combo):
        if not on:
            continue
        for k, v in enumerate(g.nodes):
            costs[v] = [c + r for c, r in zip(costs[v], g.recompute[k])]
            memory[v] = [m - s for m, s in zip(memory[v], g.net_freed(k))]
    w = problem.memory_weight
    if w > 0:
        costs = [[c + w * m for c, m in zip(cs, ms)] for cs, ms in zip(costs, memory)]
    return AssignmentProblem(costs, problem.edges, node_memory=memory, memory_budget=budget)


def _least_change(problem: AssignmentProblem, base: tuple[bool, ...],
                  combo: tuple[bool, ...]) -> float:
    """A lower bound of how much the weighted seconds of any assignment
    change (:meth:`AssignmentProblem.weighted`) when its checkpoint decisions
    go from ``base`` to ``combo``, without a budget: per group switched, the
    least change of each of its nodes' recomputation less the memory it frees
    at the problem's weight, and the bytes the group keeps at that weight.
    So ``combo``'s optimum is at least ``base``'s plus this."""
    w = problem.memory_weight
    total = 0.0
    for g, was, now in zip(problem.checkpoint_groups, base, combo):
        if was == now:
            continue
        sign = 1.0 if now else -1.0  # on: recompute paid, saved bytes freed, kept bytes held
        for k, recompute in enumerate(g.recompute):
            total += min(sign * (r - w * b) for r, b in zip(recompute, g.net_freed(k)))
    return total


def _solve(problem: AssignmentProblem, time_limit_s: float,
           hint_of: Callable[[], list[int] | None], name: str) -> Solution:
    """:func:`solve` without the reduction (``hint_of`` gives the hint)."""
    if (all(len(c) == 1 for c in problem.node_costs)
            and len(problem.checkpoint_groups) <= _ENUMERATED_GROUPS):
        return _solve_fixed(problem, name)
    model = _Model()
    integral_edges = name == "CP_SAT"
    node_costs = [list(c) for c in problem.node_costs]
    x = [[model.var(integer=True) for _ in c] for c in node_costs]
    for v, xs in enumerate(x):
        if not xs:
            raise InfeasibleError(f"node {v} has no strategy")
        model.row(1.0, 1.0, xs, [1.0] * len(xs))
    for u, v, m in problem.edges:
        rows, row_of, cols, col_of = _compress(m)
        if len(rows) == 1:  # cost depends on v only
            for j in range(len(node_costs[v])):
                node_costs[v][j] += cols[col_of[j]][0]
            continue
        if len(cols) == 1:  # cost depends on u only
            for i in range(len(node_costs[u])):
                node_costs[u][i] += cols[0][row_of[i]]
            continue
        _edge_rows(model, integral_edges, cols, x[u], _members(row_of, len(rows)),
                   x[v], _members(col_of, len(cols)))
    for v, c in enumerate(node_costs):
        for i, k in enumerate(c):
            if math.isfinite(k):
                model.cost(x[v][i], k * _SCALE)
            else:
                model.forbid(x[v][i])
    ckpt = [model.var(integer=True) for _ in problem.checkpoint_groups]
    freed: dict[tuple[int, int], float] = {}  # (node, strategy) -> bytes a checkpoint frees
    kept_terms, freed_terms = [], []  # (variable, bytes)
    for g, group in enumerate(problem.checkpoint_groups):
        for k, v in enumerate(group.nodes):
            net = group.net_freed(k)
            for i in range(len(x[v])):
                # z = x AND ckpt (recompute paid, net bytes held), y = x AND NOT ckpt
                # (activations kept); both bounded from below, and priced upwards
                if group.recompute[k][i] > 0 or net[i] < 0:
                    z = model.var(False, group.recompute[k][i] * _SCALE)
                    model.row(-1.0, math.inf, [z, x[v][i], ckpt[g]], [1.0, -1.0, -1.0])
                    if net[i] < 0:
                        kept_terms.append((z, -net[i]))
                if net[i] > 0:
                    y = model.var(False)
                    model.row(0.0, math.inf, [y, x[v][i], ckpt[g]], [1.0, -1.0, 1.0])
                    freed[v, i] = freed.get((v, i), 0.0) + net[i]
                    freed_terms.append((y, net[i]))
    if problem.memory_weight > 0 and problem.node_memory is not None:
        # memory priced in the objective: the terms of the memory row, weighted
        w = problem.memory_weight * _SCALE
        for v, mem in enumerate(problem.node_memory):
            for i, m in enumerate(mem):
                if m - freed.get((v, i), 0.0) and math.isfinite(node_costs[v][i]):
                    model.add_cost(x[v][i], w * (m - freed.get((v, i), 0.0)))
        for var, b in freed_terms + kept_terms:
            model.add_cost(var, w * b)
    if problem.memory_budget is not None and problem.node_memory is not None:
        # bytes as a fraction of the budget keep the row's coefficients near 1
        unit = max(problem.memory_budget, 1.0)
        fixed = [(x[v][i], (m - freed.get((v, i), 0.0)) / unit)
                 for v, mem in enumerate(problem.node_memory) for i, m in enumerate(mem)
                 if m - freed.get((v, i), 0.0)]
        terms = fixed + [(var, b / unit) for var, b in freed_terms + kept_terms]
        model.row(-math.inf, problem.memory_budget / unit, [var for var, _ in terms],
                  [b for _, b in terms])
    started = time.monotonic()
    if name == "CBC":
        integral = _integral_relaxation(problem, model, x, ckpt, time_limit_s)
        if integral is not None:
            return integral
    mip = _load(name, model.proto())
    hint = hint_of()
    x = [[mip.variable(i) for i in xs] for xs in x]
    ckpt = [mip.variable(i) for i in ckpt]
    objective = mip.Objective()
    if hint is not None:
        mip.SetHint([var for xs in x for var in xs],
                    [1.0 if j == hint[v] else 0.0 for v, xs in enumerate(x) for j in range(len(xs))])
    mip.SetTimeLimit(int(max(time_limit_s - (time.monotonic() - started), 0.05) * 1000))
    params = pywraplp.MPSolverParameters()
    params.SetDoubleParam(params.RELATIVE_MIP_GAP, 1e-9)
    status = mip.Solve(params)
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
    bound = objective.BestBound() / _SCALE if status != pywraplp.Solver.OPTIMAL else value
    if (status != pywraplp.Solver.OPTIMAL and fallback is not None
            and problem.weighted(hint, fallback[1]) < problem.weighted(choice, checkpoint)):
        # CBC does not start from the hint (see above): an answer cut off by the
        # time limit can be worse than the warm start, which is then the answer
        return _warm_start_solution(hint, fallback, min(fallback[0], bound), name, mip)
    return Solution(choice=choice, objective_s=value, bound_s=min(value, bound),
                    status=_STATUS[status], solver=name, num_variables=mip.NumVariables(),
                    num_constraints=mip.NumConstraints(), checkpoint=checkpoint)


def _edge_rows(model: "_Model", integral: bool, cols: list[tuple[float, ...]],
               xu: list[int], row_members: list[list[int]],
               xv: list[int], col_members: list[list[int]]) -> None:
    """The variables and transport rows of one compressed edge: ``e[r][c]``
    (u takes a strategy of row group r and v one of column group c, costing
    ``cols[c][r]`` seconds) sums to u's strategies of group r over c and to
    v's of group c over r. A forbidden pair (inf) gets no variable, so it can
    never be chosen. The variables are made in one call, row by row."""
    num_cols = len(cols)
    costs = [col[r] * _SCALE for r in range(len(row_members)) for col in cols]
    allowed = [math.isfinite(c) for c in costs]
    first = model.vars(integral, [c for c, ok in zip(costs, allowed) if ok])
    numbers = iter(range(first, len(model.objective)))
    e = [[next(numbers) if ok else None for ok in allowed[r * num_cols:(r + 1) * num_cols]]
         for r in range(len(row_members))]
    for er, members in zip(e, row_members):
        ends = [var for var in er if var is not None]
        model.row(0.0, 0.0, ends + [xu[i] for i in members],
                  [1.0] * len(ends) + [-1.0] * len(members))
    for c, members in enumerate(col_members):
        ends = [er[c] for er in e if er[c] is not None]
        model.row(0.0, 0.0, ends + [xv[j] for j in members],
                  [1.0] * len(ends) + [-1.0] * len(members))


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


# GLOP's dual simplex without presolve: on the llama3-8b stage and layer
# relaxations (~18k variables) 0.016 s against 0.05-0.08 s for the defaults
# (primal simplex after presolve), the same optimum.
_GLOP_PARAMETERS = "use_dual_simplex: true use_preprocessing: false"

# An LP value this close to 0 or 1 counts as integral.
_INTEGRAL_TOLERANCE = 1e-6


def _integral_relaxation(problem: AssignmentProblem, model: _Model,
                         x: list[list[int]], ckpt: list[int],
                         time_limit_s: float) -> Solution | None:
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
    solution = lp.variable_values().tolist()
    values = [[solution[i] for i in xs] for xs in x]
    decisions = [solution[i] for i in ckpt]
    if any(_INTEGRAL_TOLERANCE < v < 1 - _INTEGRAL_TOLERANCE
           for v in itertools.chain(decisions, *values)):
        return None
    choice = [max(range(len(vs)), key=vs.__getitem__) for vs in values]
    checkpoint = [d > 0.5 for d in decisions]
    bound = lp.objective_value() / _SCALE
    weighted = problem.weighted(choice, checkpoint)
    if not (problem.fits(choice, checkpoint)
            and weighted <= bound + 1e-9 * max(1.0, abs(bound)) + 1e-12):
        return None
    value = problem.evaluate(choice, checkpoint)
    return Solution(choice=choice, objective_s=value, bound_s=value, status="OPTIMAL",
                    solver="GLOP", num_variables=len(model.objective),
                    num_constraints=len(model.row_lower), checkpoint=checkpoint)


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
    return Solution(choice=list(hint), objective_s=fallback[0], bound_s=bound_s,
                    status="TIME_LIMIT_WARM_START", solver=name,
                    num_variables=mip.NumVariables(), num_constraints=mip.NumConstraints(),
                    checkpoint=list(fallback[1]))


# With one strategy per node, up to this many checkpoint decisions are enumerated.
_ENUMERATED_GROUPS = 10


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


def _members(group_of: list[int], groups: int) -> list[list[int]]:
    """The indices in each group, ascending: ``out[g] = [i for i if group_of[i] == g]``."""
    out: list[list[int]] = [[] for _ in range(groups)]
    for i, g in enumerate(group_of):
        out[g].append(i)
    return out


class _Model:
    """A minimisation MIP over variables in [0, 1], kept as arrays (bounds,
    objective, integrality, and the constraint rows in compressed sparse row
    form) and handed to a solver in one call (:meth:`solver_helper`,
    :meth:`proto`): building OR-Tools' objects one variable or coefficient at
    a time cost about half of a layer problem's solve. Variables are ints in
    creation order."""

    def __init__(self):
        self.upper: list[float] = []
        self.objective: list[float] = []
        self.integer: list[bool] = []
        self.row_lower: list[float] = []
        self.row_upper: list[float] = []
        self.row_start = [0]
        self.row_vars: list[int] = []
        self.row_coefficients: list[float] = []

    def var(self, integer: bool, cost: float = 0.0) -> int:
        """A new variable in [0, 1] with objective coefficient ``cost``."""
        self.upper.append(1.0)
        self.objective.append(cost)
        self.integer.append(integer)
        return len(self.objective) - 1

    def vars(self, integer: bool, costs: list[float]) -> int:
        """``len(costs)`` new variables in [0, 1] with those objective
        coefficients; the index of the first (the rest follow it)."""
        first = len(self.objective)
        self.objective.extend(costs)
        self.upper.extend([1.0] * len(costs))
        self.integer.extend([integer] * len(costs))
        return first

    def cost(self, var: int, cost: float) -> None:
        self.objective[var] = cost

    def add_cost(self, var: int, cost: float) -> None:
        self.objective[var] += cost

    def forbid(self, var: int) -> None:
        self.upper[var] = 0.0

    def row(self, lower: float, upper: float, variables: list[int],
            coefficients: list[float]) -> None:
        """``lower <= sum(coefficient * variable) <= upper`` (each variable once)."""
        self.row_lower.append(lower)
        self.row_upper.append(upper)
        self.row_vars.extend(variables)
        self.row_coefficients.extend(coefficients)
        self.row_start.append(len(self.row_vars))

    def solver_helper(self) -> "model_builder_helper.ModelBuilderHelper":
        """The model in OR-Tools' model builder (continuous variables: for the
        LP relaxation)."""
        n = len(self.objective)
        matrix = scipy.sparse.csr_matrix(
            (np.asarray(self.row_coefficients, dtype=float),
             np.asarray(self.row_vars, dtype=np.int32), np.asarray(self.row_start, dtype=np.int32)),
            shape=(len(self.row_lower), n))
        helper = model_builder_helper.ModelBuilderHelper()
        helper.fill_model_from_sparse_data(
            np.zeros(n), np.asarray(self.upper, dtype=float),
            np.asarray(self.objective, dtype=float), np.asarray(self.row_lower, dtype=float),
            np.asarray(self.row_upper, dtype=float), matrix)
        return helper

    def proto(self) -> linear_solver_pb2.MPModelProto:
        """The model as an ``MPModelProto`` (for the MIP backends)."""
        proto = linear_solver_pb2.MPModelProto(maximize=False)
        for ub, cost, integer in zip(self.upper, self.objective, self.integer):
            proto.variable.add(lower_bound=0.0, upper_bound=ub, is_integer=integer,
                               objective_coefficient=cost)
        for r, (lower, upper) in enumerate(zip(self.row_lower, self.row_upper)):
            row = proto.constraint.add(lower_bound=lower, upper_bound=upper)
            start, end = self.row_start[r], self.row_start[r + 1]
            row.var_index.extend(self.row_vars[start:end])
            row.coefficient.extend(self.row_coefficients[start:end])
        return proto


# A node is eliminated only if the cost tensor it needs has at most this many
# entries (bytes = 8 x this), so one elimination never takes more than ~64 MB.
_ELIMINATION_ENTRIES = 8_000_000


@dataclass
class Reduction:
    """A problem shrunk by :func:`eliminate` and how to map answers back.

    Attributes:
        problem: the reduced problem (nodes renumbered in ``kept`` order).
        kept: original index of each reduced node.
        kept_groups: whether ``problem`` keeps the checkpoint groups (else none
            is checkpointed: without a memory budget that is optimal).
        offset: seconds the eliminated nodes add whatever the rest chooses.
        steps: in elimination order, ``(v, costs, neighbours, matrices)``: node v
            is best at ``argmin_j costs[j] + sum_k matrices[k][j, choice[neighbours[k]]]``.
    """

    problem: AssignmentProblem
    kept: list[int]
    offset: float
    steps: list[tuple[int, "np.ndarray", list[int], list["np.ndarray"]]]
    kept_groups: bool = True  # False: the checkpoint groups were dropped (never checkpointed)

    def expand(self, choice: list[int]) -> list[int]:
        """Strategy index of every original node from a choice per reduced node."""
        full: list[int] = [0] * (len(self.kept) + len(self.steps))
        for i, v in enumerate(self.kept):
            full[v] = choice[i]
        for v, costs, neighbours, matrices in reversed(self.steps):
            total = costs
            for w, m in zip(neighbours, matrices):
                total = total + m[:, full[w]]
            full[v] = int(np.argmin(total))
        return full


def eliminate(problem: AssignmentProblem) -> Reduction | None:
    """Exact shrinking by variable elimination (None when nothing can be eliminated).

    A node that holds no memory, is in no checkpoint group and has at most two
    neighbours is removed (without a memory budget memory and checkpointing do
    not matter, and the groups are dropped): with neighbours a and b its cost is folded into one
    a-b edge ``M[i][k] = min_j (c[j] + M_va[j][i] + M_vb[j][k])`` (parallel edges
    are summed); with one neighbour into that neighbour's node costs; alone, into
    a constant. Chains of views and element-wise ops (a getitem, whose
    strategy its producer forces, included) collapse so, and the optimum is
    unchanged: after solving, each removed node takes its best strategy given its
    neighbours' (:meth:`Reduction.expand`). A two-neighbour node is kept when the
    new edge would have more entries than the two it replaces.
    """
    n = len(problem.node_costs)
    pinned = {v for v, c in enumerate(problem.node_costs) if not c}  # infeasible: the MIP says so
    # without a budget memory is free and checkpointing only costs recomputation,
    # so the groups are dropped (never checkpointed) and memory pins nothing
    bounded = problem.memory_matters
    groups = problem.checkpoint_groups if bounded else []
    pinned |= {v for g in groups for v in g.nodes}
    if bounded:
        pinned |= {v for v, m in enumerate(problem.node_memory) if any(m)}
    if len(pinned) == n:
        return None
    costs = [np.asarray(c, dtype=float) for c in problem.node_costs]
    nbr: list[dict[int, np.ndarray]] = [{} for _ in range(n)]  # nbr[v][w][i of v, j of w]

    def link(a: int, b: int, m: np.ndarray) -> None:
        if a == b:
            costs[a] = costs[a] + np.diagonal(m)
            return
        if b in nbr[a]:
            m = nbr[a][b] + m
        nbr[a][b], nbr[b][a] = m, m.T

    for u, v, m in problem.edges:
        link(u, v, _as_array(m).reshape(len(costs[u]), len(costs[v])))
    alive = [True] * n
    steps: list[tuple[int, np.ndarray, list[int], list[np.ndarray]]] = []
    offset = 0.0
    changed = True
    while changed:
        changed = False
        for v in range(n):
            if not alive[v] or v in pinned or len(nbr[v]) > 2:
                continue
            neighbours = sorted(nbr[v])
            matrices = [nbr[v][w] for w in neighbours]
            c = costs[v]
            if len(neighbours) == 2:
                a, b = neighbours
                ma, mb = matrices
                j, i, k = ma.shape[0], ma.shape[1], mb.shape[1]
                if i * k > j * (i + k) or j * i * k > _ELIMINATION_ENTRIES:
                    continue
                merged = ((c[:, None] + ma)[:, :, None] + mb[:, None, :]).min(axis=0)
                del nbr[a][v], nbr[b][v]
                link(a, b, merged)
            elif len(neighbours) == 1:
                (a,), (ma,) = neighbours, matrices
                costs[a] = costs[a] + (c[:, None] + ma).min(axis=0)
                del nbr[a][v]
            elif np.isfinite(c.min()):
                offset += float(c.min())
            else:  # every strategy forbidden: left to the MIP, which reports it
                continue
            nbr[v] = {}
            alive[v] = False
            steps.append((v, c, neighbours, matrices))
            changed = True
    if not steps and len(groups) == len(problem.checkpoint_groups):
        return None
    kept = [v for v in range(n) if alive[v]]
    index = {v: i for i, v in enumerate(kept)}
    edges = [(index[a], index[b], m.tolist()) for a in kept for b, m in sorted(nbr[a].items())
             if b > a]
    reduced = AssignmentProblem(
        node_costs=[costs[v].tolist() for v in kept], edges=edges,
        node_memory=None if problem.node_memory is None else [problem.node_memory[v] for v in kept],
        memory_budget=problem.memory_budget,
        checkpoint_groups=[dataclasses.replace(g, nodes=[index[v] for v in g.nodes])
                           for g in groups],
        memory_weight=problem.memory_weight)
    return Reduction(reduced, kept, offset, steps, bool(groups) or not problem.checkpoint_groups)


def greedy_assignment(problem: AssignmentProblem,
                      allowed: list[list[int] | None] | None = None) -> list[int]:
    """An assignment built node by node in index order: each node takes, among its
    ``allowed`` strategies (None: all), the one with the least seconds of node cost
    plus edges to the nodes already assigned (ties: the lowest index). Checkpoint
    groups and the memory budget are not considered. Used to turn a partial
    layout (say, Megatron's parameter placements) into a complete warm start;
    ``allowed[v]`` must be non-empty where given.
    """
    n = len(problem.node_costs)
    allowed = allowed or [None] * n
    neighbours: list[list[tuple[int, list[list[float]], bool]]] = [[] for _ in range(n)]
    for u, v, m in problem.edges:
        neighbours[u].append((v, m, False))  # m[i of u][j of v]
        neighbours[v].append((u, m, True))
    choice: list[int | None] = [None] * n
    for v in range(n):
        best, best_cost = None, math.inf
        for i in (allowed[v] if allowed[v] is not None else range(len(problem.node_costs[v]))):
            cost = problem.node_costs[v][i]
            for w, m, v_is_col in neighbours[v]:
                j = choice[w]
                if j is not None:
                    cost += m[j][i] if v_is_col else m[i][j]
            if best is None or cost < best_cost:
                best, best_cost = i, cost
        choice[v] = best if best is not None else 0
    return choice


def brute_force(problem: AssignmentProblem) -> tuple[list[int], float]:
    """Exhaustive optimum (for tests on small problems)."""
    best, best_cost = None, math.inf
    for choice in itertools.product(*(range(len(c)) for c in problem.node_costs)):
        for ckpt in itertools.product((False, True), repeat=len(problem.checkpoint_groups)):
            if not problem.fits(list(choice), list(ckpt)):
                continue
            cost = problem.evaluate(list(choice), list(ckpt))
            if cost < best_cost:
                best, best_cost = list(choice), cost
    if best is None:
        raise InfeasibleError("every assignment uses a forbidden pair")
    return best, best_cost
