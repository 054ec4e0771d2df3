"""Megatron-LM style manual plans, in the same Plan format as the automatic ones.

A Megatron practitioner fixes the parameter layout: inside each transformer layer
the linears that open a branch are column parallel (weight ``[out, in]`` sharded
on ``out``: ``S(0)``) and the ones that close it into the residual stream are row
parallel (``S(1)``); the token embedding and the output head are vocabulary
parallel; everything is replicated over the data-parallel axis, whose optimizer
states the distributed optimizer (ZeRO-1) shards. :func:`megatron_plan` fixes
exactly that layout and lets the intra-op ILP place the activations, so the
manual plan is priced by the same cost model and run by the same code generator.
Arguments use Megatron's names.

With ``pipeline_model_parallel_size`` > 1 the layers are split evenly over the
pipeline stages (Megatron's uniform split) and run by 1F1B, or interleaved 1F1B
with ``virtual_pipeline_model_parallel_size``, each stage on a (dp, tp) sub-mesh
with the same layout fixed.

With ``sequence_parallel`` the activations between the tensor-parallel
blocks (the residual stream and the layer-norm outputs, [batch, seq, hidden])
are also fixed, split on the sequence dimension over the tp axis (and on the
batch over dp); the ILP then prices the reduce-scatter that replaces the
row-parallel all-reduce and the all-gather before each column-parallel block,
and the activation memory those regions no longer replicate.

``recompute_granularity="full"`` (Megatron's ``--recompute-granularity full``
with one layer per checkpoint) checkpoints every transformer layer; without
it the intra-op ILP decides per layer kind whether to checkpoint, under the
memory budget. ``decoder_first_pipeline_num_layers`` and
``decoder_last_pipeline_num_layers`` give the first and last pipeline stages
their own layer counts, the others splitting the rest evenly.

Gradients: with the distributed optimizer they are reduce-scattered once per
step (ZeRO-1); without it Megatron's DDP accumulates them over the
micro-batches and all-reduces them once per step.

``expert_model_parallel_size`` (Megatron-Core's expert parallelism with expert
tensor parallel size 1, :mod:`planner.baselines.megatron_layout`) splits the expert
weights on their expert dimension over ep ranks of the dp x tp ones. Their
gradients then reduce over the expert-data-parallel ranks only: the cost
model all-reduces a parameter's gradient over a mesh axis only where the
parameter is replicated, and the expert weights are ``S(0)`` on the
expert-parallel axes. The distributed optimizer shards each parameter's
optimizer states, with the fp32 master copy, over the data-parallel ranks
holding it (dp for dense weights, dp x tp / ep for expert weights): the plans
count exactly that (:func:`_zero1_correction`), whatever the stage mesh's
ZeRO-1 axis is.

``context_parallel_size`` (cp; priced by :mod:`planner.search.cp_search`,
which the automatic search shares; Megatron's context parallelism with causal load
balancing: each sequence cut into 2 cp chunks, rank i of a cp group holding
chunks i and 2 cp - 1 - i) is priced as one cp rank runs it. The program
priced is the model on the rank's s / cp tokens of each sequence: the example
inputs' sequences cut into cp rows of s / cp tokens
(:func:`context_parallel_inputs`), on a stage mesh whose data-parallel axis
is dp x cp (:attr:`MegatronConfig.mesh_axes`). That is exact for every op
that works token by token (linears, norms, rotary embeddings, the loss: s / cp
tokens per rank), for the activation memory, and for the weights, replicated
over dp x cp: their gradients reduce over dp x cp and the distributed
optimizer shards over dp x cp, as Megatron's data-parallel group with cp
does. What the cut program lacks is attention across chunks, added per
attention op and micro-batch by :func:`context_parallel_seconds`:

* the traced attention (causal, over the rank's s / cp tokens) does
  (s / cp)^2 / 2 query-key pairs, exactly the work of one ring step under the
  load balancing (each step computes half a (s / cp) x (s / cp) block), and a
  rank does cp such steps in all (s^2 / (2 cp) pairs);
* ``cp_comm_type="p2p"`` (ring attention, Megatron's default): cp - 1 more
  steps forward, each max(attention step, p2p of the local K/V block) as the
  next block's transfer overlaps the current block's kernel; backward cp - 1
  steps of max(attention backward step, p2p of K/V and of dK/dV) and the last
  dK/dV hop exposed;
* ``cp_comm_type="all_gather"`` (Llama 3's): an exposed all-gather of K/V
  over the cp group before the attention and cp - 1 more steps of compute;
  backward the all-gather again, cp - 1 more steps and a reduce-scatter of
  dK/dV;
* a recomputed layer runs its forward exchange again in the backward.

The K/V block is the rank's K and V as the attention reads them before
grouped-query heads are repeated (what Megatron/TE send), over the cp
group's links (Megatron's rank order tp-cp-dp-pp: the cp group has stride tp,
so it leaves the node once tp x cp exceeds it). The K/V buffers (p2p: the
block being used and the one arriving, and in backward their dK/dV; all
gather: the gathered K/V and dK/dV) are held while one attention runs: the
stage ILPs get the budget less the largest, and the plan's peak counts it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict
from typing import Any, Collection, Sequence

import torch

from costmodel.cluster import Cluster, Link
from costmodel.presets import load_cluster
from costmodel.memory import step_peak_bytes, training_state_bytes
from costmodel.strategy_cost import IntraOpCost, local_numel
from costmodel.schedules.specs import schedule_spec
from costmodel.schedules.peaks import stage_counts_at_peak
from costmodel.schedules import ScheduleBook, rank_orders
from ir.device_capture import planned_copy
from ir.graph import PARAM, Graph, TensorInfo
from ir.layers import block_count
from ir.precision import get_precision
from ir.strategy import is_replicate
from ir.trace import trace
from planner.search.plan_assembly import build_plan, model_record, training_record
from planner.search.cp_search import (context_parallel_inputs, context_parallel_record,
                                      context_parallel_seconds, cp_link, kv_buffer_bound)
from planner.search.finalists import ExactPipeline, assemble
from planner.search.stage_dp import PipelineCandidate, StageMeshOption, StageTimes, stage_mesh_options
from planner.ilp.intra_op import (FixedPlacementError, IntraOpResult, MemoryInfeasibleError,
                              solve_intra_op)
from planner.baselines.megatron_layout import MegatronConfig, expert_weights, megatron_layout, num_experts
from planner.search.pipeline_search import p2p_seconds, simulate_step
from plan.format import Plan
from planner.request import PlanningError, default_memory_budget, resolve_precision
from planner.search.context import SearchContext, global_batch_of

__all__ = ["MegatronConfig", "MegatronDoesNotFit", "context_parallel_inputs",
           "context_parallel_seconds", "megatron_configs", "megatron_layout", "megatron_plan",
           "num_experts"]

_PAD_HINT = (" (Megatron pads the vocabulary to a multiple of 128 x tp: "
             "--make-vocab-size-divisible-by)")


class MegatronDoesNotFit(PlanningError):
    """A Megatron configuration that divides the model but does not fit in memory."""


def megatron_configs(cluster: Cluster, global_batch: int | None = None,
                     num_layers: int | None = None, *,
                     micro_batch_sizes: Sequence[int] = (1, 2, 4),
                     virtual_stages: Sequence[int | None] = (None, 2),
                     sequence_parallel: Sequence[bool] = (False, True),
                     use_distributed_optimizer: bool = True,
                     num_experts: int | None = None,
                     expert_parallel: Sequence[int] | None = None,
                     context_parallel: Sequence[int] = (1,),
                     seq_len: int | None = None) -> list[MegatronConfig]:
    """The configurations a Megatron practitioner would try on ``cluster``.

    * tensor parallel: powers of two up to a node (and dividing the cluster);
    * pipeline parallel (only when ``num_layers`` is given): every pp that
      divides the layers and the devices left after tp, whose stages are part
      of one node or whole nodes (the sub-meshes the Plan can run);
    * data parallel: the rest;
    * micro-batch size (only when ``global_batch`` is given): each of
      ``micro_batch_sizes`` that divides the batch and leaves at least pp
      micro-batches (fewer leave ranks idle), and without a pipeline also the
      whole local batch (no gradient accumulation);
    * virtual stages: each of ``virtual_stages`` (None = plain 1F1B, v =
      interleaved) where pp >= 2, the layers split into pp x v chunks and the
      micro-batches are a multiple of pp;
    * sequence parallelism: each of ``sequence_parallel`` where tp > 1 (with
      tp = 1 the configuration is listed once, without it, as Megatron turns
      it off there);
    * expert parallelism (only for a model with experts: ``num_experts``, see
      :func:`planner.baselines.megatron_layout.num_experts`): ep = 1 and every ep > 1
      that divides the dp x tp ranks of a stage and the expert count and is a
      multiple or a divisor of tp (:class:`MegatronConfig`), or those of
      ``expert_parallel`` (ep = 1 included only when listed there);
    * context parallelism: each cp of ``context_parallel`` (default 1 only)
      that divides the devices left after tp and pp, and, with ``seq_len``,
      cuts the sequence into 2 cp chunks (and s / cp into tp pieces under
      sequence parallelism); dp is what is left after tp, cp and pp.

    Pruning, to keep the grid small (each pipeline configuration costs one
    ILP per stage): the powers of two above, the micro-batch sizes given
    (default 1, 2, 4) and v <= 2. Memory is pruned later, by the plans
    themselves: a configuration that does not fit raises
    :class:`MegatronDoesNotFit` (and :func:`planner.baselines.compare.compare` then skips
    the larger micro-batch sizes of the same tp/pp/dp/vpp/sp).

    Order: pp, then tp, then cp, then micro-batch size, then v, then ep,
    ascending, then sequence parallelism in the order of ``sequence_parallel``
    (off first by default).
    """

    n, dpn = cluster.num_devices, cluster.devices_per_node
    out: list[MegatronConfig] = []

    def add(tp: int, dp: int, pp: int = 1, v: int | None = None, mbs: int | None = None,
            cp: int = 1) -> None:
        for ep in _expert_parallel_sizes(tp, dp * cp, num_experts, expert_parallel):
            for sp in dict.fromkeys(bool(s) and tp > 1 for s in sequence_parallel):
                if sp and seq_len is not None and (seq_len // cp) % tp:
                    continue
                out.append(MegatronConfig(tp, dp, use_distributed_optimizer, pp, v, mbs, sp,
                                          expert_model_parallel_size=ep, context_parallel_size=cp))

    tps = []
    tp = 1
    while tp <= min(n, dpn):
        if n % tp == 0:
            tps.append(tp)
        tp *= 2
    pps = [1] if num_layers is None else [p for p in range(1, n + 1)
                                          if n % p == 0 and num_layers % p == 0]
    for pp in pps:
        if pp > 1 and not stage_mesh_options(cluster, pp):
            continue
        for tp, cp in ((t, c) for t in tps for c in sorted(set(context_parallel))):
            if (n // pp) % (tp * cp) or (cp > 1 and seq_len is not None
                                         and seq_len % (2 * cp)):
                continue
            dp = n // (pp * tp * cp)
            mbss = [None] if global_batch is None else [
                b for b in micro_batch_sizes
                if global_batch % (b * dp) == 0 and global_batch // (b * dp) >= pp]
            if pp == 1:  # and the whole local batch at once
                if global_batch is not None and global_batch % dp == 0 \
                        and global_batch // dp not in mbss:
                    mbss.append(global_batch // dp)
                for mbs in mbss:
                    add(tp, dp, mbs=mbs, cp=cp)
                continue
            for mbs in mbss:
                for v in virtual_stages:
                    if v is not None and (num_layers % (pp * v) or (
                            global_batch is not None and (global_batch // (mbs * dp)) % pp)):
                        continue
                    add(tp, dp, pp, v, mbs, cp)
    return out


def _expert_parallel_sizes(tp: int, dp: int, experts: int | None,
                           wanted: Sequence[int] | None) -> list[int]:
    """The ep values of the grid for one (tp, dp): 1 and the ep > 1 that divide
    dp x tp and ``experts`` and nest with tp (only 1 without experts), kept
    to those in ``wanted`` when given; ascending."""
    if not experts:
        return [1]
    eps = [e for e in range(1, dp * tp + 1)
           if (dp * tp) % e == 0 and experts % e == 0 and (e % tp == 0 or tp % e == 0)]
    return eps if wanted is None else [e for e in eps if e in set(wanted)]


def _zero1_shards(fqn: str, cfg: MegatronConfig, experts: Collection[str]) -> int:
    """Ranks Megatron's distributed optimizer splits the optimizer states of
    parameter ``fqn`` over: the data-parallel ranks holding the same part of
    it, dp x cp for a dense weight and dp x cp x tp / ep for an expert weight
    (Megatron-Core's expert-data-parallel group); 1 without it."""
    if not cfg.use_distributed_optimizer:
        return 1
    return cfg.expert_data_parallel_size if fqn in experts else cfg.weight_data_parallel_size


_STATE_KINDS = ("params", "grads", "optimizer")


def _state_bytes(info: TensorInfo, placements: tuple, mesh_shape: tuple[int, ...],
                 zero_stage: int, shards: int, optimizer: str, precision: Any) -> dict[str, float]:
    """Parameter, gradient and optimizer bytes one device holds of a parameter
    placed as ``placements`` (:func:`costmodel.memory.training_state_bytes`
    of its local part, states split over ``shards`` ranks at ``zero_stage``)."""
    numel = int(math.ceil(local_numel(info, placements, mesh_shape)))
    s = training_state_bytes(numel, precision=precision, optimizer=optimizer,
                             zero_stage=zero_stage, dp_size=shards)
    return {k: float(s[k]) for k in _STATE_KINDS}


def _megatron_state_bytes(info: TensorInfo, placements: tuple, cfg: MegatronConfig,
                          shards: int, optimizer: str, precision: Any) -> dict[str, float]:
    """What Megatron-LM holds of a parameter: its optimizer's layout
    (ZeRO stage 1 of :func:`costmodel.memory.training_state_bytes`: the
    working parameters and gradients whole, the fp32 master copy with the
    states) split over ``shards`` ranks (:func:`_zero1_shards`; 1 without the
    distributed optimizer, the table's first column)."""
    return _state_bytes(info, placements, cfg.mesh_shape, 1, shards, optimizer, precision)


def _zero1_correction(graph: Graph, layout: dict[str, tuple], cfg: MegatronConfig,
                      experts: Collection[str], modelled_zero: int, modelled_shards: int,
                      optimizer: str, precision: Any) -> dict[str, float]:
    """Bytes per device, by kind, that turn the parameter states the cost
    model counts for ``graph``'s parameters (ZeRO stage ``modelled_zero``,
    states split over ``modelled_shards`` ranks: the stage mesh's axis 0)
    into Megatron's (:func:`_megatron_state_bytes`); negative where the cost
    model counts more. The ILPs get the memory budget less their sum and
    their results' bytes plus these, so they fit exactly."""
    out = dict.fromkeys(_STATE_KINDS, 0.0)
    for n in graph.nodes:
        if n.kind == PARAM:
            p = layout[n.fqn]
            exact = _megatron_state_bytes(n.output, p, cfg, _zero1_shards(n.fqn, cfg, experts),
                                          optimizer, precision)
            # the cost model splits over axis 0 only the states it replicates
            # (:meth:`costmodel.strategy_cost.IntraOpCost.memory_breakdown`)
            modelled = modelled_shards if is_replicate(p[0]) else 1
            counted = _state_bytes(n.output, p, cfg.mesh_shape,
                                   modelled_zero if modelled > 1 or modelled_zero == 1 else 0,
                                   modelled, optimizer, precision)
            for k in _STATE_KINDS:
                out[k] += exact[k] - counted[k]
    return out


def _correct(memory: dict[str, float], correction: dict[str, float]) -> None:
    """Add ``correction`` (bytes by kind) to an ILP result's ``memory``."""
    for k, v in correction.items():
        memory[k] = memory.get(k, 0.0) + v


def _state_floor(graph: Graph, layout: dict[str, tuple], cfg: MegatronConfig,
                 experts: Collection[str], optimizer: str, precision: Any) -> float:
    """A lower bound on parameter-state bytes of the fullest device: every
    parameter as the layout places it, split over pp (the fullest stage holds
    at least the average), held as Megatron holds it (:func:`_megatron_state_bytes`)."""
    total = 0.0
    for n in graph.nodes:
        if n.kind == PARAM:
            total += sum(_megatron_state_bytes(n.output, layout[n.fqn], cfg,
                                               _zero1_shards(n.fqn, cfg, experts), optimizer,
                                               precision).values())
    return total / cfg.pp


def _cp_link(stage_cluster: Cluster, cfg: MegatronConfig) -> Link:
    """The link a cp group's ring or all-gather runs over: Megatron's rank order
    (tp fastest, then cp, then dp) laid on the stage's devices."""
    return cp_link(stage_cluster, cfg.dp, cfg.cp, cfg.tp)


def _chunk_bounds(layers: Sequence[Any], counts: Sequence[int]) -> list[tuple[int, int]]:
    """``(first, end)`` layer indices of the model chunks holding ``counts[c]``
    blocks each, the end layers (embedding; head and loss) joining the first
    and the last chunk, as :func:`ir.layers.manual_bounds`; the first chunk may
    hold no block (the embedding alone) and the last none (the head and loss
    alone), where there is such an end layer.

    Raises:
        PlanningError: the counts do not split the blocks that way.
    """
    blocks = [i for i, layer in enumerate(layers) if not layer.end]
    ok = (sum(counts) == len(blocks) and min(counts[1:-1], default=1) >= 1
          and min(counts) >= 0 and (counts[0] >= 1 or blocks[0] > 0)
          and (counts[-1] >= 1 or blocks[-1] < len(layers) - 1) and len(counts) >= 1)
    if not ok:
        raise PlanningError(f"blocks per model chunk {list(counts)} do not split the "
                            f"{len(blocks)} blocks (only the first and last chunk may hold none, "
                            f"where an embedding or a head is there to hold)")
    cuts, done = [0], 0
    for c in counts[:-1]:
        done += c
        cuts.append(blocks[done] if done < len(blocks) else blocks[-1] + 1)
    cuts.append(len(layers))
    return list(zip(cuts[:-1], cuts[1:]))


def megatron_plan(model: torch.nn.Module, cluster: Cluster | str, cfg: MegatronConfig, *,
                  example_inputs: Any, model_source: str | None = None,
                  zoo_kwargs: dict[str, Any] | None = None, time_limit_s: float = 30.0,
                  graph: Graph | None = None, optimizer: str = "adam",
                  memory_budget: float | None = None,
                  cache: dict | None = None, precision: str | None = None) -> Plan:
    """The Plan of Megatron configuration ``cfg``.

    Without a pipeline and with the whole local batch in one micro-batch: the
    intra-op ILP on the (dp, tp) mesh with the Megatron layout fixed. With
    one (pp > 1), or with several micro-batches (gradient accumulation, a
    one-stage 1F1B): the layers split evenly over pp x vpp
    stages (the embedding with the first, the head and loss with the last, as
    Megatron does), each stage solved by the intra-op ILP on the (dp, tp)
    stage mesh with the layout fixed, priced by the 1F1B (or interleaved 1F1B)
    schedule simulation, exactly as :func:`planner.api.pipeline_plan` with
    ``fixed=megatron_layout(...)`` and a uniform ``layer_split`` (without its
    inter-op DP, whose cut Megatron does not use). The distributed optimizer
    splits each parameter's optimizer states over the data-parallel ranks
    holding it (ZeRO-1; :func:`_zero1_shards`): a pipeline's stage ILPs
    reduce the gradients on the stage mesh's axis 0 once per step (stage
    meshes with ``zero_stage=1``). Megatron's optimizer holds the working
    parameters and gradients whole and the fp32 master copy with the states
    (:func:`_megatron_state_bytes`: 6 + 12/d bytes per parameter under
    bf16-mixed with fp32 gradients); every ILP gets the memory budget less
    what the cost model's count of the parameter states misses (a single
    stage of the whole batch, counted without ZeRO: grown by what the
    distributed optimizer saves, so activations may use it), its result's
    bytes corrected by as much, kind by kind.

    With expert parallelism where the dense weights are replicated on two
    mesh axes (ep a multiple of tp and dp x tp / ep > 1: mesh
    (dp x tp / ep, ep / tp, tp)), the cost model reduces their gradients on
    axis 0 once per step but on the ep / tp axis in each micro-batch's
    backward (it reduces once per step on axis 0 only), and updates their
    optimizer states split over axis 0 only: the step time is an upper bound
    by that much. The memory is exact.

    Args:
        graph: the traced whole-batch program, if already traced.
        cache: a dict shared between calls for the same model and cluster
            (``planner compare``): traces and stage sub-programs are reused.
        precision: as :func:`planner.api.plan` (Megatron runs ``bf16-mixed``).

    Raises:
        PlanningError: ``cfg`` does not divide the model or the batch;
            :class:`MegatronDoesNotFit` (a PlanningError) when it does not fit.
    """
    if isinstance(cluster, str):
        cluster = load_cluster(cluster)
    if cfg.world_size != cluster.num_devices:
        raise PlanningError(f"{cfg.label()} needs {cfg.world_size} devices but cluster "
                            f"'{cluster.name}' has {cluster.num_devices}")
    if not isinstance(example_inputs, (tuple, list)):
        example_inputs = (example_inputs,)
    example_inputs = tuple(example_inputs)
    cache = {} if cache is None else cache
    m = cfg.num_microbatches(global_batch_of(example_inputs))
    context: dict[str, Any] = {}
    if cfg.cp > 1:  # price one cp rank's program: its s / cp tokens of each sequence
        context = {"context_parallel": context_parallel_record(cfg.cp, cfg.cp_comm_type,
                                                              example_inputs)}
        example_inputs = context_parallel_inputs(example_inputs, cfg.cp)
        cache = cache.setdefault(("context_parallel", cfg.cp), {})
        graph = None  # the given one is the whole sequences' program
    chosen = resolve_precision(model, cluster, precision)
    model, example_inputs = planned_copy(model, example_inputs, chosen, cluster.device_type)
    if graph is None:
        graph = cache.get("graph") or trace(model, example_inputs)
    cache["graph"] = graph
    dtype = chosen
    budget = default_memory_budget(cluster) if memory_budget is None else float(memory_budget)
    layout = megatron_layout(graph, cfg)
    experts = set(expert_weights(graph))
    floor = _state_floor(graph, layout, cfg, experts, optimizer, dtype)
    if floor > budget:
        raise MegatronDoesNotFit(
            f"{cfg.label()} needs at least {floor / 2**30:.1f} GiB per device for parameter "
            f"states alone, more than the {budget / 2**30:.1f} GiB available")

    training = training_record(dtype, optimizer, example_inputs, zoo_kwargs,
                               manual={"kind": "megatron", **asdict(cfg)}, **context)
    info = model_record(model, graph, model_source)
    if cfg.pp > 1 or m > 1 or cfg.cp > 1:  # a pipeline, accumulation or cp's exchange
        return _pipeline_plan(model, cluster, cfg, example_inputs, graph, layout, experts, m,
                              dtype, optimizer, budget, time_limit_s, cache, info, training)
    # the ILP counts whole optimizer states (ZeRO stage 0); Megatron's optimizer
    # keeps the master copy with them, split over dp by the distributed optimizer
    correction = _zero1_correction(graph, layout, cfg, experts, 0, 1, optimizer, dtype)
    try:
        result = solve_intra_op(graph, cluster, cfg.mesh_shape, dtype=dtype,
                                time_limit_s=time_limit_s, fixed=layout, optimizer=optimizer,
                                memory_budget=budget - sum(correction.values()),
                                recompute=cfg.recompute)
    except FixedPlacementError as err:
        raise PlanningError(f"{cfg.label()} does not divide the model: {err}{_PAD_HINT}") from err
    except MemoryInfeasibleError as err:
        raise MegatronDoesNotFit(f"{cfg.label()} does not fit: {err}") from None
    _correct(result.memory, correction)
    total = sum(result.memory.values())
    if total > budget * (1 + 1e-9):
        raise MegatronDoesNotFit(f"{cfg.label()} needs {total / 2**30:.1f} GiB per device, more "
                                 f"than the {budget / 2**30:.1f} GiB available")
    plan = build_plan(result, cluster, info, training, whole_batch=True)
    # the step's peak: the optimizer's temporaries are one list of a state's size,
    # the optimizer part also holds Megatron's master copy
    master = get_precision(dtype).master_bytes
    state = sum(master * math.ceil(math.ceil(local_numel(n.output, layout[n.fqn], cfg.mesh_shape))
                                   / _zero1_shards(n.fqn, cfg, experts))
                for n in graph.nodes if n.kind == PARAM)
    memory = plan.predicted["memory_bytes_per_device"]
    memory["peak"] = int(round(step_peak_bytes(result.memory, optimizer, state_bytes=state)))
    return plan


def _stage_copies(schedule: str, pp: int, m: int, v: int, book: ScheduleBook,
                  act_b: dict[int, float] | None = None) -> list[float]:
    """In-flight micro-batches of each chunk: its live activations at its
    rank's peak in torch's order (:func:`costmodel.schedules.peaks.stage_counts_at_peak`;
    weighted by the chunks' activation bytes per micro-batch ``act_b`` when
    given), at least one.

    Not the rank's peak shared evenly among its chunks (what the automatic
    search's :func:`planner.search.stage_dp.in_flight` assumes of its uniform
    stages): under torch's interleaved 1F1B, which is Llama 3's schedule with
    N = m / max(1, m // pp) micro-batches per round, the last rank's head
    chunk holds one micro-batch at a time, and an even share counted 14 of
    its logits (31 GB of Llama 3 405B's row 1), which made every other
    chunk recompute."""
    orders, _ = rank_orders(schedule, pp, m, v, book=book)
    counts = stage_counts_at_peak(orders, pp, act_b)
    return [float(max(1, counts.get(s, 0))) for s in range(pp * v)]


def _pipeline_plan(model, cluster: Cluster, cfg: MegatronConfig, example_inputs: tuple,
                   graph: Graph, layout: dict[str, tuple], experts: Collection[str], m: int,
                   dtype: str, optimizer: str, budget: float, time_limit_s: float, cache: dict,
                   info: dict, training: dict) -> Plan:
    """A Megatron pipeline: uniform layer split, fixed layout, 1F1B / interleaved
    (with pp = 1: one stage accumulating the gradients of its micro-batches;
    or ``cfg.pipeline_schedule``)."""

    options = stage_mesh_options(cluster, cfg.pp)
    if not options:
        raise PlanningError(f"{cfg.label()}: pp={cfg.pp} does not cut cluster '{cluster.name}' "
                            f"into sub-meshes inside a node or of whole nodes")
    # the distributed optimizer: optimizer states sharded over dp (mesh axis 0),
    # gradients reduced once per step (ZeRO-1); without it DDP's all-reduce,
    # also once per step
    zero = 1 if cfg.use_distributed_optimizer and cfg.dp > 1 else 0
    mesh = StageMeshOption(cfg.mesh_shape, options[0].num_nodes, options[0].devices_per_node,
                           zero_stage=zero, reduce_once=not zero and cfg.dp > 1)
    # what the layout (fixed in the context) depends on, and the context's settings
    key = ("ctx", cfg.dp, cfg.cp, cfg.tp, cfg.ep, cfg.sequence_parallel, budget, time_limit_s,
           optimizer)
    ctx = cache.get(key)
    if ctx is None:
        ctx = cache[key] = SearchContext(model, example_inputs, cluster, dtype=dtype,
                                         optimizer=optimizer, budget=budget,
                                         time_limit_s=time_limit_s, fixed=layout,
                                         programs=cache.setdefault("programs", {}),
                                         schedule_book=cache.setdefault("schedule_book",
                                                                        ScheduleBook()),
                                         whole_batch_graph=graph, context_parallel=cfg.cp)
    prog = ctx.program(m, traced=True)
    v = cfg.stages_per_rank
    bounds = _chunk_bounds(prog.layers, cfg.layer_split(block_count(prog.layers)))
    try:
        copies = _stage_copies(cfg.schedule, cfg.pp, m, v, ctx.schedule_book)
    except ValueError as err:
        raise PlanningError(f"{cfg.label()}: torch's {cfg.schedule} schedule rejects pp={cfg.pp} "
                            f"with {m} micro-batches: {err}") from None
    results, times = [], []
    modelled = cfg.mesh_shape[0] if zero else 1  # the stage mesh's ZeRO-1 axis
    stage_cluster = mesh.cluster(cluster)
    link = _cp_link(stage_cluster, cfg) if cfg.cp > 1 else None
    held = 0.0  # the largest K/V buffers of context parallelism, bytes per device
    ranks = schedule_spec(cfg.schedule).stage_to_rank(cfg.pp, v)
    solved: dict[int, IntraOpResult] = {}

    def solve(s: int, share: float) -> IntraOpResult:
        a, b = bounds[s]
        sub = ctx.stage_graph(prog, a, b)
        correction = _zero1_correction(sub, layout, cfg, experts, zero, modelled, optimizer,
                                       dtype)
        # the K/V buffers under the layout's split (heads over tp, rows over dp x cp)
        buffers = kv_buffer_bound(sub, cfg.cp, cfg.cp_comm_type, cfg.mesh_shape)
        try:
            r = ctx.solve_stage(prog, a, b, mesh, share - sum(correction.values()) - buffers,
                                copies[s], cfg.recompute)
        except FixedPlacementError as err:
            raise PlanningError(f"{cfg.label()} does not divide the model: {err}{_PAD_HINT}"
                                ) from err
        _correct(r.memory, correction)
        return r

    def solve_all() -> None:
        """Every chunk solved in an even share of its rank's memory; a chunk
        that needs more takes its least and the rank's others share the rest."""
        solved.clear()
        need: dict[int, float] = {}  # a short chunk's least share of its rank's memory
        for s in range(len(bounds)):
            try:
                solved[s] = solve(s, budget / v)
            except MemoryInfeasibleError as err:
                if v == 1:
                    raise MegatronDoesNotFit(
                        f"{cfg.label()}: stage {s} does not fit: {err}") from None
                # the ILP's least, plus what solve() kept back from the share
                need[s] = err.least_bytes + (budget / v - err.budget_bytes)
        # a rank's chunks share its memory: a chunk that needs more than an even
        # share (the head of an uneven layout) takes its least, the rank's other
        # chunks are solved again in what is left, evenly, and the short chunk then
        # gets all the others leave
        for rank in sorted({ranks[s] for s in need}):
            mine = [s for s in range(len(bounds)) if ranks[s] == rank]
            others = [s for s in mine if s not in need]
            rest = budget - sum(need[s] for s in mine if s in need)
            for s in others:
                if others and sum(solved[s].memory.values()) > rest / len(others):
                    try:
                        solved[s] = solve(s, rest / len(others))
                    except MemoryInfeasibleError as err:
                        raise MegatronDoesNotFit(
                            f"{cfg.label()}: stage {s} does not fit beside its "
                            f"rank's larger stages: {err}") from None
            for s in mine:
                if s in need:
                    left = (budget - sum(sum(solved[o].memory.values()) for o in mine
                                         if o in solved)
                            - sum(need[o] for o in mine
                                  if o in need and o not in solved and o != s))
                    try:
                        solved[s] = solve(s, left)
                    except MemoryInfeasibleError as err:
                        raise MegatronDoesNotFit(f"{cfg.label()}: stage {s} does not fit in the "
                                                 f"{left / 2**30:.1f} GiB its rank's other stages "
                                                 f"leave: {err}") from None

    solve_all()
    if v > 1:
        # the rank's peak weighted by each chunk's own activation bytes per
        # micro-batch: the counts at that moment, solved again where they differ
        act_b = {s: r.memory.get("activations", 0.0) / copies[s] for s, r in solved.items()}
        weighted = _stage_copies(cfg.schedule, cfg.pp, m, v, ctx.schedule_book, act_b)
        if weighted != copies:
            copies = weighted
            solve_all()
    for s in range(len(bounds)):
        r = solved[s]
        results.append(r)
        t = ctx.times_of(r, mesh)
        if cfg.cp > 1:
            cost = IntraOpCost(r.graph, stage_cluster, r.mesh_shape, ctx.dtype, ctx.optimizer)
            f, bwd, kv_buffers = context_parallel_seconds(r, cost, cfg.cp, cfg.cp_comm_type, link)
            t = dataclasses.replace(t, forward_s=t.forward_s + f,
                                    backward_input_s=t.backward_input_s + bwd)
            held = max(held, kv_buffers)
        times.append(t)
    p2p = p2p_seconds(prog, bounds, mesh, cluster)
    step, bubble = simulate_step(cfg.schedule, cfg.pp, m, v, times, p2p, ctx.schedule_book)
    cand = PipelineCandidate(cfg.pp, v, mesh, cfg.schedule, m, None, step, bubble, sum(p2p))
    exact = ExactPipeline(cand, prog, bounds, results, times, copies, step, bubble, p2p)
    plan = assemble(exact, ctx, lambda r, c: build_plan(r, c, info, training))
    if cfg.cp > 1:
        # the exchange's buffers, held while one attention runs: counted at the peak
        memory = plan.predicted["memory_bytes_per_device"]
        memory["peak"] = int(round(memory["peak"] + held))
        plan.predicted["context_parallel"] = {
            "kv_buffer_bytes": held,
            "forward_s_per_microbatch": [t.forward_s for t in times],
            "exchange_s_per_microbatch": [
                sum(context_parallel_seconds(r, IntraOpCost(r.graph, stage_cluster, r.mesh_shape,
                                                            ctx.dtype, ctx.optimizer),
                                             cfg.cp, cfg.cp_comm_type, link)[:2])
                for r in results]}
    return plan
