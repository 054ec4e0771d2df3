"""Context parallelism (cp): one definition of how it is priced, for the
Megatron baseline (:mod:`planner.baselines.megatron`) and the automatic search
(:func:`planner.api.plan`).

Each sequence is cut into 2 cp chunks and rank i of a cp group holds chunks i
and 2 cp - 1 - i (causal load balancing). The program priced is one cp rank's:
the example inputs' sequences cut into cp rows of s / cp tokens
(:func:`context_parallel_inputs`), whose batch rows the data-parallel axis
splits (Megatron: the dp x cp axis of its stage mesh; the automatic search:
axis 0 of the stage mesh, :func:`layout_allows`, :func:`pinned_strategies`).
That program is exact for every op that works token by token and for the
saved activations; what it lacks is attention across chunks, added per
attention op and micro-batch by :func:`context_parallel_seconds`, with the
K/V buffers that exchange holds (:func:`kv_buffer_bound`).

Units: seconds, bytes.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import torch
from torch.distributed.tensor.placement_types import Shard

from costmodel.cluster import Cluster, Link
from costmodel.collectives import axis_links, collective_time
from costmodel.compute import FUSED_ATTENTION
from costmodel.strategy_cost import IntraOpCost
from ir.graph import Graph
from ir.strategy import local_numel
from planner.ilp.intra_op import IntraOpResult
from planner.megatron_layout import CP_COMM_TYPES
from plan.cp_rules import carries_rows, kv_head_repeats, local_kv_repeats
from planner.request import PlanningError

__all__ = ["CP_COMM_TYPES", "CP_MIN_CHUNK", "CP_MIN_SEQ", "context_parallel_inputs",
           "context_parallel_record", "context_parallel_seconds", "cp_link", "kv_block_bytes",
           "kv_buffer_bound", "layout_allows", "pinned_strategies", "search_sizes",
           "sequence_length"]

#: Sequence length from which the automatic search also tries cp > 1 (shorter
#: sequences try it only when no plan without it fits).
CP_MIN_SEQ = 32768
#: Fewest tokens of a sequence per cp rank (s / cp) the automatic search tries
#: at long sequences: below it the exchange's hops no longer hide behind one
#: attention step and the search would only add configurations to price.
CP_MIN_CHUNK = 8192


def sequence_length(example_inputs: Sequence[Any]) -> int | None:
    """The one sequence length (dim 1) of ``[batch, seq, ...]`` example inputs,
    or None where they have none or several."""
    seqs = {t.shape[1] for t in example_inputs if isinstance(t, torch.Tensor) and t.dim() >= 2}
    if len(seqs) != 1 or any(isinstance(t, torch.Tensor) and t.dim() < 2
                             for t in example_inputs):
        return None
    return int(next(iter(seqs)))


def context_parallel_inputs(example_inputs: Sequence[Any], cp: int) -> tuple:
    """The example inputs of one context-parallel rank's program: every tensor
    ``[batch, seq, ...]`` of the whole-batch inputs as ``[batch x cp, seq / cp,
    ...]`` (each sequence's tokens cut into cp rows: a rank's s / cp tokens, the
    rows of one sequence spread over the cp ranks by the data-parallel axis).
    Which chunks a rank holds (i and 2 cp - 1 - i) changes no shape, so the
    cut is contiguous here; positions and masks are the runtime's business.

    Raises:
        PlanningError: an input has no sequence dimension, or the sequences
            differ in length or do not split into 2 cp chunks.
    """
    seq = sequence_length(example_inputs)
    if seq is None:
        raise PlanningError(f"context parallelism needs [batch, seq, ...] inputs of one sequence "
                            f"length, got shapes {[tuple(getattr(t, 'shape', ())) for t in example_inputs]}")
    if seq % (2 * cp):
        raise PlanningError(f"context_parallel_size={cp} cuts each sequence into 2 x cp = {2 * cp} "
                            f"chunks (causal load balancing); the sequence length {seq} does not "
                            f"divide into them")
    return tuple(t.reshape(t.shape[0] * cp, seq // cp, *t.shape[2:])
                 if isinstance(t, torch.Tensor) else t for t in example_inputs)


def context_parallel_record(cp: int, comm_type: str, example_inputs: Sequence[Any]
                            ) -> dict[str, Any]:
    """The plan's ``training["context_parallel"]``: cp, the exchange, and the
    whole sequences' input shapes (``training["input_shapes"]`` are one cp
    rank's program's)."""
    return {"size": cp, "comm_type": comm_type,
            "sequence_shapes": [list(t.shape) if isinstance(t, torch.Tensor) else None
                                for t in example_inputs]}


def cp_link(stage_cluster: Cluster, outer: int, cp: int, inner: int) -> Link:
    """The link a cp group's ring or all-gather runs over: on a stage whose
    devices are ordered (outer, cp, inner), inner fastest, the cp group is cp
    devices at stride ``inner`` (Megatron's tp-cp-dp order: outer = dp,
    inner = tp; the automatic search: axis 0 of the stage mesh is outer x cp,
    the other axes inner)."""
    return axis_links(stage_cluster, (outer, cp, inner))[1]


def kv_block_bytes(graph: Graph, node: Any, placements: Sequence[Any] | None,
                   mesh_shape: tuple[int, ...]) -> float:
    """Bytes per device of the K and V one attention op ``node`` reads, as its
    inputs are placed (``placements``: of q, k, v; None: split evenly over the
    ``mesh_shape`` devices, heads whole K/V heads), each K/V head counted once
    (:func:`local_kv_repeats`): the block a cp rank sends."""
    total = 0.0
    for k in (1, 2):
        info = node.inputs[k] if node.inputs else graph[node.args[k]].outputs[0]
        n_rep = kv_head_repeats(graph, node, k)
        if placements is None:
            local, copies = info.numel / math.prod(mesh_shape), n_rep
        else:
            local = local_numel(info, placements[k], mesh_shape)
            split = math.prod(size for p, size in zip(placements[k], mesh_shape)
                              if isinstance(p, Shard) and p.dim == 1)
            copies = local_kv_repeats(n_rep, info.shape[1] // split)
        total += local / copies * info.itemsize
    return total


def _held(kv: float, cp: int, comm_type: str) -> float:
    """K/V buffer bytes one attention op holds: p2p the block in use, the one
    arriving and their dK/dV (4 kv); all-gather the gathered K/V and dK/dV
    (2 cp kv)."""
    return 4 * kv if comm_type == "p2p" else 2 * cp * kv


def kv_buffer_bound(graph: Graph, cp: int, comm_type: str, mesh_shape: tuple[int, ...]) -> float:
    """The largest K/V buffers one attention op of ``graph`` holds under
    context parallelism, bytes per device, its inputs split evenly over the
    ``mesh_shape`` devices (Megatron's layout: rows over dp x cp, heads over
    tp); 0 without cp."""
    if cp == 1:
        return 0.0
    return max((_held(kv_block_bytes(graph, n, None, mesh_shape), cp, comm_type)
                for n in graph.nodes if n.target == FUSED_ATTENTION), default=0.0)


def context_parallel_seconds(result: IntraOpResult, cost: IntraOpCost, cp: int, comm_type: str,
                             link: Link) -> tuple[float, float, float]:
    """What attention across the cp chunks adds to one stage's micro-batch:
    ``(forward seconds, backward seconds, K/V buffer bytes per device)``.

    Per attention op (``t_f``, ``t_b``: the traced attention's forward and
    backward seconds, one ring step's work; ``kv``: the rank's K/V block,
    :func:`kv_block_bytes`; ``p2p``, ``ag``, ``rs``: :func:`collective_time`
    over the cp group on ``link``):

    * ``p2p``: forward (cp - 1) max(t_f, p2p(kv)); backward
      (cp - 1) max(t_b, 2 p2p(kv)) + p2p(kv) (K/V and dK/dV each step, the last
      dK/dV hop exposed); buffers 4 kv (two K/V blocks, two dK/dV blocks);
    * ``all_gather``: forward ag(cp kv) + (cp - 1) t_f; backward
      ag(cp kv) + (cp - 1) t_b + rs(cp kv); buffers 2 cp kv (K/V and dK/dV
      gathered);
    * a checkpointed layer's attention adds its forward seconds to the backward;
    * in a compiled program each attention runs eager between the compiled
      graphs (:mod:`codegen.lowered_program`): one more compiled call
      (``compiled_call_overhead``) in its forward.

    The buffers are the largest one attention op holds (ops run one at a time).
    """
    if cp == 1:
        return 0.0, 0.0, 0.0
    graph = result.graph
    recomputed = graph.layer_ops(result.checkpointed)
    device = cost.cluster.device
    graph_break = device.compiled_call_overhead if device.compiled else 0.0
    forward = backward = buffers = 0.0
    for n in graph.nodes:
        if n.target != FUSED_ATTENTION:
            continue
        s = result.chosen[n.name]
        prices = cost.prices(n, s)
        t_f, t_b = prices.forward_s, sum(prices.backward_s)
        kv = kv_block_bytes(graph, n, s.inputs, result.mesh_shape)
        if comm_type == "p2p":
            step = collective_time("p2p", kv, 2, link)
            f = (cp - 1) * max(t_f, step)
            b = (cp - 1) * max(t_b, 2 * step) + step
        else:
            gather = collective_time("all_gather", cp * kv, cp, link)
            f = gather + (cp - 1) * t_f
            b = gather + (cp - 1) * t_b + collective_time("reduce_scatter", cp * kv, cp, link)
        f += graph_break
        forward += f
        backward += b + (f if n.name in recomputed else 0.0)
        buffers = max(buffers, _held(kv, cp, comm_type))
    return forward, backward, buffers


# --- the automatic search's layout (planner.api, planner.search.context) ---

def search_sizes(requested: Sequence[int] | None, seq: int | None, num_devices: int,
                 fits_without: bool) -> list[int]:
    """The cp > 1 sizes the automatic search tries, ascending.

    ``requested`` (:attr:`planner.request.PlanRequest.context_parallel`) given:
    its sizes above 1, each checked (a power of two dividing the devices whose
    2 cp chunks cut the sequence). None (automatic): powers of two dividing
    the devices that cut the sequence into 2 cp chunks of s / cp >=
    :data:`CP_MIN_CHUNK` tokens, when ``seq`` >= :data:`CP_MIN_SEQ`; at
    shorter sequences only when no plan without cp fits (``fits_without``
    False), then every such power of two whose chunks cut the sequence.

    Raises:
        PlanningError: a requested size the devices or the sequence cannot take.
    """
    if requested is not None:
        out = sorted({int(c) for c in requested if int(c) > 1})
        for c in out:
            if c & (c - 1) or num_devices % c:
                raise PlanningError(f"context parallel size {c} must be a power of two dividing "
                                    f"the {num_devices} devices")
            if seq is None or seq % (2 * c):
                raise PlanningError(
                    f"context parallel size {c} cuts each sequence into 2 x {c} = {2 * c} chunks "
                    f"(causal load balancing); "
                    + ("the inputs have no [batch, seq] sequence dimension" if seq is None else
                       f"the sequence length {seq} does not divide into them"))
        return out
    if seq is None or (seq < CP_MIN_SEQ and fits_without):
        return []
    least = CP_MIN_CHUNK if seq >= CP_MIN_SEQ else 1
    out, c = [], 2
    while c <= num_devices:
        if num_devices % c == 0 and seq % (2 * c) == 0 and seq // c >= least:
            out.append(c)
        c *= 2
    return out


def layout_allows(cp: int, mesh_shape: Sequence[int], rows: int) -> bool:
    """Whether the automatic search can place a cp plan on a stage mesh of
    ``mesh_shape`` whose program holds ``rows`` batch rows (whole sequences
    x cp) per micro-batch: axis 0 must split the rows evenly and hold a
    multiple of cp ranks, so that each sequence's cp chunks lie on cp ranks
    of axis 0 (:func:`pinned_strategies`)."""
    return cp == 1 or (mesh_shape[0] % cp == 0 and rows % mesh_shape[0] == 0)


def pinned_strategies(strategies: list[Any], rows: int) -> list[Any]:
    """``strategies`` (:class:`planner.ilp.strategies.NodeStrategies` of a stage on
    a mesh :func:`layout_allows`) with the program's token rows kept split
    over axis 0: every value computed from the ``rows`` batch rows that still
    holds them (:func:`carries_rows`: the tokens, the targets, a stage's
    incoming activations and all that follows them token by token) takes
    ``S(0)`` on mesh axis 0, and every attention op's q, k and v too (the
    other axes stay the ILP's choice). The rows of one sequence are then on
    ranks of axis 0, the cp group being cp of them at the stride of the other
    axes (:func:`cp_link`), and the attention each rank runs is over its own
    s / cp tokens of its sequences, as :func:`context_parallel_seconds`
    assumes.

    Why every row-holding value and not only the inputs: each rank computes
    its own chunks' positions (:mod:`codegen.context_parallel`), so a value
    of the token rows replicated over axis 0 would be computed on each rank
    for every rank's rows with that rank's positions: right only for its own
    rows. Kept split, every row is computed by the rank that holds its
    positions. Reductions over the rows (the loss) are free to be partial or
    replicated. Which rows a rank holds (chunks i and 2 cp - 1 - i of a
    sequence on the i-th rank of its cp group) changes no shape and no
    price."""
    batch = Shard(0)
    carried: set[str] = set()
    out = []
    for ns in strategies:
        n = ns.node
        if n.target == FUSED_ATTENTION:
            keep = [s for s in ns.strategies if all(p[0] == batch for p in s.inputs[:3])
                    and s.outputs[0][0] == batch]
            carries_rows(n, rows, carried)
        elif carries_rows(n, rows, carried):
            keep = [s for s in ns.strategies if s.outputs[0][0] == batch]
        else:
            out.append(ns)
            continue
        out.append(dataclasses.replace(ns, strategies=keep) if keep else ns)
    return out
