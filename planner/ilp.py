"""The strategy-assignment ILP, solved with OR-Tools (CBC by default).

Abstract form (Alpa's intra-op formulation): pick one strategy per node to
minimise the sum of node costs plus, on every edge (u, v), the cost of the pair
of strategies chosen at its ends. All costs are seconds.

Edge matrices are compressed exactly before solving: producer strategies with an
identical cost row (and consumer strategies with an identical column) share edge
variables, and an edge whose cost depends on one end only is folded into that
node's cost.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

from ortools.linear_solver import pywraplp

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
        kept: bytes the group keeps when checkpointed (its inputs).
    """

    nodes: list[int]
    saved: list[list[float]]
    recompute: list[list[float]]
    kept: float = 0.0


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
    """

    node_costs: list[list[float]]
    edges: list[tuple[int, int, list[list[float]]]] = field(default_factory=list)
    node_memory: list[list[float]] | None = None
    memory_budget: float | None = None
    checkpoint_groups: list[CheckpointGroup] = field(default_factory=list)

    def memory(self, choice: list[int], checkpoint: list[bool] | None = None) -> float:
        """Bytes per device of an assignment (0 when the problem has no memory model)."""
        if self.node_memory is None:
            return 0.0
        total = float(sum(m[i] for m, i in zip(self.node_memory, choice)))
        for g, on in zip(self.checkpoint_groups, checkpoint or ()):
            if on:
                total += g.kept - sum(g.saved[k][choice[v]] for k, v in enumerate(g.nodes))
        return total

    def size(self) -> tuple[int, int]:
        """(variables, constraints) of the MIP :func:`solve` builds for this problem."""
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
    group of every original row and column: ``cols[c][r]`` is the compressed cost."""
    rows, row_of = _groups([tuple(r) for r in matrix])
    cols, col_of = _groups([tuple(c) for c in zip(*rows)])
    return rows, row_of, cols, col_of


SOLVERS = ("CBC", "HIGHS", "SCIP", "CP_SAT")


