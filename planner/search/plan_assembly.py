"""Plan assembly: an intra-op solution written as a :class:`Plan`.

The sections of plan.json that say what a plan was made for (``model``,
``training``) and what it predicts (``predicted``: seconds, and bytes per
device), from one solved single-stage program; pipelines assemble their
stages' plans (:func:`planner.search.finalists.assemble`) from these.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from costmodel.cluster import Cluster
from costmodel.compute import compiled_call_seconds, host_seconds, pass_seconds
from costmodel.memory import step_peak_bytes
from costmodel.strategy_cost import IntraOpCost
from ir.graph import INPUT, OP, PARAM, Graph
from ir.placements import placement_strs
from ir.strategy import moved_arguments
from ir.precision import Precision, get_precision
from planner.ilp.intra_op import IntraOpResult
from plan.format import (ModelRecord, OpPlacement, Plan, Reshard, SolverReport,
                                 TrainingRecord, training_precision)

__all__ = ["WholeBatchPrice", "build_plan", "model_record", "step_copy_of", "training_record",
           "whole_batch_peak", "whole_batch_price"]


def _memory_report(memory: dict[str, float], peak: float | None = None) -> dict[str, int]:
    """Bytes per device by kind; ``total`` their sum (what the plan's memory
    budget bounds), ``peak`` the predicted peak of the step (``total`` unless
    given: see :func:`costmodel.memory.step_peak_bytes`)."""
    out = {k: int(round(v)) for k, v in sorted(memory.items())}
    out["total"] = sum(out.values())
    out["peak"] = out["total"] if peak is None else int(round(peak))
    return out


def model_record(model: torch.nn.Module, graph: Graph, model_source: str | None) -> ModelRecord:
    """The plan's ``model`` section: what the plan was made for."""
    return {"name": model_source or type(model).__name__, "source": model_source,
            "class": type(model).__name__, "fingerprint": graph.fingerprint(),
            "num_parameters": graph.num_parameters}


def training_record(precision: str | Precision, optimizer: str, example_inputs: Sequence[Any],
                    zoo_kwargs: dict[str, Any] | None, **extra: Any) -> TrainingRecord:
    """The plan's ``training`` section: step shapes and settings the prediction
    assumed. ``dtype`` is the compute dtype, ``precision`` the training
    precision's name and ``reduce_dtype`` the gradient reduction dtype."""
    p = get_precision(precision)
    return {"dtype": p.compute_dtype_name, "precision": p.name,
            "reduce_dtype": str(p.reduce_dtype).replace("torch.", ""), "optimizer": optimizer,
            "input_shapes": [list(t.shape) if isinstance(t, torch.Tensor) else None
                             for t in example_inputs],
            "zoo_kwargs": dict(sorted((zoo_kwargs or {}).items())), **extra}


def whole_batch_peak(result: IntraOpResult, cost: IntraOpCost, training: TrainingRecord) -> float:
    """Predicted peak bytes per device of a step that runs ``result``'s
    program on the whole batch at once with whole gradients (ZeRO 0 or 1)
    (:func:`costmodel.memory.step_peak_bytes`: activations and gradients peak
    apart, the backward's timeline, the forward's worst redistribute);
    ``cost`` prices ``result``'s mesh at its ZeRO stage."""
    return step_peak_bytes(result.memory, training.get("optimizer", "adam"),
                           step_copy=step_copy_of(result, cost),
                           backward_excess=cost.backward_excess(result.chosen, result.checkpointed),
                           forward_excess=cost.forward_reshard_excess(result.chosen))


@dataclass(frozen=True)
class WholeBatchPrice:
    """Seconds of a step that runs one intra-op solution on the whole batch:
    ``step_s`` in all; of it, ``sync_latency_s`` the per-message latency of
    the step's gradient collectives over mesh axis 0, which the ILP's
    objective leaves out; ``host_s`` and ``call_s`` what the host takes to
    issue its eager ops and to call its compiled regions
    (:func:`costmodel.compute.pass_seconds`)."""

    step_s: float
    sync_latency_s: float
    host_s: float
    call_s: float


