"""``planner profile``'s measurement of a pipeline action in this runtime.

The cost model adds ``DeviceSpec.pipeline_action_overhead`` seconds to every
forward and backward a pipeline schedule runs (and, for a program run through
``torch.compile``, ``DeviceSpec.compiled_pipeline_action_overhead``). What an
action costs beyond its stage's own work is the schedule's bookkeeping, the
posting of its sends and receives and the waits for them, and what torch's
stage does around the stage's module. Timed on torch's stage around a plain
linear layer (:func:`costmodel.profiling.runtime_costs.pipeline_steps`), it
leaves out how this runtime's stages run inside the schedule.

This rank program measures it as it runs: :data:`PROBE_MODEL` cut into two
stages of a 1F1B schedule of :data:`PROBE_MICROBATCHES` micro-batches, every
value replicated over each stage's ranks (:func:`pipeline_probe_plan`), run
by :class:`codegen.pipeline.PipelineRuntime`, eager and compiled. Beside the
schedule's step it times each rank's stage alone, the same micro-batches'
forwards (and, separately, forwards and backwards) through the same stage
module, no schedule around it. :func:`costmodel.profiling.runtime_costs.runtime_pipeline_action`
fits the seconds per action that the schedule's timing model needs, with
those stage times, to give the measured step.

``python -m codegen.pipeline_probe SPEC.json RANK WORLD`` is one rank, started
by :func:`costmodel.profiling.run.measure` (``worker=__name__``); the protocol
and the timing are :mod:`costmodel.profiling.worker`'s. Units: seconds, bytes.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from codegen.pipeline import PipelineRuntime, split_microbatches
from costmodel.profiling.run import measure
from costmodel.profiling.runtime_costs import dropping_gradients
from costmodel.profiling.worker import ItemRunner, Rank, TimedItem, join, serve, timed_steps
from ir.graph import Graph
from ir.node import OP
from ir.layers import pipeline_layers
from ir.subgraph import boundary_values
from ir.trace import trace
from models import zoo
from plan.format import OpPlacement, PipelinePlan, Plan, SolverReport, StagePlan

__all__ = ["PROBE_MICROBATCHES", "PROBE_MODEL", "PROBE_SCHEDULE", "RUNTIMES", "measure_pipeline",
           "pipeline_probe_plan"]

#: The zoo model the probe pipelines: a GPT of two blocks.
PROBE_MODEL = "gpt-tiny"

#: The schedule and micro-batches of the probe's step.
PROBE_SCHEDULE = "1f1b"
PROBE_MICROBATCHES = 8

#: Sequences in each micro-batch (not 1: torch specialises size-1 dimensions).
_MICROBATCH_ROWS = 2

#: The runtimes timed: eager, and through ``torch.compile``.
RUNTIMES = ("eager", "compiled")


def pipeline_probe_plan(graph: Graph, world: int, backend: str) -> Plan:
    """A two-stage 1F1B plan of ``graph`` (the probe model's program at
    micro-batch shapes): its pipeline layers cut in half, each stage on
    ``world // 2`` ranks with every value replicated (no collective inside a
    stage; the stages' sends are the only communication)."""
    layers = pipeline_layers(graph, 2)
    bounds = boundary_values(graph, [layer.ops for layer in layers])
    size, cut = world // 2, len(layers) // 2
    stages = []
    for s, (a, b) in enumerate(((0, cut), (cut, len(layers)))):
        stages.append(StagePlan(
            index=s, pp_rank=s, layers=[layer.name for layer in layers[a:b]],
            nodes=[op for layer in layers[a:b] for op in layer.ops],
            ranks=list(range(s * size, (s + 1) * size)),
            inputs={name: ["R"] for name in bounds[a][0]},
            outputs={name: ["R"] for name in bounds[b - 1][1]}))
    # every op's values replicated: a tensor an op makes (positions, say) is
    # then a DTensor like the rest, as the compiled program needs
    nodes = {n.name: OpPlacement(n.target, n.module_path, [["R"] for _ in n.inputs],
                                 [["R"] for _ in n.outputs])
             for n in graph.nodes if n.kind == OP}
    record = {"name": PROBE_MODEL, "source": PROBE_MODEL, "class": "probe",
              "fingerprint": graph.fingerprint()}
    m = PROBE_MICROBATCHES
    return Plan(model=record, cluster={"name": f"probe:{world}", "backend": backend},
                mesh={"shape": [2, size], "axis_names": ["pp", "probe"]}, parameters={}, inputs={},
                nodes=nodes, reshards=[], predicted={},
                solver=SolverReport("none", "NOT_SOLVED", 0.0, 0.0, 0.0, 0.0),
                training={"dtype": "float32", "precision": "fp32", "reduce_dtype": "float32",
                          "microbatch_size": _MICROBATCH_ROWS, "global_batch": _MICROBATCH_ROWS * m},
                pipeline=PipelinePlan(schedule=PROBE_SCHEDULE, num_microbatches=m, stages_per_rank=1,
                                      stage_mesh={"shape": [size], "axis_names": ["probe"]},
                                      stages=stages))


def _sent_bytes(graph: Graph, plan: Plan) -> int:
    """Bytes the first stage sends the second per micro-batch."""
    return sum(graph[name].outputs[0].nbytes for name in plan.pipeline.stages[0].outputs)


