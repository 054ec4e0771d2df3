"""Warm starts of the intra-op ILP (:mod:`planner.ilp.intra_op`): assignments
the solver starts from, one strategy index per problem variable, and the
choice of the best of them under a problem's memory budget."""

from __future__ import annotations

from typing import Mapping, Sequence

from torch.distributed.tensor.placement_types import Replicate

from ir.graph import INPUT, PARAM, Graph
from ir.strategy import NodeStrategies, Placements
from planner.ilp.solve import AssignmentProblem, greedy_assignment, warm_start_value
from planner.megatron_layout import MegatronConfig, megatron_layout

__all__ = ["best_warm_start", "megatron_targets", "warm_starts"]


def _replicated_index(ns: NodeStrategies) -> int:
    """Index of the all-replicate strategy, or 0 if there is none."""
    for i, s in enumerate(ns.strategies):
        if all(isinstance(p, Replicate) for pl in (*s.inputs, *s.outputs) for p in pl):
            return i
    return 0


def megatron_targets(graph: Graph, mesh_shape: Sequence[int]) -> dict[str, list[Placements]]:
    """Megatron-style output placements of parameters (by FQN) and user inputs (by
    name), most wanted first: tensor parallel on the last mesh axis (column-parallel
    weights ``S(0)``, row-parallel ``S(1)``, vocabulary-parallel embedding, as
    :func:`planner.megatron_layout.megatron_layout` classifies them) and data parallel on
    every other axis (parameters replicated, inputs split on the batch dim); then
    the same without the data-parallel split; then replicated."""
    n = len(tuple(mesh_shape))
    r = Replicate()
    layout = megatron_layout(graph, MegatronConfig(tensor_model_parallel_size=2,
                                                   data_parallel_size=2))  # (dp, tp) each
    out: dict[str, list[Placements]] = {}
    for key, (dp_p, tp_p) in layout.items():
        wanted = [(dp_p,) * (n - 1) + (tp_p,) if n > 1 else (tp_p,),
                  (r,) * (n - 1) + (tp_p,), (r,) * n]
        out[key] = list(dict.fromkeys(wanted))
    return out


def warm_starts(graph: Graph, mesh_shape: Sequence[int], strategies: list[NodeStrategies],
                members: list[list[int]], problem: AssignmentProblem) -> dict[str, list[int]]:
    """Candidate warm starts of ``problem``, whose variable c is the class of
    nodes ``members[c]`` (indices into ``strategies``), one strategy index per
    variable:

    * ``replicate``: every node all-replicated where it can be;
    * ``megatron``: parameters and user inputs on :func:`megatron_targets`'s
      layout, every op then taking greedily (in program order) the strategy
      cheapest given what its producers took (:func:`planner.ilp.solve.greedy_assignment`).
    """
    replicate = [_replicated_index(strategies[group[0]]) for group in members]
    targets = megatron_targets(graph, mesh_shape)
    allowed: list[list[int] | None] = []
    for group in members:
        ns = strategies[group[0]]
        key = ns.node.fqn if ns.node.kind == PARAM else ns.node.name
        allowed.append(None)
        if ns.node.kind in (PARAM, INPUT) and key in targets:
            for want in targets[key]:
                match = [i for i, s in enumerate(ns.strategies) if s.outputs[0] == want]
                if match:
                    allowed[-1] = match
                    break
    return {"replicate": replicate, "megatron": greedy_assignment(problem, allowed)}


def best_warm_start(problem: AssignmentProblem, candidates: Mapping[str, list[int]]) -> str:
    """Name of the candidate with the least seconds among those that fit
    ``problem``'s memory budget (:func:`planner.ilp.solve.warm_start_value`, which may
    checkpoint every group); if none fits, the one with the least seconds without
    checkpointing. Ties: the first."""
    values = {k: warm_start_value(problem, c) for k, c in candidates.items()}
    fitting = [k for k, v in values.items() if v is not None]
    if fitting:
        return min(fitting, key=lambda k: values[k][0])
    return min(candidates, key=lambda k: problem.evaluate(candidates[k]))