def whole_batch_price(result: IntraOpResult, cost: IntraOpCost, *,
                      sync_latency: bool = True) -> WholeBatchPrice:
    """The step seconds of ``result`` run on the whole batch, priced as
    :func:`planner.search.stage_dp.stage_times` prices a single stage: the
    device's time (the ILP's objective) with the latency of the step's one
    gradient reduction (each parameter's share of it,
    :meth:`IntraOpCost.state_collectives`, leaves that out), unless the host
    issues the step's ops, and calls a compiled program, more slowly than the
    device runs them. ``cost`` prices ``result``'s mesh. ``sync_latency``
    False: without that latency, for one micro-batch of a pipeline's stage
    (the pipeline's times pay it once, in ``StageTimes.grad_sync_s``)."""
    graph = result.graph
    device = cost.cluster.device
    zero_bytes = sum(cost.zero_bytes(n, result.chosen[n.name]) for n in graph.nodes
                     if n.kind == PARAM)
    latency = cost.step_sync_latency(zero_bytes) if sync_latency else 0.0
    host_s = sum(host_seconds(graph, device))
    call_s = sum(compiled_call_seconds(graph, device, cost.region_calls(result.checkpointed)))
    return WholeBatchPrice(pass_seconds(result.solution.objective_s + latency, host_s, call_s,
                                        device), latency, host_s, call_s)


def step_copy_of(result: IntraOpResult, cost: IntraOpCost) -> float:
    """Bytes of ``result``'s parameters that its step frees before the
    optimizer step (:meth:`IntraOpCost.step_copy` summed over them)."""
    return sum(cost.step_copy(n, result.chosen[n.name]) for n in result.graph.nodes
               if n.kind == PARAM)


def build_plan(result: IntraOpResult, cluster: Cluster, model_info: ModelRecord,
               training: TrainingRecord, whole_batch: bool = False) -> Plan:
    """Turn an intra-op solution into a Plan. ``whole_batch``: the step runs
    the whole batch at once (no micro-batches), which lets gradients and
    activations peak apart (:func:`costmodel.memory.step_peak_bytes`) and pays
    its gradient reduction's latency (:func:`whole_batch_price`); else the
    plan is one micro-batch of a pipeline's stage."""
    graph, chosen = result.graph, result.chosen
    parameters = {n.fqn: placement_strs(chosen[n.name].outputs[0]) for n in graph.nodes if n.kind == PARAM}
    inputs = {n.name: placement_strs(chosen[n.name].outputs[0]) for n in graph.nodes if n.kind == INPUT}
    nodes: dict[str, OpPlacement] = {}
    reshards: list[Reshard] = []
    cost = IntraOpCost(graph, cluster, result.mesh_shape, training_precision(training))
    for n in graph.nodes:
        if n.kind != OP:
            continue
        s = chosen[n.name]
        nodes[n.name] = OpPlacement(op=n.target, module=n.module_path,
                                    inputs=[placement_strs(p) for p in s.inputs],
                                    outputs=[placement_strs(p) for p in s.outputs])
        for _, arg, idx, src, dst in moved_arguments(n, s, chosen):
            reshards.append(Reshard(node=n.name, arg=arg, module=n.module_path,
                                    src=placement_strs(src), dst=placement_strs(dst),
                                    time_s=cost.reshard(src, dst, graph[arg].outputs[idx])))
    sol = result.solution
    b = result.breakdown
    price = whole_batch_price(result, cost, sync_latency=whole_batch)
    predicted = {
        "step_time_s": price.step_s,
        "compute_s": b.compute_s,
        "communication_s": b.communication_s + price.sync_latency_s,
        "resharding_s": b.resharding_s,
        **({"host_s": price.host_s} if price.host_s > 0 else {}),
        **({"compiled_call_s": price.call_s} if price.call_s > 0 else {}),
        "memory_bytes_per_device": _memory_report(
            result.memory, whole_batch_peak(result, cost, training) if whole_batch else None),
    }
    return Plan(
        model=model_info, cluster=cluster.to_dict(),
        mesh={"shape": list(result.mesh_shape),
              "axis_names": [f"mesh{i}" for i in range(len(result.mesh_shape))]},
        parameters=parameters, inputs=inputs, nodes=nodes, reshards=reshards,
        predicted=predicted,
        solver=SolverReport(solver=sol.solver, status=sol.status, objective_s=sol.objective_s,
                            bound_s=sol.bound_s, gap=sol.gap, time_limit_s=result.time_limit_s,
                            num_variables=sol.num_variables,
                            num_constraints=sol.num_constraints),
        training=training, checkpoint=list(result.checkpointed))
