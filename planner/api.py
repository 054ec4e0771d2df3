"""The public entry point: ``plan(model, cluster, ...)`` -> :class:`planner.plan_format.Plan`."""

from __future__ import annotations

import functools
import gc
import math
from typing import Any, Callable, Sequence, TypeVar

import torch

from costmodel.cluster import Cluster, load_cluster
from costmodel.memory import reserve_bytes, step_peak_bytes
from costmodel.resharding import placement_str
from costmodel.schedules import release_orders
from ir.graph import INPUT, OP, PARAM, Graph
from ir.layers import block_count, manual_bounds
from ir.precision import Precision, compute_copy, get_precision, precision_of_dtype
from ir.trace import trace
from planner.forked import run_beside
from planner.intra_op import IntraOpCost, IntraOpResult, MemoryInfeasibleError, solve_intra_op
from planner.plan_format import OpPlacement, Plan, Reshard, SolverReport, training_precision


# Fraction of device memory kept free for the allocator's fragmentation and workspaces.
MEMORY_RESERVE = 0.1


class PlanningError(ValueError):
    """The request cannot be planned; the message says what to change."""


def _strs(placements) -> list[str]:
    return [placement_str(p) for p in placements]


def mesh_candidates(num_devices: int) -> list[tuple[int, ...]]:
    """Logical mesh shapes tried when the user gives none: (N,) and every (a, N/a)."""
    shapes: list[tuple[int, ...]] = [(num_devices,)]
    for a in range(2, num_devices):
        if num_devices % a == 0:
            shapes.append((a, num_devices // a))
    return shapes


def _check_mesh(mesh_shape: Sequence[int], cluster: Cluster) -> tuple[int, ...]:
    shape = tuple(int(d) for d in mesh_shape)
    if not shape or any(d < 1 for d in shape):
        raise PlanningError(f"mesh {mesh_shape} must be positive sizes such as 2x2")
    size = 1
    for d in shape:
        size *= d
    if size != cluster.num_devices:
        raise PlanningError(
            f"mesh {'x'.join(map(str, shape))} has {size} devices but cluster "
            f"'{cluster.name}' has {cluster.num_devices}; give a mesh whose sizes multiply "
            f"to {cluster.num_devices}")
    return shape


def default_precision(model: torch.nn.Module, cluster: Cluster) -> Precision:
    """The precision a step trains in when nobody names one: ``bf16-mixed`` on
    GPU clusters (what Megatron-LM and torchtitan run), ``fp16-mixed`` on GPUs
    without bf16 units (V100); on CPU ranks (gloo) the model's own dtype
    (``fp32``, or ``bf16`` for a model in bf16)."""
    if cluster.backend != "gloo":
        bf16 = "bfloat16" in cluster.device.peak_flops
        return get_precision("bf16-mixed" if bf16 else "fp16-mixed")
    dtypes = [p.dtype for p in model.parameters() if p.is_floating_point()]
    return precision_of_dtype(dtypes[0] if dtypes else torch.float32)


def resolve_precision(model: torch.nn.Module, cluster: Cluster,
                      precision: str | Precision | None) -> Precision:
    """``precision`` as a :class:`Precision` (its default when None).

    Raises:
        PlanningError: an unknown name, or fp32/bf16-mixed master weights asked of a
            model whose parameters are bf16 (their fp32 values are gone).
    """
    if precision is None:
        return default_precision(model, cluster)
    try:
        chosen = get_precision(precision)
    except ValueError as err:
        raise PlanningError(str(err)) from None
    half = next((p.dtype for p in model.parameters()
                 if p.dtype in (torch.bfloat16, torch.float16)), None)
    if chosen.master_dtype == torch.float32 and half is not None:
        name = "bf16" if half == torch.bfloat16 else "fp16"
        raise PlanningError(f"precision {chosen.name} keeps fp32 master parameters but the "
                            f"model's parameters are {name}; give the fp32 model"
                            + (", or plan with precision='bf16'" if name == "bf16" else ""))
    return chosen


def _memory_report(memory: dict[str, float], peak: float | None = None) -> dict[str, int]:
    """Bytes per device by kind; ``total`` their sum (what the plan's memory
    budget bounds), ``peak`` the predicted peak of the step (``total`` unless
    given: see :func:`costmodel.memory.step_peak_bytes`)."""
    out = {k: int(round(v)) for k, v in sorted(memory.items())}
    out["total"] = sum(out.values())
    out["peak"] = out["total"] if peak is None else int(round(peak))
    return out


def default_memory_budget(cluster: Cluster) -> float:
    """Bytes per device a plan may use: device memory less the allocator reserve."""
    return float(cluster.device.memory - reserve_bytes(cluster.device.memory, MEMORY_RESERVE))


def model_record(model: torch.nn.Module, graph: Graph, model_source: str | None) -> dict[str, Any]:
    """The plan's ``model`` section: what the plan was made for."""
    return {"name": model_source or type(model).__name__, "source": model_source,
            "class": type(model).__name__, "fingerprint": graph.fingerprint(),
            "num_parameters": graph.num_parameters}


def training_record(precision: str | Precision, optimizer: str, example_inputs: Sequence[Any],
                    zoo_kwargs: dict[str, Any] | None, **extra: Any) -> dict[str, Any]:
    """The plan's ``training`` section: step shapes and settings the prediction
    assumed. ``dtype`` is the compute dtype, ``precision`` the training
    precision's name and ``reduce_dtype`` the gradient reduction dtype."""
    p = get_precision(precision)
    return {"dtype": p.compute_dtype_name, "precision": p.name,
            "reduce_dtype": str(p.reduce_dtype).replace("torch.", ""), "optimizer": optimizer,
            "input_shapes": [list(t.shape) if isinstance(t, torch.Tensor) else None
                             for t in example_inputs],
            "zoo_kwargs": dict(sorted((zoo_kwargs or {}).items())), **extra}


def build_plan(result: IntraOpResult, cluster: Cluster, model_info: dict[str, Any],
               training: dict[str, Any], whole_batch: bool = False) -> Plan:
    """Turn an intra-op solution into a Plan. ``whole_batch``: the step runs
    the whole batch at once (no micro-batches), which lets gradients and
    activations peak apart (:func:`costmodel.memory.step_peak_bytes`)."""
    graph, chosen = result.graph, result.chosen
    parameters = {n.fqn: _strs(chosen[n.name].outputs[0]) for n in graph.nodes if n.kind == PARAM}
    inputs = {n.name: _strs(chosen[n.name].outputs[0]) for n in graph.nodes if n.kind == INPUT}
    nodes: dict[str, OpPlacement] = {}
    reshards: list[Reshard] = []
    cost = IntraOpCost(graph, cluster, result.mesh_shape, training_precision(training))
    for n in graph.nodes:
        if n.kind != OP:
            continue
        s = chosen[n.name]
        nodes[n.name] = OpPlacement(op=n.target, module=n.module_path,
                                    inputs=[_strs(p) for p in s.inputs],
                                    outputs=[_strs(p) for p in s.outputs])
        for k, arg in enumerate(n.args):
            producer = graph[arg]
            idx = n.arg_index if n.target == "getitem" else 0
            src = chosen[arg].outputs[idx]
            if src != s.inputs[k]:
                info = producer.outputs[idx]
                reshards.append(Reshard(node=n.name, arg=arg, module=n.module_path,
                                        src=_strs(src), dst=_strs(s.inputs[k]),
                                        time_s=cost.reshard(src, s.inputs[k], info)))
    sol = result.solution
    b = result.breakdown
    predicted = {
        "step_time_s": sol.objective_s,
        "compute_s": b.compute_s,
        "communication_s": b.communication_s,
        "resharding_s": b.resharding_s,
        "memory_bytes_per_device": _memory_report(
            result.memory, step_peak_bytes(result.memory, training.get("optimizer", "adam"))
            if whole_batch else None),
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


_Fn = TypeVar("_Fn", bound=Callable[..., Any])


def _planning(fn: _Fn) -> _Fn:
    """``fn``, a search, with Python's cyclic garbage collector paused while
    it runs (as it was before afterwards), and the schedule orders it made
    released after it (:func:`costmodel.schedules.release_orders`; ~400 MB
    for gpt3-175b on 1024 GPUs).

    Reference counting still frees almost all a search makes; the objects it
    leaves in reference cycles (~50 MB for llama3-8b on 64 GPUs and
    gpt3-175b on 1024) wait for the next collection after it. Each full
    collection walks every live object (the programs, profiles and schedule
    orders: ~1 M), and they were ~1.5 s of a llama3-8b plan's 19.3 s and
    ~4.8 s of gpt3-175b's 29.6 s here."""
    @functools.wraps(fn)
    def planning(*args: Any, **kwargs: Any) -> Any:
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            release_orders()
            if was_enabled:
                gc.enable()
    return planning  # type: ignore[return-value]


def _two_processes(here: Callable[[], Any], there: Callable[[], Any]) -> tuple[Any, Any]:
    """``(here(), there())``, ``there`` run by a forked child meanwhile
    (:func:`planner.forked.run_beside`): the first capture's two probes take
    both cores, while nothing else can run yet (llama3-8b: ~1 s each)."""
    done_here, done_there, _, _ = run_beside(here, there)
    return done_here, done_there


def _prepare(model: torch.nn.Module, cluster: Cluster | str, example_inputs: Any,
             memory_budget: float | None, precision: str | Precision | None = None
             ) -> tuple[torch.nn.Module, Cluster, tuple, Graph, Precision, float]:
    """The model and inputs as the step runs them (floating tensors in the
    precision's compute dtype: :func:`ir.precision.compute_copy`, the caller's
    model untouched), the cluster, the captured program, the precision
    and the memory budget (bytes per device)."""
    if isinstance(cluster, str):
        cluster = load_cluster(cluster)
    if not isinstance(example_inputs, (tuple, list)):
        example_inputs = (example_inputs,)
    for i, t in enumerate(example_inputs):
        if isinstance(t, torch.Tensor) and 0 in t.shape:
            raise PlanningError(f"example input {i} has shape {list(t.shape)}, with an empty "
                                f"dimension: give a batch and sequence of at least one")
    chosen = resolve_precision(model, cluster, precision)
    model, example_inputs = compute_copy(model, tuple(example_inputs), chosen)
    graph = trace(model, tuple(example_inputs), beside=_two_processes)
    if not graph.parameters:
        raise PlanningError(f"{type(model).__name__} has no parameters to shard")
    loss = graph[graph.output_names[0]].outputs[0] if graph.output_names else None
    if loss is None or loss.numel != 1:
        raise PlanningError(
            f"{type(model).__name__}'s forward returns "
            f"{'nothing' if loss is None else f'a tensor of shape {list(loss.shape)}'}, not "
            f"the scalar training loss the planner trains; return the loss (for example "
            f"F.cross_entropy(logits, targets)) from forward")
    budget = default_memory_budget(cluster) if memory_budget is None else float(memory_budget)
    return model, cluster, tuple(example_inputs), graph, chosen, budget


def _best_single_stage(graph: Graph, cluster: Cluster, shapes: list[tuple[int, ...]], dtype: str,
                       time_limit_s: float, budget: float, optimizer: str,
                       recompute: bool | None = None
                       ) -> tuple[IntraOpResult | None, list[MemoryInfeasibleError]]:
    best: IntraOpResult | None = None
    too_big: list[MemoryInfeasibleError] = []
    for shape in shapes:
        try:
            result = solve_intra_op(graph, cluster, shape, dtype=dtype, time_limit_s=time_limit_s,
                                    memory_budget=budget, optimizer=optimizer,
                                    recompute=recompute)
        except MemoryInfeasibleError as err:
            too_big.append(err)
            continue
        if best is None or result.solution.objective_s < best.solution.objective_s:
            best = result
    return best, too_big


def _check_zero_stages(zero_stages: Sequence[int] | None) -> list[int] | None:
    """``zero_stages`` as a list, or None (the search's default)."""
    from planner.pipeline import SEARCH_ZERO_STAGES

    if zero_stages is None:
        return None
    out = [int(z) for z in zero_stages]
    if not out or any(z not in SEARCH_ZERO_STAGES for z in out):
        raise PlanningError(f"ZeRO stages must be 0 (none) or 3 (FSDP2), got "
                            f"{list(zero_stages)}")
    return out


@_planning
def plan(model: torch.nn.Module, cluster: Cluster | str, *, example_inputs: Any,
         mesh_shape: Sequence[int] | None = None, model_source: str | None = None,
         time_limit_s: float = 30.0, optimizer: str = "adam",
         memory_budget: float | None = None,
         zoo_kwargs: dict[str, Any] | None = None,
         pipeline: bool = True, pp: Sequence[int] | None = None,
         schedules: Sequence[str] | None = None,
         num_microbatches: Sequence[int] | None = None,
         zero_stages: Sequence[int] | None = None,
         precision: str | Precision | None = None,
         recompute: bool | None = None,
         progress: Callable[[str], None] | None = None) -> Plan:
    """Find the fastest way to run one training step of ``model`` on ``cluster``.

    The two-level search: every single-stage plan (the intra-op ILP on each 1-D
    and 2-D mesh, on the whole batch or accumulating the gradients of
    micro-batches), and every pipeline (stages from the inter-op DP on equal
    sub-meshes, each solved by the intra-op ILP, with the number of
    micro-batches and the schedule), keeping the fastest that fits in memory.

    Args:
        model: the module (build it on the meta device for large models).
        cluster: a Cluster or a spec string (``dgx-a100-80g:2``, ``local-cpu:4``,
            path to a cluster JSON).
        example_inputs: arguments of one forward call of the whole (global)
            batch; ``model(*example_inputs)`` must return the scalar loss, a mean
            over the batch (micro-batches split dim 0 of every input).
        mesh_shape: a logical device mesh such as ``(2, 2)``: plan one stage on
            exactly this mesh (no pipeline).
        model_source: how ``planner run`` rebuilds the model (zoo name or
            ``file.py:factory``); recorded in the plan.
        time_limit_s: limit for each ILP solve, seconds.
        memory_budget: bytes per device the plan may use; default: the device's
            memory less a 10 % allocator reserve.
        zoo_kwargs: batch_size / seq_len used to build a zoo model (recorded so
            the runner builds the same shapes).
        pipeline: also search pipeline plans (ignored when ``mesh_shape`` is given).
        pp, schedules, num_microbatches: restrict the pipeline search.
        zero_stages: ZeRO stages of pipeline stages to try: 0 (none) and/or 3
            (FSDP2 over the stage mesh's axis 0); default both.
        precision: ``bf16-mixed`` (fp32 master parameters, gradients and
            optimizer states, bf16 compute and activations), ``bf16`` or
            ``fp32`` (:mod:`ir.precision`); default ``bf16-mixed`` on GPU
            clusters and the model's own dtype on CPU ranks. Recorded in the
            plan; ``planner run`` trains in it.
        recompute: None: the search checkpoints layers only where that is
            the fastest plan that fits; True: every layer; False: none.
            Given, it needs ``mesh_shape`` or ``pipeline=False``.
        progress: called with a short line as the search goes (for a progress bar).

    Python's cyclic garbage collector is paused while it runs (reference
    counting frees almost everything; the rest waits for the next collection),
    and the schedule orders of the search are released when it returns.

    Raises:
        PlanningError: bad mesh, or no plan fits in memory (the message gives the
            least memory per device that would fit).
    """
    if recompute is not None and not mesh_shape and pipeline:
        raise PlanningError("recompute= pins checkpointing of single-stage plans: give "
                            "mesh_shape or pipeline=False with it")
    model, cluster, example_inputs, graph, dtype, budget = _prepare(
        model, cluster, example_inputs, memory_budget, precision)
    info = model_record(model, graph, model_source)
    training = training_record(dtype, optimizer, example_inputs, zoo_kwargs)
    if mesh_shape or not pipeline:
        shapes = [_check_mesh(mesh_shape, cluster)] if mesh_shape else mesh_candidates(
            cluster.num_devices)
        best, too_big = _best_single_stage(graph, cluster, shapes, dtype, time_limit_s, budget,
                                           optimizer, recompute)
        if best is None:
            raise PlanningError(str(min(too_big, key=lambda e: e.least_bytes)))
        return build_plan(best, cluster, info, training, whole_batch=True)

    from planner.finalists import assemble, solve_finalists, split_far_finalists
    from planner.pipeline import (NO_PIPELINE, SearchOptions, accumulates, refine, search,
                                  zero_variants)
    from planner.search_context import SearchContext

    ctx = SearchContext(model, example_inputs, cluster, dtype=dtype, optimizer=optimizer,
                        budget=budget, time_limit_s=time_limit_s, progress=progress,
                        whole_batch_graph=graph)
    opts = SearchOptions(pp=pp, schedules=schedules, num_microbatches=num_microbatches,
                         zero_stages=_check_zero_stages(zero_stages))
    priced = search(ctx, opts)
    first = [c for c in priced if not accumulates(c)]
    accumulating = [c for c in priced if accumulates(c)]
    ranked = refine(ctx, first)
    singles = [c for c in ranked if c.schedule == NO_PIPELINE]
    variants, accumulating_variants = zero_variants(ctx, [ranked, accumulating], opts)
    # the fastest few as ranked after refining and as first priced (a refined
    # profile can move a cut the exact solve liked better), the best single
    # stage, the best ZeRO-3 variants, and the best single stages accumulating
    # micro-batches (with and without ZeRO-3; apart, so that they take no
    # pipeline's place): candidates are priced from layer profiles, the exact
    # solve decides
    finalists = list({(c.label(), tuple(c.split.bounds)): c for c in
                      ranked[:opts.finalists] + first[:opts.finalists] + singles[:1]
                      + variants[:opts.zero_finalists] + accumulating[:1]
                      + accumulating_variants[:1]}.values())
    # finalists with a stage that has no plan within limits are dropped; those
    # predicted far behind the fastest are solved only if no other has a plan
    close, far = split_far_finalists(finalists)
    exact = [e for e in solve_finalists(ctx, close) if e is not None]
    if not exact and far:
        exact = [e for e in solve_finalists(ctx, far) if e is not None]
    if not exact:  # the layer profiles are coarse: try every single stage exactly
        best, too_big = _best_single_stage(graph, cluster, mesh_candidates(cluster.num_devices),
                                           dtype, time_limit_s, budget, optimizer)
        if best is not None:
            return build_plan(best, cluster, info, training)
        least = min(too_big, key=lambda e: e.least_bytes) if too_big else None
        raise PlanningError((str(least) if least else "no plan fits in memory")
                            + " (no pipeline of its layers fits either)")
    winner = min(exact, key=lambda e: e.step_time_s)
    if winner.candidate.schedule == NO_PIPELINE:
        return build_plan(winner.results[0], cluster, info, training)
    return assemble(winner, ctx, lambda r, c: build_plan(r, c, info, training))


@_planning
def pipeline_plan(model: torch.nn.Module, cluster: Cluster | str, *, example_inputs: Any,
                  pp: int, stage_mesh: Sequence[int], schedule: str, num_microbatches: int,
                  zero_stage: int = 0, layer_split: Sequence[int] | None = None,
                  model_source: str | None = None, zoo_kwargs: dict[str, Any] | None = None,
                  time_limit_s: float = 30.0, optimizer: str = "adam",
                  memory_budget: float | None = None,
                  fixed: dict[str, tuple] | None = None,
                  precision: str | Precision | None = None) -> Plan:
    """A pipeline plan of one fixed configuration (what a user would pin by hand).

    Args:
        pp: pipeline ranks; ``pp * prod(stage_mesh)`` must be the cluster size.
        stage_mesh: logical mesh of every stage, e.g. ``(2,)`` or ``(1, 2)``.
        schedule: a schedule name (``1f1b``, ``gpipe``, ``interleaved_1f1b``, ...).
        num_microbatches: micro-batches per step (must divide the batch).
        zero_stage: 0, or 3 to shard each stage's parameters, gradients and
            optimizer states with FSDP2 over its first mesh axis.
        layer_split: layers per stage, in stage order (default: the inter-op DP's cut):
            repeated blocks, the ops before the first (embeddings) joining the first
            stage and those after the last (head and loss) the last stage.
        fixed: placements (on the stage mesh) some parameters (by FQN) or inputs
            must take, e.g. a Megatron layout; the ILP places everything else.
        Others: as :func:`plan`.
    """
    from costmodel.schedules import canonical_schedule, default_stages_per_rank
    from planner.inter_op import stage_mesh_options
    from planner.finalists import assemble, solve_exact
    from planner.pipeline import SearchOptions, search
    from planner.search_context import SearchContext

    model, cluster, example_inputs, graph, dtype, budget = _prepare(
        model, cluster, example_inputs, memory_budget, precision)
    stage_mesh = tuple(int(d) for d in stage_mesh)
    _check_zero_stages([zero_stage])
    if pp * math.prod(stage_mesh) != cluster.num_devices:
        raise PlanningError(
            f"pp={pp} x stage mesh {'x'.join(map(str, stage_mesh))} is "
            f"{pp * math.prod(stage_mesh)} devices but cluster '{cluster.name}' has "
            f"{cluster.num_devices}")
    schedule = canonical_schedule(schedule)
    ctx = SearchContext(model, example_inputs, cluster, dtype=dtype, optimizer=optimizer,
                        budget=budget, time_limit_s=time_limit_s, fixed=fixed,
                        whole_batch_graph=graph)
    if ctx.global_batch % num_microbatches:
        raise PlanningError(f"{num_microbatches} micro-batches do not divide the batch of "
                            f"{ctx.global_batch}")
    if not stage_mesh_options(cluster, pp):
        raise PlanningError(f"pp={pp} does not cut cluster '{cluster.name}' into sub-meshes "
                            f"inside a node or of whole nodes")
    v = default_stages_per_rank(schedule)
    layers = ctx.program(num_microbatches).layers
    if layer_split is not None:
        blocks = block_count(layers)
        if len(layer_split) != pp * v or sum(layer_split) != blocks or min(layer_split) < 1:
            raise PlanningError(
                f"layer_split {list(layer_split)} must give {pp * v} stages of at least one "
                f"layer each, {blocks} layers in all")
        bounds = manual_bounds(layers, layer_split)
    else:
        bounds = None
    cands = [c for c in search(ctx, SearchOptions(
        pp=[pp], schedules=[schedule], num_microbatches=[num_microbatches],
        stage_mesh=stage_mesh, zero_stages=[zero_stage])) if c.schedule == schedule]
    if not cands:
        raise PlanningError(
            f"no {schedule} pipeline with pp={pp}, {num_microbatches} micro-batches and "
            f"{len(layers)} layers fits in memory (or torch's schedule rejects the shape)")
    cand = cands[0]
    try:
        exact = solve_exact(ctx, cand, bounds)
    except MemoryInfeasibleError as err:
        raise PlanningError(f"a stage does not fit: {err}") from None
    info = model_record(model, graph, model_source)
    training = training_record(dtype, optimizer, example_inputs, zoo_kwargs)
    return assemble(exact, ctx, lambda r, c: build_plan(r, c, info, training))
