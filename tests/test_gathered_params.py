"""A parameter DTensor stores sharded over the data axis is gathered whole by
each op that reads it, and the op's backward keeps that copy: the step's
memory counts it (:meth:`costmodel.strategy_memory.MemoryPricing.parameter_gathers`),
and a plan under a memory budget holds it within the budget
(:func:`planner.ilp.intra_op.solve_prepared`)."""

from __future__ import annotations

import pytest
from torch.distributed.tensor import Replicate, Shard

from costmodel.presets import load_cluster
from costmodel.strategy_cost import IntraOpCost
from ir.graph import PARAM
from ir.placements import parse_placements
from ir.strategy import Strategy
from ir.trace import trace
from models.source import build_model
from planner.api import plan


MATMULS = ("aten.mm.default", "aten.addmm.default")


def _weight_and_matmul(graph):
    """A 2-D weight of a layer that a matmul keeps (read through its
    transpose), that reader, and the layer."""
    users = graph.users()
    for layer in graph.layers:
        for node in graph.nodes:
            if node.kind != PARAM or len(node.output.shape) != 2:
                continue
            reader = graph[users[node.name][0]]
            if reader.is_view and any(graph[u].target in MATMULS and u in layer.nodes
                                      for u in users[reader.name]):
                return node, reader, layer
    raise AssertionError("no weight read by a matmul")


@pytest.mark.parametrize("precision,copy_bytes", [("float32", 4), ("bf16-mixed", 2)])
def test_a_weight_sharded_over_the_data_axis_keeps_its_gathered_copy(precision, copy_bytes):
    model, inputs = build_model("gpt-tiny", device="meta")
    graph = trace(model, inputs)
    weight, reader, layer = _weight_and_matmul(graph)
    numel = weight.output.numel
    cost = IntraOpCost(graph, load_cluster("local-cpu:4"), (4,), precision, "adam")
    whole = {reader.name: Strategy(inputs=((Replicate(),),), outputs=((Replicate(),),))}
    sharded = Strategy(inputs=(), outputs=((Shard(0),),))
    # the reader takes it whole: a copy of the whole weight in the compute dtype,
    # less (under a mixed precision) the local cast it was gathered from
    local_cast = numel / 4 * 2 if precision == "bf16-mixed" else 0
    assert cost.parameter_gathers(weight, sharded, whole) == copy_bytes * numel - local_cast
    # stored as the reader takes it (replicated; or sharded alike, as an
    # expert weight split by experts is): nothing gathered
    assert cost.parameter_gathers(weight, Strategy(inputs=(), outputs=((Replicate(),),)), whole) == 0
    alike = {reader.name: Strategy(inputs=((Shard(0),),), outputs=((Shard(1),),))}
    assert cost.parameter_gathers(weight, sharded, alike) == 0
    # a checkpointed layer gathers it again when it is recomputed
    assert cost.parameter_gathers(weight, sharded, whole, [layer.name]) == 0


def test_a_budgeted_plan_counts_and_fits_its_gathered_weights():
    """gpt-tiny on 4 ranks under 90 % of its unconstrained memory: the search
    stores weights sharded over the data axis (their optimizer states split),
    which each matmul gathers whole. The plan's activations are what its ops
    keep plus those gathered copies, and with them it fits the budget."""
    model, inputs = build_model("gpt-tiny", device="meta")
    options = dict(example_inputs=inputs, mesh_shape=(4,), model_source="gpt-tiny",
                   zoo_kwargs={"batch_size": 64}, time_limit_s=20)
    free = plan(model, "local-cpu:4", **options)
    budget = 0.9 * free.predicted["memory_bytes_per_device"]["total"]
    fitted = plan(model, "local-cpu:4", memory_budget=budget, **options)
    assert not fitted.checkpoint
    graph = trace(model, inputs)
    cost = IntraOpCost(graph, load_cluster("local-cpu:4"), (4,), "float32", "adam")
    chosen = {n.name: Strategy(inputs=(), outputs=(tuple(parse_placements(fitted.parameters[n.fqn])),))
              for n in graph.nodes if n.kind == PARAM}
    chosen.update({n.name: Strategy(inputs=(), outputs=(tuple(parse_placements(fitted.inputs[n.name])),))
                   for n in graph.nodes if n.name in fitted.inputs})
    chosen.update({name: Strategy(inputs=tuple(tuple(parse_placements(x)) for x in op.inputs),
                                  outputs=tuple(tuple(parse_placements(x)) for x in op.outputs))
                   for name, op in fitted.nodes.items()})
    gathered = cost.gathered_parameter_bytes(chosen)
    assert gathered > 0, "expected weights sharded over the data axis"
    kept = sum(cost.memory_breakdown(n, chosen[n.name]).get("activations", 0.0)
               for n in graph.nodes if n.name in chosen)
    memory = fitted.predicted["memory_bytes_per_device"]
    assert memory["activations"] == pytest.approx(kept + gathered, rel=1e-9)
    assert memory["total"] <= budget
