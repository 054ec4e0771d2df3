"""What Megatron-LM holds of the parameters, against what the cost model counts.

Megatron's distributed optimizer (ZeRO-1) keeps the working parameters and
gradients whole and splits the fp32 master copy with the optimizer states over
the data-parallel ranks holding each parameter (:func:`zero1_shards`). The
intra-op ILPs count the parameter states their own way (ZeRO stage and shards
of the stage mesh's axis 0); :func:`zero1_correction` is the difference, by
kind, that :mod:`planner.baselines.megatron` takes off their memory budgets
and adds to their results, so that a Megatron plan counts exactly what
Megatron holds.

Units: bytes.
"""

from __future__ import annotations

import math
from typing import Any, Collection

from costmodel.memory import training_state_bytes
from ir.graph import PARAM, Graph, TensorInfo
from ir.precision import get_precision
from ir.strategy import is_replicate, local_numel
from planner.megatron_layout import MegatronConfig
from planner.request import PlanningError

__all__ = ["MegatronDoesNotFit", "correct", "master_state_bytes", "state_floor",
           "zero1_correction", "zero1_shards"]


class MegatronDoesNotFit(PlanningError):
    """A Megatron configuration that divides the model but does not fit in memory."""


def zero1_shards(fqn: str, cfg: MegatronConfig, experts: Collection[str]) -> int:
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
    states) split over ``shards`` ranks (:func:`zero1_shards`; 1 without the
    distributed optimizer, the table's first column)."""
    return _state_bytes(info, placements, cfg.mesh_shape, 1, shards, optimizer, precision)


def zero1_correction(graph: Graph, layout: dict[str, tuple], cfg: MegatronConfig,
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
            exact = _megatron_state_bytes(n.output, p, cfg, zero1_shards(n.fqn, cfg, experts),
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


def correct(memory: dict[str, float], correction: dict[str, float]) -> None:
    """Add ``correction`` (bytes by kind) to an ILP result's ``memory``."""
    for k, v in correction.items():
        memory[k] = memory.get(k, 0.0) + v


def state_floor(graph: Graph, layout: dict[str, tuple], cfg: MegatronConfig,
                 experts: Collection[str], optimizer: str, precision: Any) -> float:
    """A lower bound on parameter-state bytes of the fullest device: every
    parameter as the layout places it, split over pp (the fullest stage holds
    at least the average), held as Megatron holds it (:func:`_megatron_state_bytes`)."""
    total = 0.0
    for n in graph.nodes:
        if n.kind == PARAM:
            total += sum(_megatron_state_bytes(n.output, layout[n.fqn], cfg,
                                               zero1_shards(n.fqn, cfg, experts), optimizer,
                                               precision).values())
    return total / cfg.pp


def master_state_bytes(graph: Graph, layout: dict[str, tuple], cfg: MegatronConfig,
                       experts: Collection[str], dtype: Any) -> float:
    """Bytes per device of the fp32 master copy Megatron's optimizer keeps of
    ``graph``'s parameters as ``layout`` places them, each split over its
    :func:`zero1_shards` (one list of a state's size: the optimizer's
    temporaries at the step's peak)."""
    master = get_precision(dtype).master_bytes
    return sum(master * math.ceil(math.ceil(local_numel(n.output, layout[n.fqn], cfg.mesh_shape))
                                  / zero1_shards(n.fqn, cfg, experts))
               for n in graph.nodes if n.kind == PARAM)
