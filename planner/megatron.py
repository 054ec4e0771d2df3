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
"""

from __future__ import annotations

import math
from dataclasses import asdict
from typing import Any, Sequence

import torch
from torch.distributed.tensor.placement_types import Replicate

from costmodel.cluster import Cluster
from costmodel.presets import load_cluster
from costmodel.memory import training_state_bytes
from costmodel.strategy_cost import local_numel
from costmodel.schedules import ScheduleBook
from ir.graph import PARAM, Graph
from ir.layers import block_count, manual_bounds
from ir.precision import compute_copy
from ir.trace import trace
from planner.assembly import build_plan, model_record, training_record
from planner.finalists import ExactPipeline, assemble
from planner.inter_op import PipelineCandidate, StageMeshOption, stage_mesh_options
from planner.intra_op import FixedPlacementError, MemoryInfeasibleError, solve_intra_op
from planner.megatron_layout import MegatronConfig, megatron_layout
from planner.pipeline import p2p_seconds, simulate_step, stage_in_flight
from planner.plan_format import Plan
from planner.request import PlanningError, default_memory_budget, resolve_precision
from planner.search_context import SearchContext, global_batch_of

__all__ = ["MegatronConfig", "MegatronDoesNotFit", "megatron_configs", "megatron_layout",
           "megatron_plan"]

_PAD_HINT = (" (Megatron pads the vocabulary to a multiple of 128 x tp: "
             "--make-vocab-size-divisible-by)")


class MegatronDoesNotFit(PlanningError):
    """A Megatron configuration that divides the model but does not fit in memory."""


def megatron_configs(cluster: Cluster, global_batch: int | None = None,
                     num_layers: int | None = None, *,
                     micro_batch_sizes: Sequence[int] = (1, 2, 4),
                     virtual_stages: Sequence[int | None] = (None, 2),
                     sequence_parallel: Sequence[bool] = (False, True),
                     use_distributed_optimizer: bool = True) -> list[MegatronConfig]:
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
      it off there).

    Pruning, to keep the grid small (each pipeline configuration costs one
    ILP per stage): the powers of two above, the micro-batch sizes given
    (default 1, 2, 4) and v <= 2. Memory is pruned later, by the plans
    themselves: a configuration that does not fit raises
    :class:`MegatronDoesNotFit` (and :func:`app.compare.compare` then skips
    the larger micro-batch sizes of the same tp/pp/dp/vpp/sp).

    Order: pp, then tp, then micro-batch size, then v, ascending, then
    sequence parallelism in the order of ``sequence_parallel`` (off first by
    default).
    """

    n, dpn = cluster.num_devices, cluster.devices_per_node
    out: list[MegatronConfig] = []

    def add(tp: int, dp: int, pp: int = 1, v: int | None = None, mbs: int | None = None) -> None:
        for sp in dict.fromkeys(bool(s) and tp > 1 for s in sequence_parallel):
            out.append(MegatronConfig(tp, dp, use_distributed_optimizer, pp, v, mbs, sp))

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


def _state_floor(graph: Graph, cfg: MegatronConfig, optimizer: str, precision: str) -> float:
    """A lower bound on parameter-state bytes of the fullest device: every
    parameter split tp x pp ways (the fullest stage holds at least the average),
    optimizer states also over dp under the distributed optimizer."""

    total = 0.0
    for t in graph.parameters.values():
        s = training_state_bytes(int(t.numel), precision=precision, optimizer=optimizer)
        opt = s["optimizer"] / (cfg.dp if cfg.use_distributed_optimizer else 1)
        total += s["params"] + s["grads"] + opt
    return total / (cfg.tp * cfg.pp)


def _optimizer_bytes(graph: Graph, layout: dict[str, tuple], mesh_shape: tuple[int, ...],
                     optimizer: str, precision: str) -> float:
    """Optimizer-state bytes per device of ``graph``'s parameters under ``layout``."""

    total = 0.0
    for n in graph.nodes:
        if n.kind == PARAM:
            numel = local_numel(n.output, layout.get(n.fqn, (Replicate(),) * len(mesh_shape)),
                                mesh_shape)
            total += training_state_bytes(int(math.ceil(numel)), precision=precision,
                                          optimizer=optimizer)["optimizer"]
    return total