def solve(problem: AssignmentProblem, *, time_limit_s: float = 10.0,
          hint: list[int] | None = None, solver: str = "CBC") -> Solution:
    """Solve the assignment problem with an OR-Tools backend.

    ``solver`` is one of :data:`SOLVERS`. CBC is the default: on a 3-node case SCIP
    reported a non-optimal answer as OPTIMAL, and HiGHS violated the memory row by
    its tolerance (and prints a banner). The MIP backends (CBC, HiGHS, SCIP) are
    deterministic, so the same problem always gives the same answer; edge
    variables are continuous there because the transport constraints make them
    integral once the node variables are.

    Raises:
        InfeasibleError: when every assignment uses a forbidden pair.
    """
    name = solver.upper().replace("-", "_")
    if name not in SOLVERS:
        raise ValueError(f"unknown solver '{solver}'; choose one of {', '.join(SOLVERS)}")
    if (all(len(c) == 1 for c in problem.node_costs)
            and len(problem.checkpoint_groups) <= _ENUMERATED_GROUPS):
        return _solve_fixed(problem, name)
    mip = pywraplp.Solver.CreateSolver(name)
    if mip is None:
        raise ValueError(f"OR-Tools was built without the {name} backend; use another solver")
    mip.SuppressOutput()
    integral_edges = name == "CP_SAT"
    node_costs = [list(c) for c in problem.node_costs]
    x = [[mip.BoolVar(f"x{v}_{i}") for i in range(len(c))] for v, c in enumerate(node_costs)]
    for v, xs in enumerate(x):
        if not xs:
            raise InfeasibleError(f"node {v} has no strategy")
        _row(mip, 1.0, 1.0, [(var, 1.0) for var in xs])
    objective = mip.Objective()
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
        e = {}
        for r, c in itertools.product(range(len(rows)), range(len(cols))):
            cost = cols[c][r]
            if not math.isfinite(cost):
                continue  # forbidden pair: no variable, so it can never be chosen
            e[r, c] = mip.BoolVar("") if integral_edges else mip.NumVar(0.0, 1.0, "")
            objective.SetCoefficient(e[r, c], cost * _SCALE)
        for r in range(len(rows)):
            _row(mip, 0.0, 0.0, [(e[r, c], 1.0) for c in range(len(cols)) if (r, c) in e]
                 + [(x[u][i], -1.0) for i in range(len(row_of)) if row_of[i] == r])
        for c in range(len(cols)):
            _row(mip, 0.0, 0.0, [(e[r, c], 1.0) for r in range(len(rows)) if (r, c) in e]
                 + [(x[v][j], -1.0) for j in range(len(col_of)) if col_of[j] == c])
    for v, c in enumerate(node_costs):
        for i, k in enumerate(c):
            if math.isfinite(k):
                objective.SetCoefficient(x[v][i], k * _SCALE)
            else:
                x[v][i].SetUb(0)
    objective.SetMinimization()
    ckpt = [mip.BoolVar(f"ckpt{g}") for g in range(len(problem.checkpoint_groups))]
    freed: dict[tuple[int, int], float] = {}  # (node, strategy) -> bytes a checkpoint frees
    kept_terms, freed_terms = [], []  # (variable, bytes)
    for g, group in enumerate(problem.checkpoint_groups):
        kept_terms.append((ckpt[g], group.kept))
        for k, v in enumerate(group.nodes):
            for i in range(len(x[v])):
                # z = x AND ckpt (recompute paid), y = x AND NOT ckpt (activations kept)
                if group.recompute[k][i] > 0:
                    z = mip.NumVar(0.0, 1.0, "")
                    _row(mip, -1.0, mip.infinity(), [(z, 1.0), (x[v][i], -1.0), (ckpt[g], -1.0)])
                    objective.SetCoefficient(z, group.recompute[k][i] * _SCALE)
                if group.saved[k][i] > 0:
                    y = mip.NumVar(0.0, 1.0, "")
                    _row(mip, 0.0, mip.infinity(), [(y, 1.0), (x[v][i], -1.0), (ckpt[g], 1.0)])
                    freed[v, i] = freed.get((v, i), 0.0) + group.saved[k][i]
                    freed_terms.append((y, group.saved[k][i]))
    if problem.memory_budget is not None and problem.node_memory is not None:
        # bytes as a fraction of the budget keep the row's coefficients near 1
        unit = max(problem.memory_budget, 1.0)
        fixed = [(x[v][i], (m - freed.get((v, i), 0.0)) / unit)
                 for v, mem in enumerate(problem.node_memory) for i, m in enumerate(mem)
                 if m - freed.get((v, i), 0.0)]
        _row(mip, -mip.infinity(), problem.memory_budget / unit,
             fixed + [(var, b / unit) for var, b in freed_terms + kept_terms])
    if hint is not None:
        mip.SetHint([var for xs in x for var in xs],
                    [1.0 if j == hint[v] else 0.0 for v, xs in enumerate(x) for j in range(len(xs))])
    mip.SetTimeLimit(int(time_limit_s * 1000))
    params = pywraplp.MPSolverParameters()
    params.SetDoubleParam(params.RELATIVE_MIP_GAP, 1e-9)
    status = mip.Solve(params)
    if status not in (pywraplp.Solver.OPTIMAL, pywraplp.Solver.FEASIBLE):
        if (status == pywraplp.Solver.NOT_SOLVED and hint is not None and problem.fits(hint)
                and math.isfinite(problem.evaluate(hint))):
            # anytime answer: the time limit passed before the solver found anything
            # better than the warm start, so the warm start is the answer
            value = problem.evaluate(hint)
            return Solution(choice=list(hint), objective_s=value, bound_s=0.0,
                            status="TIME_LIMIT_WARM_START", solver=name,
                            num_variables=mip.NumVariables(),
                            num_constraints=mip.NumConstraints(),
                            checkpoint=[False] * len(ckpt))
        raise InfeasibleError(f"{name} ended with status {_STATUS.get(status, status)}")
    choice = [max(range(len(xs)), key=lambda i: xs[i].solution_value()) for xs in x]
    checkpoint = [c.solution_value() > 0.5 for c in ckpt]
    value = problem.evaluate(choice, checkpoint)
    bound = objective.BestBound() / _SCALE if status != pywraplp.Solver.OPTIMAL else value
    return Solution(choice=choice, objective_s=value, bound_s=min(value, bound),
                    status=_STATUS[status], solver=name, num_variables=mip.NumVariables(),
                    num_constraints=mip.NumConstraints(), checkpoint=checkpoint)


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
        value = problem.evaluate(choice, list(ckpt))
        if math.isfinite(value) and (best is None or value < best[0]):
            best = (value, list(ckpt))
    if best is None:
        raise InfeasibleError("the fixed strategies fit no checkpointing choice")
    return Solution(choice=choice, objective_s=best[0], bound_s=best[0], status="OPTIMAL",
                    solver=name, num_variables=len(choice) + len(best[1]), num_constraints=0,
                    checkpoint=best[1])


def _row(mip: pywraplp.Solver, lower: float, upper: float,
         terms: list[tuple[pywraplp.Variable, float]]) -> None:
    """``lower <= sum(coefficient * variable) <= upper`` (each variable once)."""
    row = mip.Constraint(lower, upper)
    for var, coefficient in terms:
        row.SetCoefficient(var, coefficient)


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
