"""Exact shrinking of an assignment problem before the ILP (:func:`eliminate`):
nodes that cannot matter to memory and have at most two neighbours are
removed by variable elimination, their costs (seconds) folded into an edge,
a neighbour's node costs or a constant; :class:`Reduction` maps the reduced
problem's answer back to every original node."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from planner.ilp.problem import AssignmentProblem, CheckpointGroup, as_array

# A node is eliminated only if the cost tensor it needs has at most this many
# entries (bytes = 8 x this), so one elimination never takes more than ~64 MB.
_ELIMINATION_ENTRIES = 8_000_000

# One elimination: ``(v, costs, neighbours, matrices)``, node v's costs
# (seconds per strategy) and its cost matrices to its neighbours when removed.
Step = tuple[int, np.ndarray, list[int], list[np.ndarray]]


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
    steps: list[Step]
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


class _Graph:
    """The problem's node costs and edge matrices (seconds) as elimination
    rewrites them: ``nbr[v][w][i, j]`` is the cost of v taking i and w taking
    j (parallel edges summed, ``nbr[w][v]`` its transpose), and ``offset`` the
    seconds of the nodes removed with no neighbour left."""

    def __init__(self, problem: AssignmentProblem):
        n = len(problem.node_costs)
        self.costs = [np.asarray(c, dtype=float) for c in problem.node_costs]
        self.nbr: list[dict[int, np.ndarray]] = [{} for _ in range(n)]
        self.alive = [True] * n
        self.offset = 0.0
        for u, v, m in problem.edges:
            self.link(u, v, as_array(m).reshape(len(self.costs[u]), len(self.costs[v])))

    def link(self, a: int, b: int, m: np.ndarray) -> None:
        """Add the edge matrix ``m[i of a, j of b]`` (a self-loop's diagonal to a's costs)."""
        if a == b:
            self.costs[a] = self.costs[a] + np.diagonal(m)
            return
        if b in self.nbr[a]:
            m = self.nbr[a][b] + m
        self.nbr[a][b], self.nbr[b][a] = m, m.T

    def remove(self, v: int) -> Step | None:
        """Eliminate node v (at most two neighbours) and return the step, or
        None when v is kept: its merged edge would be larger than the two it
        replaces, or every strategy of v is forbidden (the MIP reports that)."""
        neighbours = sorted(self.nbr[v])
        matrices = [self.nbr[v][w] for w in neighbours]
        c = self.costs[v]
        if len(neighbours) == 2:
            if not self._merge(v, c, neighbours, matrices):
                return None
        elif len(neighbours) == 1:
            (a,), (ma,) = neighbours, matrices
            self.costs[a] = self.costs[a] + (c[:, None] + ma).min(axis=0)
            del self.nbr[a][v]
        elif np.isfinite(c.min()):
            self.offset += float(c.min())
        else:
            return None
        self.nbr[v] = {}
        self.alive[v] = False
        return v, c, neighbours, matrices

    def _merge(self, v: int, c: np.ndarray, neighbours: list[int],
               matrices: list[np.ndarray]) -> bool:
        """Replace v's edges to neighbours a and b by one a-b edge
        ``M[i][k] = min_j (c[j] + M_va[j][i] + M_vb[j][k])``; False (nothing
        changed) when that edge would have more entries than the two it
        replaces or the cost tensor more than :data:`_ELIMINATION_ENTRIES`."""
        a, b = neighbours
        ma, mb = matrices
        j, i, k = ma.shape[0], ma.shape[1], mb.shape[1]
        if i * k > j * (i + k) or j * i * k > _ELIMINATION_ENTRIES:
            return False
        merged = ((c[:, None] + ma)[:, :, None] + mb[:, None, :]).min(axis=0)
        del self.nbr[a][v], self.nbr[b][v]
        self.link(a, b, merged)
        return True


def _pinned(problem: AssignmentProblem, groups: list[CheckpointGroup]) -> set[int]:
    """The nodes elimination must keep: those with no strategy (infeasible:
    the MIP says so), those in a checkpoint group of ``groups``, and, when
    memory matters, those that hold memory."""
    pinned = {v for v, c in enumerate(problem.node_costs) if not c}
    pinned |= {v for g in groups for v in g.nodes}
    if problem.memory_matters:
        pinned |= {v for v, m in enumerate(problem.node_memory) if any(m)}
    return pinned


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
    # without a budget memory is free and checkpointing only costs recomputation,
    # so the groups are dropped (never checkpointed) and memory pins nothing
    groups = problem.checkpoint_groups if problem.memory_matters else []
    pinned = _pinned(problem, groups)
    if len(pinned) == len(problem.node_costs):
        return None
    graph = _Graph(problem)
    steps: list[Step] = []
    changed = True
    while changed:
        changed = False
        for v in range(len(graph.costs)):
            if not graph.alive[v] or v in pinned or len(graph.nbr[v]) > 2:
                continue
            step = graph.remove(v)
            if step is not None:
                steps.append(step)
                changed = True
    if not steps and len(groups) == len(problem.checkpoint_groups):
        return None
    return _reduction(problem, graph, groups, steps)


def _reduction(problem: AssignmentProblem, graph: _Graph, groups: list[CheckpointGroup],
               steps: list[Step]) -> Reduction:
    """The problem of the nodes ``graph`` keeps (renumbered in index order,
    with ``groups`` as its checkpoint groups) and the way back to ``problem``."""
    kept = [v for v, alive in enumerate(graph.alive) if alive]
    index = {v: i for i, v in enumerate(kept)}
    edges = [(index[a], index[b], m.tolist()) for a in kept for b, m in sorted(graph.nbr[a].items())
             if b > a]
    reduced = AssignmentProblem(
        node_costs=[graph.costs[v].tolist() for v in kept], edges=edges,
        node_memory=None if problem.node_memory is None else [problem.node_memory[v] for v in kept],
        memory_budget=problem.memory_budget,
        checkpoint_groups=[dataclasses.replace(g, nodes=[index[v] for v in g.nodes])
                           for g in groups],
        memory_weight=problem.memory_weight)
    return Reduction(reduced, kept, graph.offset, steps,
                     bool(groups) or not problem.checkpoint_groups)


def reduced_size(problem: AssignmentProblem) -> tuple[int, int]:
    """(variables, constraints) of the MIP :func:`planner.ilp.solve.solve` builds for
    ``problem``: after :func:`eliminate`, when it removes anything."""
    reduced = eliminate(problem)
    return (reduced.problem if reduced is not None else problem).size()
