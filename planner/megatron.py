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
tensor parallel size 1, :mod:`planner.megatron_layout`) splits the expert
weights on their expert dimension over ep ranks of the dp x tp ones. Their
gradients then reduce over the expert-data-parallel ranks only: the cost
model all-reduces a parameter's gradient over a mesh axis only where the
parameter is replicated, and the expert weights are ``S(0)`` on the
expert-parallel axes. The distributed optimizer shards each parameter's
optimizer states, with the fp32 master copy, over the data-parallel ranks
holding it (dp for dense weights, dp x tp / ep for expert weights): the plans
count exactly that (:func:`_zero1_correction`), whatever the stage mesh's
ZeRO-1 axis is.
"""

from __future__ import annotations

import math
from dataclasses import asdict
from typing import Any, Collection, Sequence

import torch

from costmodel.cluster import Cluster
from costmodel.presets import load_cluster
from costmodel.memory import step_peak_bytes, training_state_bytes
from costmodel.strategy_cost import local_numel
from costmodel.schedules import ScheduleBook
from ir.device_capture import planned_copy
from ir.graph import PARAM, Graph, TensorInfo
from ir.layers import block_count, manual_bounds
from ir.precision import get_precision
from ir.strategy import is_replicate
from ir.trace import trace
from planner.assembly import build_plan, model_record, training_record
from planner.finalists import ExactPipeline, assemble
from planner.inter_op import PipelineCandidate, StageMeshOption, stage_mesh_options
from planner.intra_op import FixedPlacementError, MemoryInfeasibleError, solve_intra_op
from planner.megatron_layout import MegatronConfig, expert_weights, megatron_layout, num_experts
from planner.pipeline import p2p_seconds, simulate_step, stage_in_flight
from planner.plan_format import Plan
from planner.request import PlanningError, default_memory_budget, resolve_precision
from planner.search_context import SearchContext, global_batch_of

__all__ = ["MegatronConfig", "MegatronDoesNotFit", "megatron_configs", "megatron_layout",
           "megatron_plan", "num_experts"]

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
                     expert_parallel: Sequence[int] | None = None) -> list[MegatronConfig]:
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
      :func:`planner.megatron_layout.num_experts`): ep = 1 and every ep > 1
      that divides the dp x tp ranks of a stage and the expert count and is a
      multiple or a divisor of tp (:class:`MegatronConfig`), or those of
      ``expert_parallel`` (ep = 1 included only when listed there).

    Pruning, to keep the grid small (each pipeline configuration costs one
    ILP per stage): the powers of two above, the micro-batch sizes given
    (default 1, 2, 4) and v <= 2. Memory is pruned later, by the plans
    themselves: a configuration that does not fit raises
    :class:`MegatronDoesNotFit` (and :func:`app.compare.compare` then skips
    the larger micro-batch sizes of the same tp/pp/dp/vpp/sp).

    Order: pp, then tp, then micro-batch size, then v, then ep, ascending,
    then sequence parallelism in the order of ``sequence_parallel`` (off
    first by default).
    """

    n, dpn = cluster.num_devices, cluster.devices_per_node
    out: list[MegatronConfig] = []

    def add(tp: int, dp: int, pp: int = 1, v: int | None = None, mbs: int | None = None) -> None:
        for ep in _expert_parallel_sizes(tp, dp, num_experts, expert_parallel):
            for sp in dict.fromkeys(bool(s) and tp > 1 for s in sequence_parallel):
                out.append(MegatronConfig(tp, dp, use_distributed_optimizer, pp, v, mbs, sp,
                                          expert_model_parallel_size=ep))

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
        for tp in tps:
            if (n // pp) % tp:
                continue
            dp = n // (pp * tp)
            mbss = [None] if global_batch is None else [
                b for b in micro_batch_sizes
                if global_batch % (b * dp) == 0 and global_batch // (b * dp) >= pp]
            if pp == 1:  # and the whole local batch at once
                if global_batch is not None and global_batch % dp == 0 \
                        and global_batch // dp not in mbss:
                    mbss.append(global_batch // dp)
                for mbs in mbss:
                    add(tp, dp, mbs=mbs)
                continue
            for mbs in mbss:
                for v in virtual_stages:
                    if v is not None and (num_layers % (pp * v) or (
                            global_batch is not None and (global_batch // (mbs * dp)) % pp)):
                        continue
                    add(tp, dp, pp, v, mbs)
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
    it, dp for a dense weight and dp x tp / ep for an expert weight
    (Megatron-Core's expert-data-parallel group); 1 without it."""
    if not cfg.use_distributed_optimizer:
        return 1
    return cfg.expert_data_parallel_size if fqn in experts else cfg.dp


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

    m = cfg.num_microbatches(global_batch_of(example_inputs))
    training = training_record(dtype, optimizer, example_inputs, zoo_kwargs,
                               manual={"kind": "megatron", **asdict(cfg)})
    info = model_record(model, graph, model_source)
    if cfg.pp > 1 or m > 1:  # a pipeline, or gradient accumulation
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
    key = ("ctx", cfg.dp, cfg.tp, cfg.ep, cfg.sequence_parallel, budget, time_limit_s, optimizer)
    ctx = cache.get(key)
    if ctx is None:
        ctx = cache[key] = SearchContext(model, example_inputs, cluster, dtype=dtype,
                                         optimizer=optimizer, budget=budget,
                                         time_limit_s=time_limit_s, fixed=layout,
                                         programs=cache.setdefault("programs", {}),
                                         schedule_book=cache.setdefault("schedule_book",
                                                                        ScheduleBook()),
                                         whole_batch_graph=graph)
    prog = ctx.program(m, traced=True)
    v = cfg.stages_per_rank
    bounds = manual_bounds(prog.layers, cfg.layer_split(block_count(prog.layers)))
    try:
        copies = stage_in_flight(cfg.schedule, cfg.pp, m, v, ctx.schedule_book)
    except ValueError as err:
        raise PlanningError(f"{cfg.label()}: torch's {cfg.schedule} schedule rejects pp={cfg.pp} "
                            f"with {m} micro-batches: {err}") from None
    results, times = [], []
    modelled = cfg.mesh_shape[0] if zero else 1  # the stage mesh's ZeRO-1 axis
    for s, (a, b) in enumerate(bounds):
        correction = _zero1_correction(ctx.stage_graph(prog, a, b), layout, cfg, experts,
                                       zero, modelled, optimizer, dtype)
        try:
            r = ctx.solve_stage(prog, a, b, mesh, budget / v - sum(correction.values()),
                                copies[s], cfg.recompute)
        except FixedPlacementError as err:
            raise PlanningError(f"{cfg.label()} does not divide the model: {err}{_PAD_HINT}"
                                ) from err
        except MemoryInfeasibleError as err:
            raise MegatronDoesNotFit(f"{cfg.label()}: stage {s} does not fit: {err}") from None
        _correct(r.memory, correction)
        results.append(r)
        t = ctx.times_of(r, mesh)
        times.append(t)
    p2p = p2p_seconds(prog, bounds, mesh, cluster)
    step, bubble = simulate_step(cfg.schedule, cfg.pp, m, v, times, p2p, ctx.schedule_book)
    cand = PipelineCandidate(cfg.pp, v, mesh, cfg.schedule, m, None, step, bubble, sum(p2p))
    exact = ExactPipeline(cand, prog, bounds, results, times, copies, step, bubble, p2p)
    return assemble(exact, ctx, lambda r, c: build_plan(r, c, info, training))
