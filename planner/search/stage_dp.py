"""Inter-op pass: cut the layers into pipeline stages, price them, pick the best pipeline.

Units: seconds (times), bytes (memory), counts otherwise.

The search follows Alpa's inter-op pass, with stages on equal sub-meshes (the
world mesh is ``[pp] + stage mesh``, which is what the code generator runs):

* The outer loop enumerates the pipeline degree ``pp`` (whose sub-mesh is part
  of one node, ``(1, 2^k)``, or whole nodes, ``(n, devices per node)``), the
  logical stage mesh (1-D, or ``(d / t, t)`` with the ``t``-sized axis inside a
  node), the number of micro-batches and the schedule (GPipe, 1F1B,
  interleaved 1F1B, interleaved zero-bubble, ZBV, DualPipeV).
* Per layer *kind* (layers with the same structure), the intra-op ILP prices
  one layer at a few memory budgets (:class:`LayerProfile`: forward, backward
  and gradient-sync seconds with parameter-state and activation bytes).
* :func:`split_layers` is Alpa's dynamic program: for each candidate
  max-stage-time ``t_max`` (distinct stage times, ascending), the least total
  stage time over contiguous cuts with every stage at most ``t_max`` and within
  memory (a stage keeps its schedule's in-flight micro-batches of activations),
  minimising ``sum(t) + (m - 1) t_max``; the smallest feasible ``t_max`` is found
  by bisection (feasibility grows with it) and enumeration stops when the least
  possible sum plus ``(m - 1) t_max`` exceeds the best.
* The best candidates are timed with the schedule simulation
  (costmodel.schedules.simulate, torch's own action orders) and the winner's
  stages are solved exactly by the intra-op ILP on each stage's sub-graph.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

import numpy as np

from costmodel.cluster import Cluster
from costmodel.compute import compiled_call_seconds, host_seconds, pass_seconds
from costmodel.resharding import ReshardPricer
from costmodel.schedules import ScheduleBook, peak_activations
from costmodel.strategy_cost import IntraOpCost
from ir.graph import INPUT, OP, PARAM, Graph
from ir.layers import PipelineLayer
from ir.strategy import moved_arguments
from planner.ilp.intra_op import IntraOpResult
from planner.search.stage_times import ZERO_TIMES, StageTimes

# Schedules the search tries, in this order (ties keep the earlier one).
SEARCH_SCHEDULES = ("1f1b", "gpipe", "interleaved_1f1b", "interleaved_zero_bubble", "zbv",
                    "dualpipev")


class PipelineInfeasibleError(RuntimeError):
    """No pipeline configuration fits in memory."""


def step_collectives(result: IntraOpResult, cost: IntraOpCost) -> float:
    """Seconds of the collectives in ``result``'s communication that run once
    per step, not per micro-batch: the reduction of the parameters' gradients
    and (under ZeRO) gathering of the parameters over mesh axis 0, as the ILP
    priced them (:meth:`IntraOpCost.state_collectives`, without
    the stage's one per-message latency)."""
    return sum(cost.state_collectives(n, result.chosen[n.name])
               for n in result.graph.nodes if n.kind == PARAM)


def stage_times(result: IntraOpResult, cluster: Cluster, dtype: str, optimizer: str,
                zero_stage: int = 0, pricer: ReshardPricer | None = None,
                cost: IntraOpCost | None = None) -> StageTimes:
    """Split an intra-op solution's step into the parts a pipeline schedules apart.

    Forward compute and forward reshards (including gathering sharded
    parameters) run per micro-batch in the forward; input-gradient compute,
    gradient collectives, gradient reshards (of activations and of
    parameters gathered for an op: :meth:`IntraOpCost.gradient_reshard`) and
    recomputation in the backward; weight-gradient compute in the weight
    backward; once per step, the reduction of the parameters' gradients over
    mesh axis 0 (and under ZeRO, ``zero_stage``, the parameters' all-gather;
    see :class:`IntraOpCost`); per micro-batch after the first, adding its
    parameter gradients to the step's. ``pricer``: the
    :class:`ReshardPricer` of this mesh to share (its prices are memoised).
    ``cost``: the :class:`IntraOpCost` the result was solved with, to share
    (its node prices are kept; it prices as these arguments would).
    """
    graph, chosen = result.graph, result.chosen
    if cost is None:
        cost = IntraOpCost(graph, cluster, result.mesh_shape, dtype, optimizer,
                           zero_stage=zero_stage, pricer=pricer)
    f = b = w = update = accumulate = 0.0
    zero_bytes = 0.0  # bytes of the parameters ZeRO's collectives move
    layer_bytes = 0.0  # of which ZeRO-3 gathers layer by layer
    for n in graph.nodes:
        s = chosen[n.name]
        if n.kind == INPUT:
            f += cost.prices(n, s).compute_s
        if n.kind == PARAM:
            nbytes = cost.zero_bytes(n, s)
            zero_bytes += nbytes
            if n.name not in cost.pass_params:
                layer_bytes += nbytes
            update += cost.prices(n, s).compute_s  # optimizer update and casts, once a step
            accumulate += cost.accumulate_time(n, s)
        if n.kind != OP:
            continue
        prices = cost.prices(n, s)
        f += prices.forward_s
        bi, bw = prices.backward_s
        b += bi + prices.collectives_s
        w += bw
        for k, arg, idx, src, dst in moved_arguments(n, s, chosen):
            info = n.inputs[k] if n.inputs else graph[arg].outputs[idx]
            f += cost.reshard(src, dst, info)
            if arg in cost.requires_grad and info.is_float:
                # in each micro-batch's backward, as DTensor's backward of the move runs
                b += cost.gradient_reshard(src, dst, info, arg in cost.param_derived)
    # the objective weighs the once-per-step seconds by step_share (IntraOpCost)
    once = step_collectives(result, cost) + update
    recompute = result.solution.objective_s - (f + b + w + result.step_share * once)
    b += max(0.0, recompute)  # checkpointed layers re-run their forward in backward
    # a pass takes at least the host's time to issue its ops and call its
    # compiled regions (costmodel.compute)
    host_f, host_b = host_seconds(graph, cluster.device)
    call_f, call_b = compiled_call_seconds(graph, cluster.device,
                                           cost.region_calls(result.checkpointed))
    f = pass_seconds(f, host_f, call_f, cluster.device)
    b = pass_seconds(b, host_b - w, call_b, cluster.device)
    sync = 0.0  # the stage's once-per-step collectives over mesh axis 0
    if cost.zero_stage == 3:
        # FSDP2 layer by layer, in every micro-batch: each layer's collectives
        # overlap the compute of its neighbours where the backend runs them
        # beside compute, and add to it where it does not
        gather_f, gather_b = cost.zero3_layer_collectives(zero_bytes, layer_bytes)
        if cluster.overlaps_collectives:
            f, b = max(f, gather_f), max(b, gather_b)
        else:
            f, b = f + gather_f, b + gather_b
    else:
        sync = cost.zero_collectives(zero_bytes)  # one pair of collectives for the stage
    if cluster.device.compiled:
        # a compiled stage's backward is one graph, whose weight gradients come
        # with its input gradients (codegen.pipeline._weight_pass_done)
        b, w = b + w, 0.0
    memory = result.memory
    activations = memory.get("activations", 0.0)
    transient = memory.get("backward_transient", 0.0)
    state = sum(v for k, v in memory.items() if k not in ("activations", "backward_transient"))
    return StageTimes(f, b, w, sync, state, activations, update, accumulate, transient,
                      weight_groups=graph.weight_groups)


def layer_signature(graph: Graph, layer: PipelineLayer) -> str:
    """Structural hash of a layer: equal for layers that compute the same thing on
    tensors of the same shapes (their ILP solutions are interchangeable)."""
    pos = {name: i for i, name in enumerate(layer.ops)}
    records = []
    for name in layer.ops:
        n = graph[name]
        args = [["in", pos[a]] if a in pos else ["ext", graph[a].kind,
                                                   [o.to_json() for o in graph[a].outputs]]
                for a in n.args]
        records.append([n.target, n.arg_index, args, [o.to_json() for o in n.outputs]])
    return hashlib.sha256(json.dumps(records).encode()).hexdigest()[:16]


@dataclass
class LayerProfile:
    """Pareto points (time, memory) of one layer kind on one stage mesh, from the
    intra-op ILP with memory priced at increasing weights; ``points[0]`` is the
    fastest, later points use less memory (sharded states, checkpointing)."""

    points: list[StageTimes]
    prepared: Any = field(default=None, repr=False)  # the priced problem every level solves
    exhausted: bool = False  # no smaller-memory point exists
    assignments: list = field(default_factory=list, repr=False)  # chosen strategies per point
    # seconds per byte of memory each point's ILP added to its objective
    weights: list[float] = field(default_factory=list)
    # (memory, memory) of neighbouring points with no supported point between them
    closed: set = field(default_factory=set, repr=False)
    mesh: Any = None  # the StageMeshOption its own ILPs run on (None: re-priced)
    # (micro-batch size, layer) whose sub-graph its own ILPs price (None: re-priced)
    origin: tuple[int, int] | None = None

    def point(self, level: int) -> StageTimes:
        return self.points[min(level, len(self.points) - 1)]


def mesh_family(mesh_key: tuple) -> tuple:
    """The family of the stage mesh with :attr:`StageMeshOption.key`
    ``mesh_key``: the meshes whose layer placements carry over to each other
    (a layer profile of one re-prices at another) have the same number of
    axes, the same inner (in-node, tensor-parallel) axis size, the same
    ZeRO stage. Searches of different families share
    no profile."""
    shape = mesh_key[0]
    return (len(shape), shape[-1] if len(shape) > 1 else 0, *mesh_key[1:])


@dataclass
class StageMeshOption:
    """A stage sub-mesh: ``nodes x devices_per_node`` physical devices viewed as
    the logical ``shape``."""

    shape: tuple[int, ...]
    num_nodes: int
    devices_per_node: int
    # ZeRO over mesh axis 0 (see costmodel.strategy_cost.IntraOpCost): 0, 2 or 3
    # (FSDP2, parameters replicated on axis 0) or 1 (Megatron's distributed
    # optimizer, priced for its baselines only)
    zero_stage: int = 0

    @property
    def key(self) -> tuple:
        """What the stage's problems depend on besides its layers: shape and
        ZeRO stage."""
        return self.shape, self.zero_stage

    @property
    def family(self) -> tuple:
        """:func:`mesh_family` of this mesh."""
        return mesh_family(self.key)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def cluster(self, cluster: Cluster) -> Cluster:
        return cluster.sub_cluster(self.num_nodes, self.devices_per_node)


# The schedule name of a one-stage candidate (no pipeline).
NO_PIPELINE = "none"

# The schedule of one stage's micro-batches (a pipeline of one stage: the
# forward and backward of each in turn, gradients accumulated), and of a
# one-stage ZeRO plan of the whole batch (one such micro-batch).
ACCUMULATING_SCHEDULE = "1f1b"


def config_label(pp: int, v: int, mesh: StageMeshOption, schedule: str, m: int) -> str:
    """A pipeline configuration in words, e.g. ``pp=4 v=1 stage mesh 8x2 ZeRO-3 1f1b m=32``."""
    zero = f" ZeRO-{mesh.zero_stage}" if mesh.zero_stage else ""
    return f"pp={pp} v={v} stage mesh {'x'.join(map(str, mesh.shape))}{zero} {schedule} m={m}"


def stage_mesh_options(cluster: Cluster, pp: int) -> list[StageMeshOption]:
    """Logical meshes of a stage when the cluster is cut into ``pp`` equal
    sub-meshes (Alpa's sub-mesh shapes: part of one node, or whole nodes).
    Empty when ``pp`` does not cut the cluster that way."""
    n = cluster.num_devices
    if n % pp:
        return []
    size = n // pp
    dpn = cluster.devices_per_node
    if size <= dpn:
        if dpn % size:
            return []
        nodes, per_node = 1, size
    elif size % dpn == 0:
        nodes, per_node = size // dpn, dpn
    else:
        return []
    shapes: list[tuple[int, ...]] = [(size,)]
    t = 2
    while t < size and t <= per_node:
        if size % t == 0 and per_node % t == 0:
            shapes.append((size // t, t))
        t *= 2
    return [StageMeshOption(s, nodes, per_node) for s in shapes]


@dataclass
class SplitResult:
    """Alpa DP answer: ``bounds[s] = (first layer, end layer)`` of stage s, its
    memory ``level``, stage times per micro-batch, and the DP objective
    ``sum(t) + (m - 1) max(t)`` (seconds)."""

    bounds: list[tuple[int, int]]
    levels: list[int]
    times: list[StageTimes]
    objective_s: float


def split_layers(layer_times: Callable[[int, int], StageTimes], num_layers: int,
                 num_stages: int, num_microbatches: int, copies: Sequence[float],
                 budget: float, levels: int = 1) -> SplitResult | None:
    """Alpa's stage DP over contiguous layer ranges (equal sub-meshes).

    Args:
        layer_times: ``(layer, level) -> StageTimes`` of one layer at memory
            level ``level`` (0 = fastest); a stage's times are the sum over its layers.
        num_stages: stages to cut into (each at least one layer).
        num_microbatches: ``m`` in the objective ``sum(t) + (m - 1) t_max``.
        copies: in-flight micro-batches of activations kept by each stage.
        budget: bytes per device each stage may use.
        levels: memory levels a stage may choose from (all its layers use one).

    Returns:
        The best cut, or None when no cut fits in memory.

    Every candidate bound ``t_max`` on the slowest stage (the seconds of
    some stage's range) is tried from the least feasible one up, each by
    :func:`_least_sum`, until ``least sum + (m - 1) t_max`` cannot beat the
    best objective found.
    """
    L, S, m = num_layers, num_stages, num_microbatches
    if S > L:
        return None
    layers = [[layer_times(i, lv) for i in range(L)] for lv in range(levels)]
    prefix = _prefix_times(layers)
    cost, level, distinct = _stage_costs(layers, prefix, S, copies, budget)
    candidates, allowed = _stage_bounds(cost, L, S, distinct)
    lo = _least_feasible(allowed, candidates)
    if lo == len(candidates):
        return None
    least_sum = _least_sum(allowed, math.inf)[0]  # no cut has a smaller sum of stage times
    best: SplitResult | None = None
    for t_max in candidates[lo:]:
        if best is not None and least_sum + (m - 1) * t_max >= best.objective_s:
            break
        found = _least_sum(allowed, t_max)
        if found is None:
            continue
        total, nxt = found
        objective = total + (m - 1) * t_max
        if best is None or objective < best.objective_s - 1e-15:
            best = _split_result(prefix, layers, level, nxt, objective)
    return best


def _prefix_times(layers: list[list[StageTimes]]) -> list[list[StageTimes]]:
    """``prefix[lv][i]``: the StageTimes of layers ``0 .. i - 1`` at level
    ``lv`` (``layers[lv]``), summed in layer order."""
    prefix = [[ZERO_TIMES] for _ in layers]
    for lv, row in enumerate(layers):
        for t in row:
            prefix[lv].append(prefix[lv][-1] + t)
    return prefix


def _stage_costs(layers: list[list[StageTimes]], prefix: list[list[StageTimes]],
                 num_stages: int, copies: Sequence[float],
                 budget: float) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """``(cost, level, distinct)``, the first two each ``num_stages x (L + 1)
    x (L + 1)``, from each layer's times (``layers[lv][k]``) and their prefix sums:
    ``cost[s, i, j]`` the seconds of layers ``[i, j)`` as stage ``s`` at its
    fastest level that fits ``budget`` bytes with its in-flight ``copies``
    (inf when none fits, or ``j <= i``), ``level[s, i, j]`` that level;
    ``distinct`` the first stage of each count of in-flight copies (the
    others have its costs), ascending."""
    levels, L = len(prefix), len(prefix[0]) - 1
    # per level, seconds and bytes of every range [i, j) as (L + 1) x (L + 1) arrays
    p = np.array([[t._values() for t in row] for row in prefix])  # levels x (L+1) x 6
    d = p[:, None, :, :] - p[:, :, None, :]  # [lv, i, j] = prefix[j] - prefix[i]
    seconds = d[..., 0] + d[..., 1] + d[..., 2]
    # the bytes each range's stage sums itself (layer by layer from i, as
    # StageTimes adds them), not a difference of prefix sums, whose rounding
    # would decide a stage exactly at the budget otherwise than the stage does
    layer = np.array([[t._values() for t in row] for row in layers])  # levels x L x 6
    # row i holds layer j's bytes at j >= i and exact zeros before, so its
    # running sum (sequential, as np.cumsum adds) is layers i..j summed from
    # i: adding 0.0 first changes no bit
    upper = np.triu(np.ones((L, L), dtype=bool))
    state, activations = np.zeros_like(d[..., 4]), np.zeros_like(d[..., 5])
    state[:, :L, 1:] = np.cumsum(np.where(upper, layer[:, None, :, 4], 0.0), axis=2)
    activations[:, :L, 1:] = np.cumsum(np.where(upper, layer[:, None, :, 5], 0.0), axis=2)
    # the largest transient of layers i..j (transients are never negative)
    transient = np.zeros_like(state)
    transient[:, :L, 1:] = np.maximum.accumulate(
        np.where(upper, _transients(layers)[:, None, :], 0.0), axis=2)
    ranges = _ranges(L)[2]
    cost = np.full((num_stages, L + 1, L + 1), math.inf)
    level = np.zeros((num_stages, L + 1, L + 1), dtype=np.int64)
    done: dict[float, int] = {}  # in-flight copies -> the first stage priced with them
    for s in range(num_stages):
        same = done.setdefault(float(copies[s]), s)
        if same != s:  # the same copies, the same costs
            cost[s], level[s] = cost[same], level[same]
            continue
        open_ = ranges.copy()
        for lv in range(levels):
            fits = open_ & (state[lv] + copies[s] * activations[lv] + transient[lv] <= budget)
            cost[s][fits] = seconds[lv][fits]
            level[s][fits] = lv
            open_ &= ~fits
    return cost, level, sorted(set(done.values()))


def _transients(layers: list[list[StageTimes]]) -> np.ndarray:
    """``levels x L``: each layer's ``transient_bytes`` at each level."""
    return np.array([[t.transient_bytes for t in row] for row in layers])


def _ranges(num_layers: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(ii, jj, ranges)``: the first and end layer of every ``[i, j)`` as
    ``(L + 1) x (L + 1)`` index grids, and where ``j > i``."""
    ii, jj = np.meshgrid(np.arange(num_layers + 1), np.arange(num_layers + 1), indexing="ij")
    return ii, jj, jj > ii


def _stage_bounds(cost: np.ndarray, num_layers: int, num_stages: int, distinct: list[int]
                  ) -> tuple[list[float], np.ndarray]:
    """The candidate bounds on the slowest stage (every finite seconds a
    stage's range may take, ascending) and each stage's costs over the
    ranges it may take while every stage before and after it gets a layer:
    ``band[s, a, b]`` the seconds of layers ``[s + a, s + b + 1)`` as stage
    ``s`` (inf where ``b < a``), each ``S x W x W`` with ``W = L - S + 1``
    (the first layers stage ``s`` may start at, and the ends it may take).
    No cut from layer 0 reaches another range, so the DP reads no other.
    ``distinct``: stages whose costs every other stage's equal."""
    L, S = num_layers, num_stages
    ii, jj, ranges = _ranges(L)
    # a stage may not take so many layers that a later stage gets none
    # stages of equal in-flight copies have equal costs: each set once
    candidates = np.unique(cost[distinct][:, ranges & (jj - ii <= L - S + 1)])
    candidates = candidates[np.isfinite(candidates)].tolist()
    # stage s may start at s <= i <= L - (S - s) and end at i < j <= L - (S - s - 1)
    W = L - S + 1
    a, b = np.arange(W)[:, None], np.arange(W)[None, :]
    s = np.arange(S)[:, None, None]
    band = cost[s, s + a, s + 1 + b]
    return candidates, np.where(b >= a, band, math.inf)


def _least_sum(band: np.ndarray, t_max: float) -> tuple[float, list[np.ndarray]] | None:
    """Least sum of stage times with every stage at most ``t_max`` seconds
    (``band``: each stage's costs over the ranges it may take,
    :func:`_stage_bounds`), and per stage the end layer it takes from each
    first layer it may start at (indexed by first layer; 0 elsewhere);
    None when no cut keeps every stage within ``t_max``."""
    S, W = band.shape[0], band.shape[1]
    L = S + W - 1
    # g[a]: least sum of stage times for layers s + 1 + a .. in stages s + 1 ..
    # (each <= t_max); after the last stage only layer L (nothing left) ends a cut
    g = np.full(W, math.inf)
    g[W - 1] = 0.0
    nxt = []
    rows = np.arange(W)
    # every stage's costs within t_max at once
    within = np.where(band <= t_max, band, math.inf)
    for s in range(S - 1, -1, -1):
        total = within[s] + g[None, :]
        j = np.argmin(total, axis=1)  # the first (smallest) end layer on ties
        g = total[rows, j]
        ends = np.zeros(L + 1, dtype=np.int64)
        ends[s:s + W] = j + s + 1
        nxt.append(ends)
    if not np.isfinite(g[0]):
        return None
    return float(g[0]), nxt[::-1]


def _least_feasible(allowed: np.ndarray, candidates: list[float]) -> int:
    """The index of the least of ``candidates`` some cut keeps every stage
    within (``len(candidates)`` when none): feasibility only grows with
    ``t_max``, so the infeasible ones are skipped by bisection."""
    lo, hi = 0, len(candidates)
    while lo < hi:
        mid = (lo + hi) // 2
        if _least_sum(allowed, candidates[mid]) is None:
            lo = mid + 1
        else:
            hi = mid
    return lo


def _split_result(prefix: list[list[StageTimes]], layers: list[list[StageTimes]],
                  level: np.ndarray, nxt: list[np.ndarray], objective: float) -> SplitResult:
    """The cut :func:`_least_sum` chose (``nxt``), from layer 0 on, with
    each stage's level and times (the sums of its layers', ``prefix``, and
    the largest of their transients, ``layers``)."""
    bounds, i = [], 0
    for s in range(len(nxt)):
        j = int(nxt[s][i])
        bounds.append((i, j))
        i = j
    lv = [int(level[s, a, b]) for s, (a, b) in enumerate(bounds)]
    times = [replace(prefix[l][b] - prefix[l][a], transient_bytes=max(
        t.transient_bytes for t in layers[l][a:b])) for l, (a, b) in zip(lv, bounds)]
    return SplitResult(bounds, lv, times, objective)


def in_flight(schedule: str, pp: int, m: int, v: int,
              book: ScheduleBook | None = None) -> list[float]:
    """Micro-batches of activations each stage keeps alive at the schedule's
    peak (a rank's peak shared evenly among its ``v`` stages), by stage.
    ``book``: the search's schedule orders (:class:`costmodel.schedules.ScheduleBook`)."""
    peaks, stage_to_rank = peak_activations(schedule, pp, m, v, book=book)
    return [max(1.0, peaks[stage_to_rank[s]] / v) for s in range(pp * v)]


def exhaustive_split(layer_times: Callable[[int, int], StageTimes], num_layers: int,
                     num_stages: int, num_microbatches: int, copies: Sequence[float],
                     budget: float, levels: int = 1) -> SplitResult | None:
    """Every contiguous cut and memory level, for checking :func:`split_layers`."""
    import itertools

    best: SplitResult | None = None
    for cuts in itertools.combinations(range(1, num_layers), num_stages - 1):
        bounds = list(zip((0, *cuts), (*cuts, num_layers)))
        times, lvls = [], []
        for s, (a, b) in enumerate(bounds):
            found = None
            for lv in range(levels):
                t = ZERO_TIMES
                for i in range(a, b):
                    t = t + layer_times(i, lv)
                if t.memory(copies[s]) <= budget:
                    found = (t, lv)
                    break
            if found is None:
                break
            times.append(found[0])
            lvls.append(found[1])
        else:
            stage_s = [t.microbatch_s for t in times]
            objective = sum(stage_s) + (num_microbatches - 1) * max(stage_s)
            if best is None or objective < best.objective_s - 1e-15:
                best = SplitResult(bounds, lvls, times, objective)
    return best


@dataclass
class PipelineCandidate:
    """One priced pipeline configuration."""

    pp: int
    stages_per_rank: int
    mesh: StageMeshOption
    schedule: str
    num_microbatches: int
    split: SplitResult
    step_time_s: float
    bubble_s: float
    p2p_s: float
    details: dict[str, Any] = field(default_factory=dict)

    def label(self) -> str:
        return config_label(self.pp, self.stages_per_rank, self.mesh, self.schedule,
                            self.num_microbatches)
