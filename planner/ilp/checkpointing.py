"""Deciding a few checkpoint groups by enumeration (:func:`solve_per_checkpointing`):
with the decisions fixed, recomputation (seconds) and the memory a
checkpoint frees (bytes per device) fold into node costs and node memory,
and each combination is an assignment problem without checkpoint terms
(:func:`planner.ilp.backends.solve_assignment`)."""

from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Callable

from planner.ilp.problem import AssignmentProblem, InfeasibleError, Solution
from planner.ilp.backends import PendingMip, solve_assignment, solve_assignment_relaxed

# Up to this many checkpoint groups are decided by enumeration when memory
# matters (each combination is an assignment problem without checkpoint terms).
_CHECKPOINT_COMBINATIONS_GROUPS = 4


def enumerates_checkpointing(problem: AssignmentProblem) -> bool:
    """Whether :func:`planner.ilp.solve.solve` solves ``problem`` once per combination
    of checkpoint decisions: memory matters, there are at most
    :data:`_CHECKPOINT_COMBINATIONS_GROUPS` groups and some strategy is left
    to choose (with no group: only to fold a memory weight into node costs)."""
    groups = len(problem.checkpoint_groups)
    return problem.memory_matters and groups <= _CHECKPOINT_COMBINATIONS_GROUPS and (
        problem.memory_weight > 0 if groups == 0
        else not all(len(c) == 1 for c in problem.node_costs))


def solve_per_checkpointing(problem: AssignmentProblem, time_limit_s: float,
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

    With a budget, every combination's LP relaxation is solved first (each
    answers its combination where it is integral), and the MIPs of the
    fractional ones follow, in order, each left out where its relaxation's
    optimum (a lower bound of its own) is above the least weighted seconds
    found so far: that combination cannot be the answer (CBC's MIPs, ~8 %
    of a llama3-405b search's CPU).
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
    pending: list[tuple[tuple[bool, ...], PendingMip]] = []  # MIPs left, in order
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
            if bounded:  # the MIPs after every combination's LP relaxation
                started = solve_assignment_relaxed(sub, max(share, 0.05), hint, name, reduce)
                if isinstance(started, PendingMip):
                    pending.append((combo, started))
                    continue
                sol = started
            else:
                sol = solve_assignment(sub, max(share, 0.05), hint, name, reduce)
        except InfeasibleError:
            continue
        if problem.fits(sol.choice, list(combo)):
            solved[combo] = (problem.weighted(sol.choice, list(combo)), sol)
    for left, (combo, mip) in zip(range(len(pending), 0, -1), pending):
        if solved and mip.bound_s > _cannot_win(min(v for v, _ in solved.values())):
            continue  # its optimum is above an answer found: it cannot be the best
        try:
            sol = mip.finish(max(max(deadline - time.monotonic(), 0.0) / left, 0.05),
                             time.monotonic())
        except InfeasibleError:
            continue
        if problem.fits(sol.choice, list(combo)):
            solved[combo] = (problem.weighted(sol.choice, list(combo)), sol)
    return _best_combination(problem, combos, solved)


def _cannot_win(best: float) -> float:
    """The LP bound (weighted seconds) above which a combination's MIP cannot
    tie ``best``, the least weighted seconds found: past GLOP's tolerance on
    its optimum and the rounding of the two sums."""
    return best + 1e-6 * abs(best) + 1e-12


def _best_combination(problem: AssignmentProblem, combos: list[tuple[bool, ...]],
                      solved: dict[tuple[bool, ...], tuple[float, Solution]]) -> Solution:
    """The answer among the ``solved`` combinations (each: its weighted
    seconds and solution): the first best in the order of ``combos`` (as
    solving them all in order), not OPTIMAL unless every one was."""
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