def _stage_alone(runtime: PipelineRuntime, inputs: tuple, backward: bool) -> Callable[[], None]:
    """This rank's stage on every micro-batch through its module alone, no
    schedule: the forward, and with ``backward`` the backward from gradients of
    ones (the last stage's loss from its own backward)."""
    m = runtime.num_microbatches
    microbatches = split_microbatches(inputs, m)
    module, executor = runtime.modules[0], runtime.executors[0]
    executor.microbatches = microbatches
    if executor.is_first:
        args = [microbatches[i] for i in range(m)]
    else:
        received = [torch.zeros_like(t).requires_grad_(t.is_floating_point())
                    for t in executor.example_inputs(microbatches[0])]
        args = [received] * m

    def run() -> None:
        for i in range(m):
            executor.microbatch_index = i
            out = module(*args[i])
            outs = [o for o in (out if isinstance(out, tuple) else (out,)) if o.requires_grad]
            if backward:
                torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
    return run


def _eager_regions(r: Rank, runtime: PipelineRuntime) -> list[str]:
    """Every rank's log lines of the regions that ran eager though the plan
    compiles (a figure timed so is not the compiled runtime's)."""
    mine = [outcome.line() for executor in runtime.executors
            for outcome in executor.compile_report.regions if not outcome.compiled]
    if r.world == 1:
        return mine
    every: list[list[str]] = [[] for _ in range(r.world)]
    r.dist.all_gather_object(every, mine)
    return [line for lines in every for line in lines]


def _measure(rank: int, world: int, spec: dict[str, Any], report: Callable[[str], None]) -> dict[str, Any]:
    """Time each runtime's pipelined step and its stages alone (``ItemRunner``'s
    protocol); ``{"runtime_pipeline": {...}}``."""
    r: Rank = join(rank, world, spec)
    m = PROBE_MICROBATCHES
    meta_model, meta_inputs = zoo.build(PROBE_MODEL, device="meta", batch_size=_MICROBATCH_ROWS)
    graph = trace(meta_model, meta_inputs)
    plan = pipeline_probe_plan(graph, world, spec["backend"])
    out: dict[str, Any] = {"model": PROBE_MODEL, "schedule": PROBE_SCHEDULE, "stages": 2,
                           "microbatches": m, "activation_bytes": _sent_bytes(graph, plan)}
    items, runtimes = [], {}
    for kind in spec["runtimes"]:
        torch.manual_seed(0)
        model, inputs = zoo.build(PROBE_MODEL, device=str(r.device), batch_size=_MICROBATCH_ROWS * m)
        runtime = PipelineRuntime.build(plan.with_compile(kind == "compiled"), model, inputs, r.device)
        runtimes[kind] = runtime
        params = lambda rt=runtime: [p for _, p in rt.named_parameters()]  # noqa: E731
        out[kind] = {"forward": {}, "stage": {}, "pipelined": {}}
        items += [TimedItem(f"{kind} pipelined step",
                            dropping_gradients(lambda rt=runtime, x=inputs: rt.step(x), params),
                            spec["min_rep_s"], True, out[kind]["pipelined"]),
                  TimedItem(f"{kind} stage forwards", dropping_gradients(
                      _stage_alone(runtime, inputs, False), params), spec["min_rep_s"], False,
                      out[kind]["forward"]),
                  TimedItem(f"{kind} stage alone", dropping_gradients(
                      _stage_alone(runtime, inputs, True), params), spec["min_rep_s"], False,
                      out[kind]["stage"])]
    ItemRunner(r.torch, r.dist, r.device, world, int(spec["reps"]), report).run(items)
    for kind, runtime in runtimes.items():
        out[kind]["eager_regions"] = _eager_regions(r, runtime)
    if r.dist.is_initialized():
        r.dist.barrier()
        r.dist.destroy_process_group()
    return {"runtime_pipeline": out}


def measure_pipeline(ranks: int, device: str, backend: str, quick: bool, progress: bool, *,
                     runtimes: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the probe on ``ranks`` ranks of ``device`` (an even count); the raw
    ``runtime_pipeline`` section that
    :func:`costmodel.profiling.runtime_costs.runtime_pipeline_action` reads.
    Empty with an odd rank count or one rank, and on GPUs (not yet run there:
    their plans keep the action fitted on torch's schedule,
    :func:`costmodel.profiling.runtime_costs.pipeline_steps`). ``runtimes``:
    of :data:`RUNTIMES`, by default both, and with ``quick`` the eager one
    alone (compiling takes tens of seconds on a CPU)."""
    if ranks < 2 or ranks % 2 or device != "cpu":
        return {}
    chosen = list(runtimes or (RUNTIMES[:1] if quick else RUNTIMES))
    unknown = sorted(set(chosen) - set(RUNTIMES))
    if unknown:
        raise ValueError(f"runtime {unknown[0]!r} is not one of {', '.join(RUNTIMES)}")
    spec = {"device": device, "backend": backend, "threads": 1, "reps": 3 if quick else 7,
            "min_rep_s": 0.05 if quick else 0.2, "runtimes": chosen}
    return measure(spec, ranks, progress=progress, description="timing the pipeline runtime",
                   worker=__name__, steps=timed_steps(3 * len(chosen), spec))


if __name__ == "__main__":
    serve(_measure, __name__)
