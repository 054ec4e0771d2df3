"""``planner profile``'s measurement of this runtime's own cost per op.

The cost model charges ``DeviceSpec.dispatch_overhead`` seconds for every op
pass the distributed runtime runs (:func:`costmodel.compute.dispatch_passes`).
What the runtime spends per op is more than DTensor's dispatch of a tiny op:
the node runner's work around each op (:class:`codegen.node_runner.NodeRunner`),
DTensor's sharding propagation on the ops real programs run (layer norms,
matmuls, views, attention, the loss) and autograd's bookkeeping of DTensors in
the backward. This rank program measures it as it runs: a training step
(forward and backward) of :data:`PROBE_MODEL`, small enough that the host
bounds it, run by this runtime with every value replicated over all ranks
(the same work on every rank, and no collective), against the same step of
the plain model. The difference over the step's op passes is the runtime's
cost per op pass.

``python -m codegen.runtime_probe SPEC.json RANK WORLD`` is one rank, started by
:func:`costmodel.profiling.run.measure` (``worker=__name__``) with the spec of
:func:`probe_spec`; the protocol is :mod:`costmodel.profiling.worker`'s, and so
is the timing (:class:`costmodel.profiling.worker.ItemRunner`). Units: seconds.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import torch

from codegen.parallel_model import parallelize
from codegen.pipeline_probe import measure_pipeline
from costmodel.cluster import Cluster
from costmodel.compute import dispatch_passes
from costmodel.profiling import profile_local
from costmodel.profiling.run import measure
from costmodel.profiling.runtime_costs import dropping_gradients
from costmodel.profiling.worker import ItemRunner, Rank, TimedItem, join, serve, timed_steps
from ir.graph import Graph
from ir.trace import trace
from models import zoo
from plan.format import Plan, SolverReport

__all__ = ["PROBE_MODEL", "measure_runtime", "probe_plan", "probe_spec", "profile_with_runtime"]

#: The zoo model whose step is timed: a GPT of two blocks, a few ms a step.
PROBE_MODEL = "gpt-tiny"


def probe_spec(device: str, backend: str, quick: bool) -> dict[str, Any]:
    """The spec of one probe over the ranks of ``device`` joined by ``backend``;
    ``quick`` takes fewer and shorter repetitions."""
    return {"device": device, "backend": backend, "threads": 1, "model": PROBE_MODEL,
            "reps": 3 if quick else 7, "min_rep_s": 0.05 if quick else 0.2}


def probe_plan(model: torch.nn.Module, graph: Graph, world: int, backend: str) -> Plan:
    """A plan that places nothing: every parameter, input and value of
    ``model``'s program (``graph``, its capture) replicated on a mesh of all
    ``world`` ranks, so each rank runs the whole step through DTensor and no
    collective moves data."""
    record = {"name": PROBE_MODEL, "source": PROBE_MODEL, "class": type(model).__name__,
              "fingerprint": graph.fingerprint(),
              "num_parameters": sum(p.numel() for p in model.parameters())}
    return Plan(model=record, cluster={"name": f"probe:{world}", "backend": backend},
                mesh={"shape": [world], "axis_names": ["probe"]}, parameters={}, inputs={}, nodes={},
                reshards=[], predicted={},
                solver=SolverReport("none", "NOT_SOLVED", 0.0, 0.0, 0.0, 0.0),
                training={"dtype": "float32", "precision": "fp32", "reduce_dtype": "float32"})


def _measure(rank: int, world: int, spec: dict[str, Any], report: Callable[[str], None]) -> dict[str, Any]:
    """Time the runtime's step and the plain step (``ItemRunner``'s protocol);
    ``{"runtime": {"model", "passes", "runtime": record, "plain": record}}``."""
    r: Rank = join(rank, world, spec)
    name = spec["model"]
    meta_model, meta_inputs = zoo.build(name, device="meta")
    graph = trace(meta_model, meta_inputs)
    plan = probe_plan(meta_model, graph, world, spec["backend"])
    passes = dispatch_passes(graph)
    torch.manual_seed(0)
    model, inputs = zoo.build(name, device=str(r.device))
    parallel = parallelize(plan, model, inputs)
    torch.manual_seed(0)
    plain, plain_inputs = zoo.build(name, device=str(r.device))
    out = {"model": name, "passes": passes, "runtime": {}, "plain": {}}
    items = [TimedItem("runtime step", dropping_gradients(lambda: parallel.step(*inputs), parallel.parameters),
                       spec["min_rep_s"], False, out["runtime"]),
             TimedItem("plain step", dropping_gradients(lambda: plain(*plain_inputs).backward(), plain.parameters),
                       spec["min_rep_s"], False, out["plain"])]
    ItemRunner(r.torch, r.dist, r.device, world, int(spec["reps"]), report).run(items)
    if r.dist.is_initialized():
        r.dist.barrier()
        r.dist.destroy_process_group()
    return {"runtime": out}


def measure_runtime(ranks: int, device: str, backend: str, quick: bool,
                    progress: bool) -> dict[str, Any]:
    """Run the probe on ``ranks`` ranks of ``device``; the raw ``runtime``
    section :func:`costmodel.profiling.build.dispatch_overhead` reads. Empty
    with one rank (the runtime then runs plain tensors, as plans of one
    device do) and on GPUs (whose plans charge the host's time per op,
    ``DeviceSpec.host_overhead``, instead)."""
    if ranks < 2 or device != "cpu":
        return {}
    spec = probe_spec(device, backend, quick)
    return measure(spec, ranks, progress=progress, description="timing the runtime",
                   worker=__name__, steps=timed_steps(2, spec))


def profile_with_runtime(ranks: int, out_path: str | os.PathLike, *, quick: bool = False,
                         progress: bool = True) -> Cluster:
    """``planner profile``: :func:`costmodel.profiling.profile_local` with this
    runtime's cost per op measured by the probe, and its pipeline's cost per
    action by :mod:`codegen.pipeline_probe`."""
    return profile_local(ranks, out_path, quick=quick, progress=progress,
                         probes=(measure_runtime, measure_pipeline))


if __name__ == "__main__":
    serve(_measure, __name__)
