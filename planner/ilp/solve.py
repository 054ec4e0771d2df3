"""The strategy-assignment ILP, solved with OR-Tools (CBC by default).

Abstract form (Alpa's intra-op formulation): pick one strategy per node to
minimise the sum of node costs plus, on every edge (u, v), the cost of the pair
of strategies chosen at its ends. All costs are seconds, memory is bytes per
device.

This module is the face: :func:`solve`, and the names the planner imports.
The work is in

* :mod:`planner.ilp.problem`: the data (:class:`AssignmentProblem`,
  :class:`CheckpointGroup`, :class:`EdgeMatrix`, :class:`Solution`,
  ``Hint``), edge compression, :func:`greedy_assignment`, :func:`brute_force`;
* :mod:`planner.ilp.checkpointing`: a few checkpoint groups decided by enumeration;
* :mod:`planner.ilp.eliminate`: exact shrinking before the model (:func:`eliminate`);
* :mod:`planner.ilp.formulation`: the MIP as arrays, one function per constraint family;
* :mod:`planner.ilp.backends`: GLOP and the MIP backends on one problem, the warm start.

How :func:`solve` gets to an answer (every step exact):

1. Where memory matters (node memory, and a budget or a weight) and there
   are 1 to 4 checkpoint groups and some node with a strategy to choose, or
   no group and w > 0, one problem per combination of checkpoint decisions,
   without checkpoint variables (``ilp_checkpointing.enumerates_checkpointing``,
   ``solve_per_checkpointing``, ``_with_checkpointing``):
   c_{v,i} += sum_{checkpointed g with v} r_{g,v,i};
   m_{v,i} -= sum_{checkpointed g with v} n_{g,v,i}; then c_{v,i} += w m_{v,i}
   and w = 0 (the budget B stays). Each is solved by steps 2-4; without a
   budget a combination that cannot beat the all-checkpointed one's optimum
   (``_least_change``) is skipped.
2. Nodes with a strategy, in no checkpoint group, holding no memory (where
   memory matters) and with at most two neighbours are eliminated
   (``ilp_eliminate.eliminate``): with neighbours a, b the a-b edge gains
   min_j (c_{v,j} + M_va[j][i] + M_vb[j][k]) at [i][k] (unless it would
   have more entries than the two it replaces, or the tensor over j, i, k
   more than 8e6); with one neighbour a,
   c_{a,i} += min_j (c_{v,j} + M_va[j][i]); alone, a constant. Where memory
   does not matter the checkpoint groups are dropped (never checkpointed).
3. Every node down to one strategy (and at most 10 groups): the checkpoint
   decisions are enumerated (``ilp_solver._solve_fixed``).
4. Otherwise the MIP below (:func:`planner.ilp.formulation.build_formulation`). With CBC its LP
   relaxation goes first (GLOP, ``ilp_solver._integral_relaxation``) and is
   the answer when its optimal vertex is integral; else the MIP backend
   runs, warm-started by the hint (``ilp_solver._solve_mip``).

The MIP (functions in :mod:`planner.ilp.formulation`). Notation: c_{v,i} seconds
of node v under strategy i; M_uv[i][j] seconds of edge (u, v) when u takes i
and v takes j (inf: forbidden); m_{v,i} bytes node v holds under i; for node
v in checkpoint group g, r_{g,v,i} seconds to recompute it and n_{g,v,i}
bytes checkpointing frees net (``CheckpointGroup.net_freed``: saved less
kept, may be negative); B the memory budget (bytes), w the memory weight
(seconds per byte). Edge compression (``ilp_problem.compress_edge``): equal
rows of M_uv form row groups r(i), equal columns of the distinct rows form
column groups c(j), and K_uv[r][c] is the compressed cost. Objective
coefficients are seconds x 1e6 (``planner.ilp.formulation.SCALE``); the budget row is in
bytes / U with U = max(B, 1).

Variables:

* x_{v,i} in {0, 1}: node v takes strategy i (``_one_strategy_per_node``).
* e_{uv,r,c} in [0, 1] (integer for CP-SAT): u takes a strategy of row
  group r and v one of column group c; only on edges with at least two row
  and two column groups, and only where K_uv[r][c] is finite (``_edge_rows``).
* ckpt_g in {0, 1}: group g is checkpointed (``_checkpoint_terms``).
* z_{g,v,i} in [0, 1], x_{v,i} AND ckpt_g: only where r_{g,v,i} > 0 or
  n_{g,v,i} < 0 (``_checkpoint_terms``).
* y_{g,v,i} in [0, 1], x_{v,i} AND NOT ckpt_g: only where n_{g,v,i} > 0
  (``_checkpoint_terms``).

Folded edges (no variables, ``_edge_terms``): an edge with one row group
adds K_uv[0][c(j)] to c_{v,j}, one with one column group adds K_uv[r(i)][0]
to c_{u,i}. c'_{v,i} is the node cost with these added.

Constraints:

1. One strategy per node, sum_i x_{v,i} = 1 for every v
   (``_one_strategy_per_node``; a node with no strategy raises InfeasibleError).
2. Forbidden strategies, x_{v,i} <= 0 (its upper bound) where c'_{v,i} = inf
   (``_node_objective``). Fixed placements need no constraint: the caller
   (``planner.ilp.intra_op``) leaves the other strategies out of the problem.
3. Edge consistency (transport rows), for each edge with variables
   (``_edge_rows``): sum_c e_{uv,r,c} = sum_{i: r(i) = r} x_{u,i} for every
   row group r, and sum_r e_{uv,r,c} = sum_{j: c(j) = c} x_{v,j} for every
   column group c. A forbidden pair has no e, so no integral x takes it.
4. Checkpoint linearisation, bounded from below only (the objective pushes
   z and y down) (``_checkpoint_terms``): z_{g,v,i} >= x_{v,i} + ckpt_g - 1,
   and y_{g,v,i} >= x_{v,i} - ckpt_g.
5. Memory budget, when B and node memory are given (``_memory_budget_row``):
   Mem / U <= B / U, where
   Mem = sum_{v,i} (m_{v,i} - F_{v,i}) x_{v,i} + sum y_{g,v,i} n_{g,v,i}
         + sum_{n_{g,v,i} < 0} z_{g,v,i} (-n_{g,v,i}),
   F_{v,i} = sum_{g with v, n_{g,v,i} > 0} n_{g,v,i} (the bytes checkpointing
   would free, held by the y variables instead of x).

Objective, minimised (seconds x SCALE):

  sum_{v,i} c'_{v,i} x_{v,i}                  compute, and edges folded (``_node_objective``)
+ sum_{uv,r,c} K_uv[r][c] e_{uv,r,c}          communication and resharding (``_edge_rows``)
+ sum r_{g,v,i} z_{g,v,i}                     recomputation (``_checkpoint_terms``)
+ w Mem, when w > 0 and node memory is given  memory price (``_memory_objective``; its x
                                              terms only where c'_{v,i} is finite)
"""

from __future__ import annotations

from planner.ilp.checkpointing import enumerates_checkpointing, solve_per_checkpointing
from planner.ilp.eliminate import Reduction, eliminate, reduced_size
from planner.ilp.problem import (AssignmentProblem, CheckpointGroup, EdgeMatrix, Hint,
                                 InfeasibleError, Solution, brute_force, greedy_assignment,
                                 made_once)
from planner.ilp.backends import SOLVERS, solve_assignment, warm_start_value

__all__ = ["SOLVERS", "AssignmentProblem", "CheckpointGroup", "EdgeMatrix", "Hint",
           "InfeasibleError", "Reduction", "Solution", "brute_force", "eliminate",
           "greedy_assignment", "reduced_size", "solve", "warm_start_value"]


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
    hint_of = made_once(hint)
    if enumerates_checkpointing(problem):
        return solve_per_checkpointing(problem, time_limit_s, hint_of, name, reduce)
    return solve_assignment(problem, time_limit_s, hint_of, name, reduce)