def _zero1_saving(graph: Graph, cfg: MegatronConfig, layout: dict[str, tuple],
                  optimizer: str, precision: str) -> float:
    """Bytes per device the distributed optimizer saves (ZeRO-1 over dp)."""
    if not cfg.use_distributed_optimizer or cfg.dp == 1:
        return 0.0
    return _optimizer_bytes(graph, layout, cfg.mesh_shape, optimizer, precision) * (1 - 1 / cfg.dp)


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
    divides the optimizer states by dp (ZeRO-1): a pipeline's stage ILPs
    count that and reduce the gradients once per step (stage meshes with
    ``zero_stage=1``); a single stage of the whole batch has the ILP's memory
    budget grown by what it saves, so activations may use it.

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
    model, example_inputs = compute_copy(model, example_inputs, chosen)
    if graph is None:
        graph = cache.get("graph") or trace(model, example_inputs)
    cache["graph"] = graph
    dtype = chosen
    budget = default_memory_budget(cluster) if memory_budget is None else float(memory_budget)
    floor = _state_floor(graph, cfg, optimizer, dtype)
    if floor > budget:
        raise MegatronDoesNotFit(
            f"{cfg.label()} needs at least {floor / 2**30:.1f} GiB per device for parameter "
            f"states alone, more than the {budget / 2**30:.1f} GiB available")

    m = cfg.num_microbatches(global_batch_of(example_inputs))
    layout = megatron_layout(graph, cfg)
    training = training_record(dtype, optimizer, example_inputs, zoo_kwargs,
                               manual={"kind": "megatron", **asdict(cfg)})
    info = model_record(model, graph, model_source)
    if cfg.pp > 1 or m > 1:  # a pipeline, or gradient accumulation
        return _pipeline_plan(model, cluster, cfg, example_inputs, graph, layout, m, dtype,
                              optimizer, budget, time_limit_s, cache, info, training)
    saving = _zero1_saving(graph, cfg, layout, optimizer, dtype)
    try:
        result = solve_intra_op(graph, cluster, cfg.mesh_shape, dtype=dtype,
                                time_limit_s=time_limit_s, fixed=layout, optimizer=optimizer,
                                memory_budget=budget + saving, recompute=cfg.recompute)
    except FixedPlacementError as err:
        raise PlanningError(f"{cfg.label()} does not divide the model: {err}{_PAD_HINT}") from err
    except MemoryInfeasibleError as err:
        raise MegatronDoesNotFit(f"{cfg.label()} does not fit: {err}") from None
    if cfg.use_distributed_optimizer and cfg.dp > 1:
        result.memory["optimizer"] /= cfg.dp  # ZeRO-1 over data parallel
    total = sum(result.memory.values())
    if total > budget * (1 + 1e-9):
        raise MegatronDoesNotFit(f"{cfg.label()} needs {total / 2**30:.1f} GiB per device, more "
                                 f"than the {budget / 2**30:.1f} GiB available")
    return build_plan(result, cluster, info, training, whole_batch=True)


def _pipeline_plan(model, cluster: Cluster, cfg: MegatronConfig, example_inputs: tuple,
                   graph: Graph, layout: dict[str, tuple], m: int, dtype: str, optimizer: str,
                   budget: float, time_limit_s: float, cache: dict, info: dict,
                   training: dict) -> Plan:
    """A Megatron pipeline: uniform layer split, fixed layout, 1F1B / interleaved
    (with pp = 1: one stage accumulating the gradients of its micro-batches)."""

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
    key = ("ctx", cfg.dp, cfg.tp, cfg.sequence_parallel, budget, time_limit_s, optimizer)
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
    for s, (a, b) in enumerate(bounds):
        try:
            r = ctx.solve_stage(prog, a, b, mesh, budget / v, copies[s], cfg.recompute)
        except FixedPlacementError as err:
            raise PlanningError(f"{cfg.label()} does not divide the model: {err}{_PAD_HINT}"
                                ) from err
        except MemoryInfeasibleError as err:
            raise MegatronDoesNotFit(f"{cfg.label()}: stage {s} does not fit: {err}") from None
        results.append(r)
        t = ctx.times_of(r, mesh)
        times.append(t)
    p2p = p2p_seconds(prog, bounds, mesh, cluster)
    step, bubble = simulate_step(cfg.schedule, cfg.pp, m, v, times, p2p, ctx.schedule_book)
    cand = PipelineCandidate(cfg.pp, v, mesh, cfg.schedule, m, None, step, bubble, sum(p2p))
    exact = ExactPipeline(cand, prog, bounds, results, times, copies, step, bubble, p2p)
    return assemble(exact, ctx, lambda r, c: build_plan(r, c, info, training))
