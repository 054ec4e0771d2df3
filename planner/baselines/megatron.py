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

from dataclasses import asdict
from typing import Any, Collection

import torch

from costmodel.cluster import Cluster
from costmodel.memory import step_peak_bytes
from costmodel.presets import load_cluster
from ir.device_capture import planned_copy
from ir.graph import Graph
from ir.trace import trace
from plan.format import Plan
from planner.baselines.megatron_grid import megatron_configs
from planner.baselines.megatron_memory import (MegatronDoesNotFit, correct, master_state_bytes,
                                               state_floor, zero1_correction)
from planner.baselines.megatron_pipeline import PAD_HINT, pipeline_plan
from planner.ilp.fixed_layout import FixedPlacementError
from planner.ilp.intra_op import MemoryInfeasibleError, solve_intra_op
from planner.megatron_layout import MegatronConfig, expert_weights, megatron_layout, num_experts
from planner.request import PlanningError, default_memory_budget, resolve_precision
from planner.search.context import global_batch_of
from planner.search.cp_search import (context_parallel_inputs, context_parallel_record,
                                      context_parallel_seconds)
from planner.search.plan_assembly import build_plan, model_record, training_record

__all__ = ["MegatronConfig", "MegatronDoesNotFit", "context_parallel_inputs",
           "context_parallel_seconds", "megatron_configs", "megatron_layout", "megatron_plan",
           "num_experts"]


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
    holding it (ZeRO-1;
    :func:`planner.baselines.megatron_memory.zero1_shards`): a pipeline's stage ILPs
    reduce the gradients on the stage mesh's axis 0 once per step (stage
    meshes with ``zero_stage=1``). Megatron's optimizer holds the working
    parameters and gradients whole and the fp32 master copy with the states
    (:mod:`planner.baselines.megatron_memory`: 6 + 12/d bytes per parameter under
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
    cluster = _cluster_of(cfg, cluster)
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
    _check_state_floor(graph, layout, cfg, experts, optimizer, dtype, budget)
    training = training_record(dtype, optimizer, example_inputs, zoo_kwargs,
                               manual={"kind": "megatron", **asdict(cfg)}, **context)
    info = model_record(model, graph, model_source)
    if cfg.pp > 1 or m > 1 or cfg.cp > 1:  # a pipeline, accumulation or cp's exchange
        return pipeline_plan(model, cluster, cfg, example_inputs, graph, layout, experts, m,
                             dtype, optimizer, budget, time_limit_s, cache, info, training)
    return _single_stage_plan(graph, cluster, cfg, layout, experts, dtype, optimizer, budget,
                              time_limit_s, info, training)


def _cluster_of(cfg: MegatronConfig, cluster: Cluster | str) -> Cluster:
    """``cluster`` (loaded where a spec string), which must have ``cfg``'s devices.

    Raises:
        PlanningError: it has another number of devices.
    """
    if isinstance(cluster, str):
        cluster = load_cluster(cluster)
    if cfg.world_size != cluster.num_devices:
        raise PlanningError(f"{cfg.label()} needs {cfg.world_size} devices but cluster "
                            f"'{cluster.name}' has {cluster.num_devices}")
    return cluster


def _check_state_floor(graph: Graph, layout: dict[str, tuple], cfg: MegatronConfig,
                       experts: Collection[str], optimizer: str, dtype: Any,
                       budget: float) -> None:
    """Refuse ``cfg`` where its parameter states alone
    (:func:`planner.baselines.megatron_memory.state_floor`) exceed ``budget``.

    Raises:
        MegatronDoesNotFit: they do.
    """
    floor = state_floor(graph, layout, cfg, experts, optimizer, dtype)
    if floor > budget:
        raise MegatronDoesNotFit(
            f"{cfg.label()} needs at least {floor / 2**30:.1f} GiB per device for parameter "
            f"states alone, more than the {budget / 2**30:.1f} GiB available")


def _single_stage_plan(graph: Graph, cluster: Cluster, cfg: MegatronConfig,
                       layout: dict[str, tuple], experts: Collection[str], dtype: Any,
                       optimizer: str, budget: float, time_limit_s: float, info: dict,
                       training: dict) -> Plan:
    """The plan of ``cfg`` without a pipeline, on the whole local batch: the
    intra-op ILP on the (dp, tp) mesh with ``layout`` fixed, its memory as
    Megatron holds it."""
    # the ILP counts whole optimizer states (ZeRO stage 0); Megatron's optimizer
    # keeps the master copy with them, split over dp by the distributed optimizer
    correction = zero1_correction(graph, layout, cfg, experts, 0, 1, optimizer, dtype)
    try:
        result = solve_intra_op(graph, cluster, cfg.mesh_shape, dtype=dtype,
                                time_limit_s=time_limit_s, fixed=layout, optimizer=optimizer,
                                memory_budget=budget - sum(correction.values()),
                                recompute=cfg.recompute)
    except FixedPlacementError as err:
        raise PlanningError(f"{cfg.label()} does not divide the model: {err}{PAD_HINT}") from err
    except MemoryInfeasibleError as err:
        raise MegatronDoesNotFit(f"{cfg.label()} does not fit: {err}") from None
    correct(result.memory, correction)
    total = sum(result.memory.values())
    if total > budget * (1 + 1e-9):
        raise MegatronDoesNotFit(f"{cfg.label()} needs {total / 2**30:.1f} GiB per device, more "
                                 f"than the {budget / 2**30:.1f} GiB available")
    plan = build_plan(result, cluster, info, training, whole_batch=True)
    # the step's peak: the optimizer's temporaries are one list of a state's size,
    # the optimizer part also holds Megatron's master copy
    state = master_state_bytes(graph, layout, cfg, experts, dtype)
    memory = plan.predicted["memory_bytes_per_device"]
    memory["peak"] = int(round(step_peak_bytes(result.memory, optimizer, state_bytes=state)))
    return plan
