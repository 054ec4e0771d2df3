"""The MIP of one assignment problem, built as arrays (:func:`build_formulation`).

Each constraint family and objective term has its own function here; the
formulation (variables, rows, objective, and which function adds each) is
written out in :mod:`planner.ilp.solve`'s docstring. Costs enter the model in
microseconds (:data:`SCALE`), memory in bytes per device (as a fraction of
the budget in the budget row).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import scipy.sparse
from ortools.linear_solver import linear_solver_pb2
from ortools.linear_solver.python import model_builder_helper

from planner.ilp.problem import AssignmentProblem, InfeasibleError, compress_edge

# Objective units per second: costs enter the solver in microseconds, so solver
# tolerances (about 1e-6 in objective units) are far below any cost difference
# that matters.
SCALE = 1e6


class ArrayModel:
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


@dataclass
class Formulation:
    """A problem's MIP and where its decisions are: ``x[v][i]`` is the
    variable of node v taking strategy i, ``ckpt[g]`` that of checkpointing
    group g."""

    model: ArrayModel
    x: list[list[int]]
    ckpt: list[int]


@dataclass
class _CheckpointMemory:
    """The memory (bytes per device) the checkpoint variables carry.

    Attributes:
        freed: ``(node, strategy)`` -> bytes that checkpointing its groups
            would free there, taken from the strategy's own memory and held
            instead by the y variables while not checkpointed.
        freed_terms: ``(y, bytes)``: activations kept while not checkpointed.
        kept_terms: ``(z, bytes)``: bytes a checkpointed group keeps beyond
            what it frees.
    """

    freed: dict[tuple[int, int], float] = field(default_factory=dict)
    freed_terms: list[tuple[int, float]] = field(default_factory=list)
    kept_terms: list[tuple[int, float]] = field(default_factory=list)

    def node_terms(self, node_memory: list[list[float]]) -> list[tuple[int, int, float]]:
        """``(node, strategy, bytes)`` of every strategy whose x variable holds
        memory: its bytes less what checkpointing frees (held by a y instead)."""
        return [(v, i, m - self.freed.get((v, i), 0.0))
                for v, mem in enumerate(node_memory) for i, m in enumerate(mem)
                if m - self.freed.get((v, i), 0.0)]


def build_formulation(problem: AssignmentProblem, integral_edges: bool) -> Formulation:
    """The MIP of ``problem``, variables and rows in the order of the steps
    below (the formulation in :mod:`planner.ilp.solve`). ``integral_edges`` makes
    the edge variables integer (for CP-SAT, which takes no continuous ones).

    Raises:
        InfeasibleError: when a node has no strategy.
    """
    model = ArrayModel()
    x = _one_strategy_per_node(model, problem)
    node_costs = _edge_terms(model, problem, x, integral_edges)
    _node_objective(model, x, node_costs)
    ckpt, memory = _checkpoint_terms(model, problem, x)
    if problem.memory_weight > 0 and problem.node_memory is not None:
        _memory_objective(model, problem, x, node_costs, memory)
    if problem.memory_budget is not None and problem.node_memory is not None:
        _memory_budget_row(model, problem, x, memory)
    return Formulation(model, x, ckpt)


def _one_strategy_per_node(model: ArrayModel, problem: AssignmentProblem) -> list[list[int]]:
    """The binary x[v][i] of every node and strategy, and the rows
    ``sum_i x[v][i] = 1``."""
    x = [[model.var(integer=True) for _ in c] for c in problem.node_costs]
    for v, xs in enumerate(x):
        if not xs:
            raise InfeasibleError(f"node {v} has no strategy")
        model.row(1.0, 1.0, xs, [1.0] * len(xs))
    return x


def _edge_terms(model: ArrayModel, problem: AssignmentProblem, x: list[list[int]],
                integral: bool) -> list[list[float]]:
    """Every edge, compressed (:func:`planner.ilp.problem.compress_edge`): one
    whose cost depends on one end only is folded into that end's node costs,
    the others get their variables and rows (:func:`_edge_rows`). Returns the
    node costs (seconds) with the folded edges added."""
    node_costs = [list(c) for c in problem.node_costs]
    for u, v, m in problem.edges:
        rows, row_of, cols, col_of = compress_edge(m)
        if len(rows) == 1:  # cost depends on v only
            for j in range(len(node_costs[v])):
                node_costs[v][j] += cols[col_of[j]][0]
            continue
        if len(cols) == 1:  # cost depends on u only
            for i in range(len(node_costs[u])):
                node_costs[u][i] += cols[0][row_of[i]]
            continue
        _edge_rows(model, integral, cols, x[u], _members(row_of, len(rows)),
                   x[v], _members(col_of, len(cols)))
    return node_costs


def _members(group_of: list[int], groups: int) -> list[list[int]]:
    """The indices in each group, ascending: ``out[g] = [i for i if group_of[i] == g]``."""
    out: list[list[int]] = [[] for _ in range(groups)]
    for i, g in enumerate(group_of):
        out[g].append(i)
    return out


def _edge_rows(model: ArrayModel, integral: bool, cols: list[tuple[float, ...]],
               xu: list[int], row_members: list[list[int]],
               xv: list[int], col_members: list[list[int]]) -> None:
    """The variables and transport rows of one compressed edge: ``e[r][c]``
    (u takes a strategy of row group r and v one of column group c, costing
    ``cols[c][r]`` seconds) sums to u's strategies of group r over c and to
    v's of group c over r. A forbidden pair (inf) gets no variable, so it can
    never be chosen. The variables are made in one call, row by row."""
    num_cols = len(cols)
    costs = [col[r] * SCALE for r in range(len(row_members)) for col in cols]
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


def _node_objective(model: ArrayModel, x: list[list[int]], node_costs: list[list[float]]) -> None:
    """Each x[v][i] costs its node cost (seconds, folded edges included); a
    strategy of infinite cost is forbidden (upper bound 0)."""
    for v, c in enumerate(node_costs):
        for i, k in enumerate(c):
            if math.isfinite(k):
                model.cost(x[v][i], k * SCALE)
            else:
                model.forbid(x[v][i])


def _checkpoint_terms(model: ArrayModel, problem: AssignmentProblem,
                      x: list[list[int]]) -> tuple[list[int], _CheckpointMemory]:
    """The binary ckpt[g] of every checkpoint group, and per member node and
    strategy the linearisations z = x AND ckpt (recompute paid, net bytes
    held) where it costs recomputation or keeps more than it frees, and
    y = x AND NOT ckpt (activations kept) where it frees bytes; both are
    bounded from below only, and priced upwards."""
    ckpt = [model.var(integer=True) for _ in problem.checkpoint_groups]
    memory = _CheckpointMemory()
    for g, group in enumerate(problem.checkpoint_groups):
        for k, v in enumerate(group.nodes):
            net = group.net_freed(k)
            for i in range(len(x[v])):
                if group.recompute[k][i] > 0 or net[i] < 0:
                    z = model.var(False, group.recompute[k][i] * SCALE)
                    model.row(-1.0, math.inf, [z, x[v][i], ckpt[g]], [1.0, -1.0, -1.0])
                    if net[i] < 0:
                        memory.kept_terms.append((z, -net[i]))
                if net[i] > 0:
                    y = model.var(False)
                    model.row(0.0, math.inf, [y, x[v][i], ckpt[g]], [1.0, -1.0, 1.0])
                    memory.freed[v, i] = memory.freed.get((v, i), 0.0) + net[i]
                    memory.freed_terms.append((y, net[i]))
    return ckpt, memory


def _memory_objective(model: ArrayModel, problem: AssignmentProblem, x: list[list[int]],
                      node_costs: list[list[float]], memory: _CheckpointMemory) -> None:
    """Memory priced in the objective: the terms of the memory row at
    ``memory_weight`` seconds per byte (not on forbidden strategies)."""
    w = problem.memory_weight * SCALE
    for v, i, b in memory.node_terms(problem.node_memory):
        if math.isfinite(node_costs[v][i]):
            model.add_cost(x[v][i], w * b)
    for var, b in memory.freed_terms + memory.kept_terms:
        model.add_cost(var, w * b)


def _memory_budget_row(model: ArrayModel, problem: AssignmentProblem, x: list[list[int]],
                       memory: _CheckpointMemory) -> None:
    """The row ``memory <= memory_budget``, in bytes as a fraction of the
    budget (which keeps the row's coefficients near 1)."""
    unit = max(problem.memory_budget, 1.0)
    terms = ([(x[v][i], b / unit) for v, i, b in memory.node_terms(problem.node_memory)]
             + [(var, b / unit) for var, b in memory.freed_terms + memory.kept_terms])
    model.row(-math.inf, problem.memory_budget / unit, [var for var, _ in terms],
              [b for _, b in terms])
