"""Which collectives of a compiled plan run inside its compiled graphs, and
which run outside them (plan.json ``training.compile_collectives``).

The runtime compiles each rank's program with its placements written in
(:mod:`codegen.lowered_program`): every reshard point of the plan is a
``redistribute`` in the program, and so a functional collective in the
compiled graph, which inductor can schedule and overlap with compute (its
backward's counterpart in the compiled backward graph; a checkpointed
layer's again in its recomputation). What runs outside the graphs, issued
by the runtime around them:

* the gradients' reduction over the data-parallel axis, per stage by its
  ZeRO stage: bucketed all-reduces after the backward (ZeRO-0); a
  reduce-scatter and, after the update, an all-gather of the parameters'
  slices (ZeRO-1, the distributed optimizer); FSDP2's all-gathers and
  reduce-scatters in its hooks around the compiled code (ZeRO-2 once per
  step, ZeRO-3 unit by unit);
* a pipeline's sends and receives between stages (its schedule's);
* context parallelism's K/V exchange across the cp group (ring or
  all-gather), which runs eager between the graphs.

The record is a function of the plan's other fields (the same plan gives the
same record); ``planner show`` prints it.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from costmodel.resharding import reshard_collectives

__all__ = ["GRADIENT_REDUCTION", "compiled_collectives"]

#: ZeRO stage -> the collectives reducing a stage's gradients (and gathering
#: its parameters again), outside the compiled graphs.
GRADIENT_REDUCTION = {0: ["all_reduce"], 1: ["reduce_scatter", "all_gather"],
                      2: ["all_gather", "reduce_scatter"], 3: ["all_gather", "reduce_scatter"]}


def compiled_collectives(plan: Any) -> dict[str, Any]:
    """``{"in_graph": {collective: count}, "outside_graph": {...}}`` of ``plan``
    (a :class:`plan.format.Plan`, which calls this from ``with_compile``)
    run compiled (see the module doc). ``in_graph`` counts the collectives of
    the plan's reshard points, one forward of every stage; ``outside_graph``
    names the gradient reduction (``gradient_reduction``: ZeRO stage -> its
    collectives, where any parameter is replicated over more than one
    device), the pipeline's ``p2p`` and context parallelism's exchange
    (``context_parallel``: ``p2p`` or ``all_gather``)."""
    pipe = plan.pipeline
    stage_mesh = list(pipe.stage_mesh["shape"]) if pipe is not None else list(plan.mesh_shape)
    in_graph: Counter[str] = Counter()
    for r in plan.reshards:
        in_graph.update(reshard_collectives(r.src, r.dst, stage_mesh))
    outside: dict[str, Any] = {}
    zero_stages = sorted({st.zero_stage for st in pipe.stages}) if pipe is not None else [0]
    replicated = any(p == "R" and size > 1 for placements in plan.parameters.values()
                     for p, size in zip(placements[-len(stage_mesh):], stage_mesh))
    if replicated or any(zero_stages):
        outside["gradient_reduction"] = {str(z): GRADIENT_REDUCTION[z] for z in zero_stages}
    if pipe is not None and len(pipe.stages) > 1:
        outside["p2p"] = "send_recv"
    cp = (plan.training or {}).get("context_parallel") or {}
    if int(cp.get("size", 1)) > 1:
        outside["context_parallel"] = str(cp.get("comm_type", "p2p"))
    return {"in_graph": dict(sorted(in_graph.items())), "outside_graph": outside}
