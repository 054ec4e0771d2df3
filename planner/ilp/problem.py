"""The data of the strategy-assignment ILP (:mod:`planner.ilp.solve`): the problem
(node costs in seconds, edge cost matrices in seconds, memory in bytes per
device, checkpoint groups), a solver's answer, the warm start a caller may
give, and the exact compression of one edge's cost matrix that both the
model (:mod:`planner.ilp.formulation`) and its size count use. Also the answers
that need no solver: a greedy assignment (a warm start) and the exhaustive
optimum (for tests)."""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass, field
from typing import Callable, Optional, Union

import numpy as np


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
    :func:`planner.ilp.eliminate.eliminate` reads every matrix as an array
    each time (~0.2 s of a llama3-8b search)."""

    @functools.cached_property
    def array(self) -> np.ndarray:
        return np.asarray(self, dtype=float)


def as_array(m: list[list[float]]) -> np.ndarray:
    """An edge's cost matrix (seconds) as a float array (kept by an :class:`EdgeMatrix`)."""
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

    def size(self) -> tuple[int, int]:
        """(variables, constraints) of the MIP :func:`planner.ilp.solve.solve` would build
        for this problem as it is (:func:`planner.ilp.solve.reduced_size`: after
        :func:`planner.ilp.eliminate.eliminate`)."""
        variables = sum(len(c) for c in self.node_costs)
        constraints = len(self.node_costs) + (1 if self.memory_budget is not None else 0)
        for _, _, m in self.edges:
            rows, _, cols, _ = compress_edge(m)
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
    """A solver's answer: a strategy per node and a decision per checkpoint
    group, its seconds (``objective_s``, :meth:`AssignmentProblem.evaluate`)
    and a lower bound of the optimum's (``bound_s``), the backend's status and
    the size of the model it solved."""

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


# A warm start (one strategy index per node), a function giving it, or none.
Hint = Union[list[int], Callable[[], Optional[list[int]]], None]


def made_once(hint: Hint) -> Callable[[], list[int] | None]:
    """``hint`` as a function that makes it at most once."""
    return functools.cache(hint) if callable(hint) else lambda: hint


def _groups(vectors: list[tuple[float, ...]]) -> tuple[list[tuple[float, ...]], list[int]]:
    """Distinct vectors (in first-seen order) and the group index of each input."""
    index: dict[tuple[float, ...], int] = {}
    of = []
    for v in vectors:
        of.append(index.setdefault(v, len(index)))
    return list(index), of


def compress_edge(matrix: list[list[float]]):
    """Distinct rows of ``matrix`` and distinct columns of those rows, with the
    group of every original row and column: ``cols[c][r]`` is the compressed cost.

    Rows that are one list object (as :func:`planner.ilp.intra_op.build_problem` shares
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
    """Exhaustive optimum (for tests on small problems): the assignment and its seconds."""
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
