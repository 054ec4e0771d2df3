"""Intra-op pass: choose every op's sharding strategy on one device mesh.

Builds the assignment problem of :mod:`planner.ilp.solve` from a Graph, its DTensor
strategies (:mod:`planner.ilp.strategies`) and their prices
(:class:`costmodel.strategy_cost.IntraOpCost`), and solves it. Costs are
seconds of one training step (forward, backward and gradient
synchronisation): a node's cost is its strategy's compute and collectives, an
edge's cost the resharding of the producer's output placement into the
consumer's input placement, forward and backward. Memory is a sum over nodes
(bytes per device); the parameter copies a reader's redistribute gathers
depend on an edge's two ends, so each answer is checked with them counted
and, where they take it over the budget, solved again with them charged to
the parameters' strategies (:func:`solve_prepared`); a memory-weighted solve
(a layer profile's point) leaves them out.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field
from typing import Callable, Hashable, Mapping, Sequence


from costmodel.cluster import Cluster
from costmodel.resharding import ReshardPricer
from costmodel.strategy_cost import CostBreakdown, IntraOpCost
from ir.graph import OP, PARAM, Graph, TensorInfo
from ir.repeated_blocks import Layer
from ir.strategy import NodeStrategies, Placements, Strategy, local_numel
from planner.ilp.solve import AssignmentProblem, CheckpointGroup, EdgeMatrix, Hint, Solution, solve
from planner.report import format_bytes
from planner.ilp.fixed_layout import pin_fixed
from planner.ilp.strategies import build_strategies
from planner.ilp.warm_starts import best_warm_start, warm_starts



@dataclass
class IntraOpResult:
    graph: Graph
    mesh_shape: tuple[int, ...]
    strategies: list[NodeStrategies]
    chosen: dict[str, Strategy]
    solution: Solution
    breakdown: CostBreakdown
    time_limit_s: float
    memory: dict[str, float]  # bytes per device by kind (params, grads, optimizer, activations)
    checkpointed: list[str] = field(default_factory=list)  # layers recomputed in backward
    # the weight of once-per-step seconds in the objective (IntraOpCost.step_share)
    step_share: float = 1.0


def _distinct(specs: list[int]) -> tuple[list[int], list[int]]:
    """Distinct placement ids (first-seen order) and the index of each input in them."""
    index: dict[int, int] = {}
    of = [index.setdefault(p, len(index)) for p in specs]
    return list(index), of


def tie_classes(graph: Graph, strategies: list[NodeStrategies],
                layers: list[Layer] | None = None, untied: frozenset[str] = frozenset(),
                price_key: Callable[[str], Hashable] | None = None) -> list[int]:
    """Class of each node: nodes at the same position of repeated blocks (same
    :func:`ir.repeated_blocks.find_layers` signature) with the same strategy list share one
    class, so every copy of a block takes the same strategies (as Megatron does);
    every other node, and every node named in ``untied`` (priced unlike its
    copies), is a class of its own. ``price_key``: node name -> what else its
    price depends on beyond its own shapes
    (:meth:`costmodel.strategy_compute.ComputePricing.price_context`: the first
    block's ops reading a user input run fewer backward kernels, the last
    block's fused chain writes less); nodes tie only where it agrees.
    Classes are numbered in program order."""
    index = {ns.node.name: v for v, ns in enumerate(strategies)}
    tied_to = list(range(len(strategies)))
    reps: dict[tuple[str, int], list[int]] = {}
    for layer in graph.layers if layers is None else layers:
        for pos, name in enumerate(layer.nodes):
            v = index[name]
            if name in untied:
                continue
            for r in reps.get((layer.signature, pos), []):
                if strategies[r].strategies == strategies[v].strategies and (
                        price_key is None
                        or price_key(strategies[r].node.name) == price_key(name)):
                    tied_to[v] = r
                    break
            else:
                reps.setdefault((layer.signature, pos), []).append(v)
    dense: dict[int, int] = {}
    return [dense.setdefault(tied_to[v], len(dense)) for v in range(len(strategies))]


@dataclass
class IntraOpProblem:
    """The (tied) assignment problem and how it maps back to graph nodes.

    ``classes[v]`` is the problem variable of node v; ``members[c]`` the nodes of
    class c; ``loop_costs[c][i]`` the part of class c's node cost that is
    resharding on edges inside the class (block-to-block edges of tied nodes);
    ``checkpoint_layers[g]`` the layers that checkpoint group g checkpoints;
    ``recomputed_fraction[g]`` the fraction of group g's activations alive again
    while the backward recomputes one of its layers (one micro-batch's).
    """

    problem: AssignmentProblem
    classes: list[int]
    members: list[list[int]]
    loop_costs: list[list[float]]
    checkpoint_layers: list[list[str]] = field(default_factory=list)
    recomputed_fraction: list[float] = field(default_factory=list)

    def expand(self, choice: list[int]) -> list[int]:
        """Strategy index of every node from a choice per class."""
        return [choice[c] for c in self.classes]


def build_problem(cost: IntraOpCost, strategies: list[NodeStrategies],
                  memory_budget: float | None = None, tie: bool = True) -> IntraOpProblem:
    """The assignment problem of ``strategies`` priced by ``cost``.

    Args:
        memory_budget: bytes per device the chosen strategies may hold.
        tie: give repeated blocks one set of variables (see :func:`tie_classes`);
            identical edges and nodes are then priced once and multiplied.
    """
    layers = cost.graph.layers
    untied = frozenset([cost.transient_node] if cost.transient_node else [])
    by_name = cost.graph.by_name
    classes = (tie_classes(cost.graph, strategies, layers, untied,
                           lambda name: cost.price_context(by_name[name])) if tie
               else list(range(len(strategies))))
    members: list[list[int]] = [[] for _ in range(max(classes, default=-1) + 1)]
    for v, c in enumerate(classes):
        members[c].append(v)
    index = {ns.node.name: v for v, ns in enumerate(strategies)}
    node_costs, node_memory = [], []
    for group in members:
        ns, n = strategies[group[0]], len(group)
        # a parameter's prices are once per step (IntraOpCost.step_share)
        w = n * (cost.step_share if ns.node.kind == PARAM else 1.0)
        node_costs.append([w * (c + cost.backward_collectives(ns.node, s)) for c, s in
                           zip(cost.compute_each(ns.node, ns.strategies), ns.strategies)])
        node_memory.append([n * cost.memory(ns.node, s) for s in ns.strategies])
    loop_costs = [[0.0] * len(c) for c in node_costs]
    edge_count: dict[tuple, int] = {}
    edge_first: dict[tuple, tuple[int, int, int]] = {}
    for v, ns in enumerate(strategies):
        for k, arg in enumerate(ns.node.args):
            u = index[arg]
            key = (classes[u], classes[v], k, arg in cost.requires_grad,
                   k in ns.node.layout_bound)
            edge_count[key] = edge_count.get(key, 0) + 1
            edge_first.setdefault(key, (u, v, k))
    edges = []
    for key, count in edge_count.items():
        u, v, k = edge_first[key]
        matrix = _edge_matrix(cost, strategies[u], strategies[v], k)
        cu, cv = key[0], key[1]
        if cu == cv:  # an edge between two copies of the same tied node
            for i in range(len(matrix)):
                loop_costs[cu][i] += count * matrix[i][i]
                node_costs[cu][i] += count * matrix[i][i]
        else:
            if count != 1:  # scale each distinct row object once, keeping rows shared
                scaled: dict[int, list[float]] = {}
                for row in matrix:
                    if id(row) not in scaled:
                        scaled[id(row)] = [count * x for x in row]
                matrix = [scaled[id(row)] for row in matrix]
            edges.append((cu, cv, EdgeMatrix(matrix)))
    groups, group_layers, recomputed = _checkpoint_groups(cost, strategies, layers, classes,
                                                          members, node_memory)
    problem = AssignmentProblem(node_costs, edges, node_memory=node_memory,
                                memory_budget=memory_budget, checkpoint_groups=groups)
    return IntraOpProblem(problem, classes, members, loop_costs, group_layers, recomputed)


def _first_readers(graph: Graph, ops: list[str], inside: set[str]) -> list[tuple[str, int]]:
    """(op, argument position) of the first op in ``ops`` (program order) to read
    each floating value from outside ``inside``: the layer inputs a checkpointed
    layer keeps for its backward, each once."""
    seen: set[str] = set()
    out = []
    for name in ops:
        node = graph[name]
        for k, a in enumerate(node.args):
            if a in inside or a in seen or k >= len(node.inputs) or not node.inputs[k].is_float:
                continue
            seen.add(a)
            out.append((name, k))
    return out


def _checkpoint_groups(cost: IntraOpCost, strategies: list[NodeStrategies], layers: list[Layer],
                       classes: list[int], members: list[list[int]],
                       node_memory: list[list[float]]):
    """One checkpointing decision per layer signature: all layers with it are
    checkpointed or none. A checkpointed layer drops the activations its ops
    save, keeps its inputs, and re-runs its forward in backward, when its
    activations are alive again: the group's memory keeps one layer's (one
    micro-batch's) worth. Layers whose ops
    are not contiguous in program order are not offered (they cannot be wrapped)."""
    index = {ns.node.name: v for v, ns in enumerate(strategies)}
    op_order = [ns.node.name for ns in strategies if ns.node.kind == OP]
    op_pos = {name: i for i, name in enumerate(op_order)}
    by_sig: dict[str, list[Layer]] = {}
    for layer in layers:
        by_sig.setdefault(layer.signature, []).append(layer)
    groups, names, recomputed = [], [], []
    graph = cost.graph
    for sig_layers in by_sig.values():
        group_classes, contiguous = [], True
        count: dict[int, int] = {}  # class -> its ops in these layers
        # class -> bytes per device per strategy the checkpointed layers keep
        kept_of: dict[int, list[float]] = {}
        for layer in sig_layers:
            ops = [n for n in layer.nodes if n in op_pos]
            if not ops or op_pos[ops[-1]] - op_pos[ops[0]] + 1 != len(ops):
                contiguous = False
                break
            inside = set(layer.nodes)
            for reader, k in _first_readers(graph, ops, inside):
                c = classes[index[reader]]
                info = graph[reader].inputs[k]
                held = [cost.activation_copies * info.itemsize
                        * local_numel(info, st.inputs[k], cost.mesh_shape)
                        for st in strategies[index[reader]].strategies]
                kept_of[c] = [a + b for a, b in zip(kept_of.get(c, [0.0] * len(held)), held)]
            for n in ops:
                c = classes[index[n]]
                count[c] = count.get(c, 0) + 1
                if c not in group_classes:
                    group_classes.append(c)
        if not contiguous or not any(any(node_memory[c]) for c in group_classes):
            continue  # nothing to free
        group_classes += [c for c in kept_of if c not in group_classes]
        kept = [kept_of.get(c, [0.0] * len(node_memory[c])) for c in group_classes]
        # every op of the layers runs again (ops of a class outside them do not)
        recompute = []
        for c in group_classes:
            ns = strategies[members[c][0]]
            recompute.append([count.get(c, 0) * t
                              for t in cost.recompute_each(ns.node, ns.strategies)])
        # what checkpointing frees: the saved activations (not a backward transient) of
        # all but one layer and micro-batch, which the backward recomputes at a time
        freed = 1.0 - 1.0 / (len(sig_layers) * cost.activation_copies)
        saved = [[freed * count.get(c, 0) * cost.activation_copies
                  * cost.memory_breakdown(strategies[members[c][0]].node, st).get("activations", 0.0)
                  for st in strategies[members[c][0]].strategies] for c in group_classes]
        groups.append(CheckpointGroup(group_classes, saved, recompute, kept))
        names.append([layer.name for layer in sig_layers])
        recomputed.append(1.0 - freed)
    return groups, names, recomputed


def _edge_matrix(cost: IntraOpCost, prod: NodeStrategies, cons: NodeStrategies,
                 k: int) -> list[list[float]]:
    """Seconds of moving ``cons``'s k-th argument from each producer strategy into
    each consumer strategy (forward reshard plus gradient reshard)."""
    node = cons.node
    out_idx = node.arg_index if node.target == "getitem" else 0
    info = node.inputs[k] if node.inputs else prod.node.outputs[out_idx]
    rg = node.args[k] in cost.requires_grad and info.is_float
    weight = rg and node.args[k] in cost.param_derived
    # the strategy lists come from the search's strategy cache, so other
    # graphs on this mesh ask for the same matrix (~36k asks, ~4k matrices
    # in a llama3-8b search); filed with the lists, so that their ids stay theirs
    key = (id(prod.strategies), id(cons.strategies), out_idx, k, info.shape, info.itemsize, rg,
           weight, node.target == "getitem" or k in node.layout_bound)
    memo = cost.edge_matrices
    known = memo.get(key)
    if known is not None and known[0] is prod.strategies and known[1] is cons.strategies:
        return known[2]
    matrix = _priced_matrix(cost, prod, cons, k, out_idx, info, rg, weight)
    memo[key] = (prod.strategies, cons.strategies, matrix)
    return matrix


def _priced_matrix(cost: IntraOpCost, prod: NodeStrategies, cons: NodeStrategies, k: int,
                   out_idx: int, info: TensorInfo, rg: bool, weight: bool) -> list[list[float]]:
    """:func:`_edge_matrix`, priced (``rg``: with the gradient's reshard;
    ``weight``: of a weight, :meth:`IntraOpCost.gradient_reshard`)."""
    node = cons.node
    srcs, src_of = _distinct([cost.spec_id(ps.outputs[out_idx]) for ps in prod.strategies])
    dsts, dst_of = _distinct([cost.spec_id(cs.inputs[k]) for cs in cons.strategies])
    if node.target == "getitem" or k in node.layout_bound:
        # a tuple projection cannot reshard, nor a tensor whose views rely on its
        # captured strides (ir.node.Node.layout_bound): it follows its producer
        priced = [[0.0 if a == b else math.inf for b in dsts] for a in srcs]
    else:
        priced = cost.edge_seconds(tuple(srcs), tuple(dsts), info, rg, weight)
    # producer strategies with the same output placement share one row object
    # (planner.ilp.problem.compress_edge recognises them by identity)
    rows = [[row[j] for j in dst_of] for row in priced]
    return [rows[i] for i in src_of]


class MemoryInfeasibleError(RuntimeError):
    """No sharding fits the memory budget.

    Attributes:
        least_bytes: the least memory per device any assignment needs, bytes.
        budget_bytes: the budget that was given, bytes.
    """

    def __init__(self, least_bytes: float, budget_bytes: float, mesh_shape: tuple[int, ...]):
        self.least_bytes, self.budget_bytes, self.mesh_shape = least_bytes, budget_bytes, mesh_shape
        super().__init__(
            f"no sharding on mesh {'x'.join(map(str, mesh_shape))} fits {format_bytes(budget_bytes)} "
            f"per device; the least any plan needs is {format_bytes(least_bytes)} per device "
            f"- use devices with that much memory, more devices, or a smaller batch")


def _best_hint(prepared: PreparedIntraOp, problem: AssignmentProblem) -> list[int]:
    """The best of ``prepared``'s warm starts for ``problem`` (:func:`best_warm_start`)."""
    return prepared.hints[best_warm_start(problem, prepared.hints)]


def least_memory(problem: AssignmentProblem) -> float:
    """Least bytes per device of any assignment: memory is a sum over nodes, and
    each checkpoint group may or may not be checkpointed."""
    if not problem.node_memory:
        return 0.0
    in_group: set[int] = set()
    total = 0.0
    for g in problem.checkpoint_groups:
        in_group.update(g.nodes)
        plain = sum(min(problem.node_memory[v]) for v in g.nodes)
        checkpointed = sum(min(m - f for m, f in zip(problem.node_memory[v], g.net_freed(k)))
                           for k, v in enumerate(g.nodes))
        total += min(plain, checkpointed)
    return total + float(sum(min(m) for v, m in enumerate(problem.node_memory)
                             if v not in in_group))


def solve_intra_op(graph: Graph, cluster: Cluster, mesh_shape: Sequence[int], *,
                   dtype: str = "float32", time_limit_s: float = 30.0,
                   memory_budget: float | None = None, optimizer: str = "adam",
                   fixed: Mapping[str, Placements] | None = None,
                   activation_copies: float = 1.0,
                   strategies: list[NodeStrategies] | None = None,
                   recompute: bool | None = None) -> IntraOpResult:
    """Choose a strategy for every node of ``graph`` on a mesh of ``mesh_shape``.

    Args:
        dtype: the training precision (``bf16-mixed``, ``bf16``, ``fp32``;
            see :mod:`ir.precision`), or the dtype name of older callers.
        recompute: see :func:`solve_prepared`.
        memory_budget: bytes per device the plan may use (parameters, gradients,
            optimizer states, saved activations); None means unbounded.
        fixed: output placements the plan must use for some parameters (by FQN),
            user inputs or operators (by node name), e.g. a Megatron layout with
            sequence parallelism; the rest is optimised.
        activation_copies: micro-batches whose saved activations are alive at
            once (a pipeline stage's in-flight count); the memory constraint and
            the reported ``activations`` count them that many times.
        strategies: the nodes' strategies on this mesh if already enumerated
            (:func:`planner.ilp.strategies.build_strategies`; not modified).

    Raises:
        MemoryInfeasibleError: no assignment fits ``memory_budget``; it carries the
            least memory per device that would.
        FixedPlacementError: a fixed placement is not one DTensor can use here.
    """
    prepared = prepare_intra_op(graph, cluster, mesh_shape, dtype=dtype, optimizer=optimizer,
                                fixed=fixed, activation_copies=activation_copies,
                                strategies=strategies)
    return solve_prepared(prepared, memory_budget=memory_budget, time_limit_s=time_limit_s,
                          recompute=recompute)


@dataclass
class PreparedIntraOp:
    """A priced assignment problem, ready to solve under any memory budget."""

    graph: Graph
    mesh_shape: tuple[int, ...]
    strategies: list[NodeStrategies]
    cost: IntraOpCost
    built: IntraOpProblem
    activation_copies: float

    @functools.cached_property
    def hints(self) -> dict[str, list[int]]:
        """:func:`warm_starts` of this problem, made once: every budget and
        memory weight it is solved under starts from them."""
        return warm_starts(self.graph, self.mesh_shape, self.strategies, self.built.members,
                           self.built.problem)


def prepare_intra_op(graph: Graph, cluster: Cluster, mesh_shape: Sequence[int], *,
                     dtype: str = "float32", optimizer: str = "adam",
                     fixed: Mapping[str, Placements] | None = None,
                     activation_copies: float = 1.0,
                     strategies: list[NodeStrategies] | None = None,
                     pricer: ReshardPricer | None = None,
                     zero_stage: int = 0,
                     step_share: float = 1.0, units_gathered: bool = True) -> PreparedIntraOp:
    """Strategies and the priced (tied) problem of :func:`solve_intra_op`, so that
    several budgets can be solved without pricing again. ``pricer``,
    ``zero_stage``, ``step_share``, ``units_gathered``: see
    :class:`IntraOpCost`."""
    mesh_shape = tuple(int(d) for d in mesh_shape)
    if strategies is None:
        strategies = build_strategies(graph, mesh_shape)
    strategies = list(strategies)
    if fixed:
        strategies = pin_fixed(strategies, fixed, mesh_shape)
    cost = IntraOpCost(graph, cluster, mesh_shape, dtype, optimizer, activation_copies, pricer,
                       zero_stage, step_share, units_gathered)
    return PreparedIntraOp(graph, mesh_shape, strategies, cost, build_problem(cost, strategies),
                           float(activation_copies))


def restrict(prepared: PreparedIntraOp, allowed: Sequence[Sequence[int]]) -> PreparedIntraOp:
    """``prepared`` with problem variable (tie class) ``c`` limited to the
    strategies ``allowed[c]`` (indices into its list). Costs, memory and
    checkpoint terms are sliced from the priced problem, not priced again, so
    evaluating a known assignment on it (one index per class) is cheap."""
    built, p = prepared.built, prepared.built.problem
    strategies = list(prepared.strategies)
    for c, members in enumerate(built.members):
        for v in members:
            ns = strategies[v]
            strategies[v] = NodeStrategies(ns.node, [ns.strategies[i] for i in allowed[c]],
                                           ns.fallback)

    def pick(values: Sequence[float], c: int) -> list[float]:
        return [values[i] for i in allowed[c]]

    problem = dataclasses.replace(
        p, node_costs=[pick(x, c) for c, x in enumerate(p.node_costs)],
        edges=[(u, v, [pick(m[i], v) for i in allowed[u]]) for u, v, m in p.edges],
        node_memory=None if p.node_memory is None else
        [pick(x, c) for c, x in enumerate(p.node_memory)],
        checkpoint_groups=[dataclasses.replace(
            g, saved=[pick(x, c) for x, c in zip(g.saved, g.nodes)],
            kept=[pick(x, c) for x, c in zip(g.kept, g.nodes)],
            recompute=[pick(x, c) for x, c in zip(g.recompute, g.nodes)])
            for g in p.checkpoint_groups])
    return dataclasses.replace(prepared, strategies=strategies, built=dataclasses.replace(
        built, problem=problem, loop_costs=[pick(x, c) for c, x in enumerate(built.loop_costs)]))


def _with_checkpointing(problem: AssignmentProblem) -> AssignmentProblem:
    """``problem`` with every checkpoint group checkpointed: each group's
    recompute seconds and memory change folded into its nodes' prices, and no
    decision left to the solver."""
    node_costs = [list(c) for c in problem.node_costs]
    node_memory = [list(m) for m in problem.node_memory] if problem.node_memory else None
    for g in problem.checkpoint_groups:
        for k, v in enumerate(g.nodes):
            node_costs[v] = [c + r for c, r in zip(node_costs[v], g.recompute[k])]
            if node_memory is not None:
                node_memory[v] = [m - s for m, s in zip(node_memory[v], g.net_freed(k))]
    return dataclasses.replace(problem, node_costs=node_costs, node_memory=node_memory,
                               checkpoint_groups=[])


def solve_prepared(prepared: PreparedIntraOp, *, memory_budget: float | None = None,
                   time_limit_s: float = 30.0, memory_weight: float = 0.0,
                   recompute: bool | None = None) -> IntraOpResult:
    """Solve a prepared problem under ``memory_budget`` (bytes per device),
    minimising seconds plus ``memory_weight`` (seconds per byte) x bytes per device.
    ``recompute``: None lets the solver choose which layers to checkpoint (the
    fastest choice that fits); True checkpoints every layer, False none.

    Raises:
        MemoryInfeasibleError: no assignment fits the budget.
    """
    problem = dataclasses.replace(prepared.built.problem, memory_budget=memory_budget,
                                  memory_weight=memory_weight)
    groups = problem.checkpoint_groups
    if recompute is not None:
        problem = (_with_checkpointing(problem) if recompute
                   else dataclasses.replace(problem, checkpoint_groups=[]))
    if memory_budget is not None and least_memory(problem) > memory_budget:
        raise MemoryInfeasibleError(least_memory(problem), memory_budget, prepared.mesh_shape)
    result, held = _solved(prepared, problem, problem, groups, recompute, time_limit_s)
    # the gathered parameter copies are an edge term the ILP's memory row leaves
    # out: where they take the answer over the budget, solve again with each
    # parameter's strategies charged the copies its readers' placements in the
    # last answer would gather (the term linearised there)
    for _ in range(_BUDGET_PASSES):
        if memory_budget is None or held <= memory_budget:
            return result
        charged = _charge_gathers(prepared, problem, result)
        if least_memory(charged) > memory_budget:
            raise MemoryInfeasibleError(least_memory(charged), memory_budget, prepared.mesh_shape)
        result, held = _solved(prepared, charged, problem, groups, recompute, time_limit_s)
    if memory_budget is not None and held > memory_budget:
        raise MemoryInfeasibleError(held, memory_budget, prepared.mesh_shape)
    return result


#: solves again with the gathered copies charged, at most
_BUDGET_PASSES = 2


def _charge_gathers(prepared: PreparedIntraOp, problem: AssignmentProblem,
                    last: IntraOpResult) -> AssignmentProblem:
    """``problem`` with every parameter strategy's memory charged the copies
    its readers would gather under their strategies in ``last``
    (:meth:`IntraOpCost.parameter_gathers`), per micro-batch in flight."""
    cost, built = prepared.cost, prepared.built
    node_memory = [list(m) for m in problem.node_memory]
    for c, group in enumerate(built.members):
        first = prepared.strategies[group[0]]
        if first.node.kind != PARAM:
            continue
        for i in range(len(node_memory[c])):
            node_memory[c][i] += prepared.activation_copies * sum(
                cost.parameter_gathers(prepared.strategies[m].node, prepared.strategies[m].strategies[i],
                                       last.chosen, last.checkpointed) for m in group)
    return dataclasses.replace(problem, node_memory=node_memory)


def _solved(prepared: PreparedIntraOp, problem: AssignmentProblem, counted: AssignmentProblem,
            groups: list[CheckpointGroup], recompute: bool | None,
            time_limit_s: float) -> tuple[IntraOpResult, float]:
    """The solution of ``problem`` (:func:`solve_prepared`), and the bytes per
    device it holds as the budget counts them (``counted``'s memory row, the
    problem before any charge) with the gathered parameter copies
    (:meth:`IntraOpCost.gathered_parameter_bytes`)."""
    graph, mesh_shape, strategies = prepared.graph, prepared.mesh_shape, prepared.strategies
    cost, built, activation_copies = prepared.cost, prepared.built, prepared.activation_copies
    hint: Hint = [0] * len(problem.node_costs)  # one assignment (e.g. re-pricing)
    if not all(len(c) == 1 for c in problem.node_costs):
        # made only where a MIP runs: the LP relaxation is integral on almost
        # every problem (242 of 244 in a llama3-8b search)
        hint = functools.partial(_best_hint, prepared, problem)
    solution = solve(problem, time_limit_s=time_limit_s, hint=hint)
    choice = built.expand(solution.choice)
    chosen = {ns.node.name: ns.strategies[i] for ns, i in zip(strategies, choice)}
    breakdown = CostBreakdown()
    memory: dict[str, float] = {}
    once = 0.0  # once-per-step seconds, weighed by step_share in the objective
    for ns, i in zip(strategies, choice):
        prices = cost.prices(ns.node, ns.strategies[i])
        breakdown.compute_s += prices.compute_s
        breakdown.communication_s += prices.collectives_s
        if ns.node.kind == PARAM:
            once += prices.compute_s + prices.collectives_s
        for k, v in prices.memory.items():
            memory[k] = memory.get(k, 0.0) + v * (activation_copies if k == "activations" else 1)
    for u, v, m in problem.edges:
        breakdown.resharding_s += m[solution.choice[u]][solution.choice[v]]
    for c, loop in enumerate(built.loop_costs):
        breakdown.resharding_s += loop[solution.choice[c]]
    checkpointed: list[str] = []
    decided = solution.checkpoint if recompute is None else [recompute] * len(groups)
    for group, layers_of, again, on in zip(groups, built.checkpoint_layers,
                                           built.recomputed_fraction, decided):
        if on:
            checkpointed += layers_of
            chosen_of = [solution.choice[c] for c in group.nodes]
            breakdown.compute_s += sum(r[i] for r, i in zip(group.recompute, chosen_of))
            freed = sum(m[i] for m, i in zip(group.saved, chosen_of))
            kept = sum(m[i] for m, i in zip(group.kept, chosen_of))
            # the layer being recomputed, alive again: reported apart (it peaks
            # after the backward transient of the loss, not with it)
            layer = freed * again / (1.0 - again) if again < 1.0 else 0.0
            memory["activations"] += kept - freed - layer
            memory["recomputed_layer"] = memory.get("recomputed_layer", 0.0) + layer
    weighed = breakdown.total_s - (1.0 - cost.step_share) * once
    assert math.isclose(weighed, solution.objective_s, rel_tol=1e-6, abs_tol=1e-12), (
        breakdown, solution.objective_s, solution.status, checkpointed)
    # a memory-weighted solve is a layer profile's point, which the search
    # prices stages from; the stages it picks are solved again under their
    # budget, where the copies count (the profiles re-price each other's
    # assignments, so that copies FSDP2 would free do not steer its families)
    gathered = (cost.gathered_parameter_bytes(chosen, checkpointed) * activation_copies
                if problem.memory_weight == 0 else 0.0)
    if gathered:
        memory["activations"] = memory.get("activations", 0.0) + gathered
    held = (counted.memory(solution.choice, solution.checkpoint) + gathered
            if counted.memory_budget is not None and counted.node_memory is not None else 0.0)
    return IntraOpResult(graph, mesh_shape, strategies, chosen, solution, breakdown, time_limit_s,
                         memory, checkpointed, cost.step_share), held
