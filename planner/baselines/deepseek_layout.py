"""DeepSeek-V3's published parallel layout, priced by the same cost model.

The DeepSeek-V3 technical report (DeepSeek-AI 2024, section 3.2) trains on
2048 H800 GPUs (cluster ``h800:256``) with 16-way pipeline parallelism,
64-way expert parallelism spanning 8 nodes, ZeRO-1 data parallelism and no
tensor parallelism; its pipeline schedule is DualPipe, whose V-shaped form
(two stages per rank, torch's ``ScheduleDualPipeV``) is ``dualpipev`` here.

:func:`deepseek_config` writes that layout as a :class:`MegatronConfig`
(tp = 1, dp = devices / pp, the distributed optimizer for ZeRO-1, expert
parallelism carved out of dp, the schedule given), and :func:`deepseek_plan`
prices it with :func:`planner.baselines.megatron.megatron_plan`, so the plan is the
same kind as a Megatron baseline's. pp, ep and the schedule are parameters
with DeepSeek's values as defaults, so the layout can be tried on smaller
models and clusters.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Sequence

import torch

from costmodel.cluster import Cluster
from costmodel.presets import load_cluster
from ir.graph import Graph
from ir.layers import block_count, pipeline_layers
from ir.precision import compute_copy
from ir.trace import trace
from planner.baselines.megatron import megatron_plan
from planner.megatron_layout import MegatronConfig
from plan.format import Plan
from planner.request import PlanningError, resolve_precision
from planner.search.context import global_batch_of

__all__ = ["DEEPSEEK_V3_EP", "DEEPSEEK_V3_PP", "DEEPSEEK_V3_SCHEDULE", "balanced_layer_split",
           "deepseek_config", "deepseek_plan"]

#: The DeepSeek-V3 report's pipeline-parallel size, expert-parallel size and schedule.
DEEPSEEK_V3_PP = 16
DEEPSEEK_V3_EP = 64
DEEPSEEK_V3_SCHEDULE = "dualpipev"


def balanced_layer_split(num_layers: int, chunks: int) -> tuple[int, ...]:
    """Layers of each of ``chunks`` model chunks, in pipeline order, as even as
    they go: every chunk ``num_layers // chunks`` layers, and the layers left
    over one each to the middle chunks first (the first and last chunks also
    hold the embedding and the head), then to the first and the last.

    Raises:
        PlanningError: fewer layers than chunks.
    """
    if num_layers < chunks:
        raise PlanningError(f"{num_layers} layers cannot fill {chunks} pipeline model chunks; "
                            f"use a smaller pp")
    base, extra = divmod(num_layers, chunks)
    order = list(range(1, chunks - 1)) + [0, chunks - 1] if chunks > 1 else [0]
    plus = set(order[:extra])
    return tuple(base + (c in plus) for c in range(chunks))


def deepseek_config(cluster: Cluster, num_layers: int, *, pp: int = DEEPSEEK_V3_PP,
                    ep: int = DEEPSEEK_V3_EP, schedule: str = DEEPSEEK_V3_SCHEDULE,
                    micro_batch_size: int = 1,
                    layer_split: Sequence[int] | None = None) -> MegatronConfig:
    """DeepSeek-V3's layout on ``cluster`` for a model of ``num_layers`` blocks:
    ``pp`` pipeline ranks running ``schedule``, no tensor parallelism, data
    parallel over the rest with ZeRO-1 (the distributed optimizer), ``ep``-way
    expert parallelism out of the data-parallel ranks, micro-batches of
    ``micro_batch_size`` sequences per data-parallel rank. ``layer_split``:
    blocks of each model chunk (default: the even split when the blocks
    divide, else :func:`balanced_layer_split`).

    Raises:
        PlanningError: pp does not divide the cluster, or ep does not divide
            its data-parallel ranks.
    """
    n = cluster.num_devices
    if pp < 1 or n % pp:
        raise PlanningError(f"pp={pp} does not divide the {n} devices of cluster "
                            f"'{cluster.name}'")
    cfg = MegatronConfig(1, n // pp, True, pp, micro_batch_size=micro_batch_size,
                         expert_model_parallel_size=ep, pipeline_schedule=schedule)
    chunks = pp * cfg.stages_per_rank
    if layer_split is None and num_layers % chunks:
        layer_split = balanced_layer_split(num_layers, chunks)
    if layer_split is None:
        return cfg
    return replace(cfg, pipeline_model_parallel_layout=tuple(layer_split))


def deepseek_plan(model: torch.nn.Module, cluster: Cluster | str, *, example_inputs: Any,
                  pp: int = DEEPSEEK_V3_PP, ep: int = DEEPSEEK_V3_EP,
                  schedule: str = DEEPSEEK_V3_SCHEDULE, micro_batch_size: int = 1,
                  layer_split: Sequence[int] | None = None, graph: Graph | None = None,
                  precision: str | None = None, **options: Any) -> Plan:
    """The Plan of DeepSeek-V3's layout (:func:`deepseek_config`) for ``model``
    on ``cluster``, priced as :func:`planner.baselines.megatron.megatron_plan` prices a
    Megatron configuration (``options``: its further keyword arguments, e.g.
    ``memory_budget``, ``time_limit_s``, ``cache``, ``model_source``).

    Raises:
        PlanningError: the layout does not divide the model, the cluster or
            the batch; :class:`planner.baselines.megatron.MegatronDoesNotFit` when it
            does not fit in memory.
    """
    if isinstance(cluster, str):
        cluster = load_cluster(cluster)
    inputs = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (
        example_inputs,)
    if graph is None:
        chosen = resolve_precision(model, cluster, precision)
        graph = trace(*compute_copy(model, inputs, chosen))
    cfg = deepseek_config(cluster, block_count(pipeline_layers(graph)), pp=pp, ep=ep,
                          schedule=schedule, micro_batch_size=micro_batch_size,
                          layer_split=layer_split)
    cfg.num_microbatches(global_batch_of(inputs))  # a clear error before any solve
    return megatron_plan(model, cluster, cfg, example_inputs=inputs, graph=graph,
                         precision=precision, **options)
