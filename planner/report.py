"""Human-readable text of a Plan (the tables `planner plan` and `planner show` print)."""

from __future__ import annotations

import re
from collections import OrderedDict
from dataclasses import dataclass

from plan.compiled_collectives import compiled_collectives
from plan.format import Plan


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(headers)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(out)


def format_bytes(n: float) -> str:
    """``n`` bytes in binary units, e.g. ``1.5 GiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n} B"


def _seconds(s: float) -> str:
    if s >= 1:
        return f"{s:.3f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3f} ms"
    return f"{s * 1e6:.1f} us"


def _placements(p: list[str]) -> str:
    return "[" + ", ".join(p) + "]"


_NO_PARALLELISM = ("no parallelism: every device holds every tensor whole and computes "
                   "the whole step (a bigger batch, or fewer devices, would use them)")


def _step_line(plan: Plan) -> str:
    """The step the plan was made for: batch x sequence (of the first input),
    micro-batches, precision and optimizer."""
    t = plan.training or {}
    shapes = [s for s in t.get("input_shapes") or [] if s]
    batch = t.get("global_batch") or (shapes[0][0] if shapes else None)
    step = (f"batch {batch} x seq {shapes[0][1]}" if shapes and len(shapes[0]) > 1 and batch
            else f"batch {batch}" if batch else "the example inputs")
    if plan.pipeline is not None:
        step += f" in {plan.pipeline.num_microbatches} micro-batches"
    precision = t.get("precision") or t.get("dtype", "?")
    return f"planned step: {step}, {precision}, {t.get('optimizer', 'adam')}"


def _replicated_everywhere(plan: Plan) -> bool:
    """More than one device, yet no pipeline and every parameter and input whole
    on every device."""
    if plan.world_size <= 1 or plan.pipeline is not None:
        return False
    whole = [*plan.parameters.values(), *plan.inputs.values()]
    return all(p == "R" for pl in whole for p in pl)


def _context_parallel_lines(plan: Plan) -> list[str]:
    """One line on the plan's context parallelism (none without it)."""
    cp = (plan.training or {}).get("context_parallel")
    if not cp:
        return []
    priced = plan.predicted.get("context_parallel") or {}
    exchange = sum(priced.get("exchange_s_per_microbatch") or [])
    return [f"context parallelism: each sequence over {cp.get('size')} ranks of mesh axis "
            f"{'1' if plan.pipeline is not None else '0'} ({cp.get('comm_type')} K/V exchange, "
            f"{_seconds(exchange)} per micro-batch, K/V buffers "
            f"{format_bytes(priced.get('kv_buffer_bytes') or 0)}); {_context_parallel_runs(plan)}"]


def _context_parallel_runs(plan: Plan) -> str:
    """Where a plan with context parallelism runs (:mod:`codegen.context_parallel`):
    on CPU ranks over gloo (the CPU flash kernel per attention block), and on
    CUDA ranks over NCCL (FlashAttention-2 or the memory-efficient kernel per
    block, :mod:`codegen.cp_kernels`), whose kernel choice and block merge are
    checked on CPU but which this project has not yet run on a GPU
    (``benchmarks/gpu_cp_attention.py`` is the check prepared for one)."""
    device = ((plan.cluster or {}).get("device") or {}).get("name", "")
    if (plan.cluster or {}).get("backend") == "gloo":
        return "runs on CPU ranks (gloo)"
    return (f"runs on {device or 'the'} GPU ranks (NCCL; FlashAttention-2 or memory-efficient "
            f"attention per block), not yet run on a GPU by this project")


def _compile_lines(plan: Plan) -> list[str]:
    """One line on where a compiled plan's collectives run (none for an eager
    plan; a plan made before it recorded them gets them worked out)."""
    if not plan.compiles:
        return []
    record = plan.training.get("compile_collectives") or compiled_collectives(plan)
    inside = ", ".join(f"{n} {kind}" for kind, n in record["in_graph"].items()) or "none"
    outside = record["outside_graph"]
    parts = []
    if "gradient_reduction" in outside:
        reductions = outside["gradient_reduction"].values()
        parts.append(f"gradients {' / '.join('+'.join(c) for c in reductions)}")
    if "p2p" in outside:
        parts.append("pipeline send/recv")
    if "context_parallel" in outside:
        parts.append(f"cp {outside['context_parallel']} K/V exchange")
    return [f"compiled: collectives in the graphs {inside} (reshards, per forward); outside "
            f"them {', '.join(parts) or 'none'}"]


def format_plan(plan: Plan, verbose: bool = False) -> str:
    """Summary of a plan: mesh, predicted step, memory, parameter placements, reshards."""
    pred = plan.predicted
    mem = pred["memory_bytes_per_device"]
    mesh = "x".join(str(d) for d in plan.mesh_shape)
    lines = [
        f"model {plan.model['name']} ({plan.model['num_parameters']:,} parameters) on "
        f"{plan.cluster['name']} ({plan.cluster['num_nodes']} node(s) x "
        f"{plan.cluster['devices_per_node']} devices), mesh {mesh}",
        f"predicted step {_seconds(pred['step_time_s'])}: compute {_seconds(pred['compute_s'])}, "
        f"communication {_seconds(pred['communication_s'])}, "
        f"resharding {_seconds(pred['resharding_s'])}"
        + (f"; the host issues its ops in {_seconds(pred['host_s'])}" if pred.get("host_s") else ""),
        _step_line(plan),
        *([_NO_PARALLELISM] if _replicated_everywhere(plan) else []),
        *_context_parallel_lines(plan),
        *_compile_lines(plan),
        "activation checkpointing: " + (", ".join(plan.checkpoint) if plan.checkpoint else "none"),
        "memory per device: " + ", ".join(f"{k} {format_bytes(v)}" for k, v in mem.items()),
        _margin_line(memory_margin(plan)),
        f"solver {plan.solver.solver}: {plan.solver.status}, objective "
        f"{_seconds(plan.solver.objective_s)}, gap {plan.solver.gap:.2%}, "
        f"{plan.solver.num_variables} variables",
        "",
    ]
    if plan.pipeline is not None:
        lines[-1:-1] = _pipeline_lines(plan)
    # Group parameters of repeated blocks (h.0, h.1, ...) with identical placements.
    groups: OrderedDict[tuple[str, str], list[str]] = OrderedDict()
    for fqn, p in plan.parameters.items():
        parts = fqn.split(".")
        generic = ".".join("*" if part.isdigit() else part for part in parts)
        groups.setdefault((generic, _placements(p)), []).append(fqn)
    rows = [[name, pl, str(len(fqns))] for (name, pl), fqns in groups.items()]
    lines.append(_table(["parameter", "placements", "count"], rows))
    lines.append("")
    lines += _input_lines(plan)
    total = sum(r.time_s for r in plan.reshards)
    lines.append(f"{len(plan.reshards)} reshard points, {_seconds(total)} forward")
    if verbose and plan.reshards:
        lines.append(_table(["node", "module", "from", "to", "time"],
                            [[r.node, r.module or "-", _placements(r.src), _placements(r.dst),
                              _seconds(r.time_s)] for r in plan.reshards]))
    return "\n".join(lines)


# torch.export's name of a tensor constant it lifts into an input of the
# program: "c_", the path (dots as underscores) of the module whose forward
# made it, and "lifted_tensor_<n>"; e.g. c_hf_model_layers_0_self_attn_lifted_tensor_0
_LIFTED_CONSTANT = re.compile(r"^c_(?:(?P<path>.+)_)?lifted_tensor_\d+$")


def _input_lines(plan: Plan) -> list[str]:
    """The step's inputs and their placements; the tensor constants the
    capture lifted into inputs (one per layer in Hugging Face attention, say)
    on a line of their own, by the module that makes them (its path, repeated
    blocks as ``*``: ``hf.model.layers.*.self_attn [R] x4``). plan.json
    keeps them under their capture names."""
    modules: dict[str, str] = {}  # module path with underscores -> the path
    for node in plan.nodes.values():
        parts = (node.module or "").split(".")
        for end in range(1, len(parts) + 1):
            path = ".".join(parts[:end])
            modules.setdefault(path.replace(".", "_"), path)
    inputs, constants = [], OrderedDict()
    for name, placements in plan.inputs.items():
        lifted = _LIFTED_CONSTANT.match(name)
        if lifted is None:
            inputs.append(f"{name} {_placements(placements)}")
            continue
        path = lifted.group("path")
        where = modules.get(path, path) if path else "the model"
        generic = ".".join("*" if part.isdigit() else part for part in where.split("."))
        key = f"{generic} {_placements(placements)}"
        constants[key] = constants.get(key, 0) + 1
    lines = ["inputs: " + (", ".join(inputs) or "none")]
    if constants:
        lines.append("constants lifted into inputs by the capture, by the module that makes "
                     "them: " + ", ".join(f"{k} x{n}" for k, n in constants.items()))
    return lines


def _layer_span(layers: list[str]) -> str:
    return layers[0] if len(layers) == 1 else f"{layers[0]} .. {layers[-1]} ({len(layers)})"


def _pipeline_lines(plan: Plan) -> list[str]:
    """The pipeline section: schedule, bubble, and one row per stage."""
    pipe, pred = plan.pipeline, plan.predicted
    lines = [f"pipeline: {pipe.schedule}, pp={pipe.pp}, {pipe.stages_per_rank} stage(s) per rank, "
             f"{pipe.num_microbatches} micro-batches of {plan.training.get('microbatch_size')}; "
             f"stage mesh {'x'.join(map(str, pipe.stage_mesh['shape']))}; bubble "
             f"{_seconds(pred.get('bubble_s', 0.0))}, p2p {_seconds(pred.get('p2p_s', 0.0))}, "
             f"gradient sync {_seconds(pred.get('grad_sync_s', 0.0))}, optimizer update "
             f"{_seconds(pred.get('update_s', 0.0))}, gradient accumulation "
             f"{_seconds(pred.get('accumulate_s', 0.0))}"]
    rows = []
    for st in pipe.stages:
        p = st.predicted
        mem = p.get("memory_bytes_per_device", {}).get("total", 0)
        rows.append([str(st.index), str(st.pp_rank), _layer_span(st.layers),
                     f"{st.ranks[0]}-{st.ranks[-1]}",
                     _seconds(p.get("forward_s", 0.0)),
                     _seconds(p.get("backward_input_s", 0.0) + p.get("backward_weight_s", 0.0)),
                     format_bytes(mem), f"ZeRO-{st.zero_stage}" if st.zero_stage else "-",
                     str(len(st.checkpoint))])
    lines.append(_table(["stage", "pp rank", "layers", "ranks", "fwd/mb", "bwd/mb", "memory",
                         "zero", "ckpt"], rows))
    return lines


@dataclass(frozen=True)
class MemoryMargin:
    """How close a plan's predicted peak is to the memory it may use (bytes per device)."""

    peak: float  # the predicted peak of a step
    budget: float  # what the plan was made to fit: device memory less the reserve
    device: float  # the device's memory
    recorded: bool  # the budget is the plan's own (else the default, from the device)

    @property
    def near_edge(self) -> bool:
        """Whether the peak is within the memory model's stated error of the budget."""
        from planner.request import MEMORY_MODEL_ERROR

        return self.peak * (1 + MEMORY_MODEL_ERROR) > self.budget


def memory_margin(plan: Plan) -> MemoryMargin:
    """The plan's predicted peak against its memory budget (``training
    .memory_budget_bytes``; plans made before it was recorded: the device's
    memory less :data:`planner.request.MEMORY_RESERVE`)."""
    from costmodel.memory import reserve_bytes
    from planner.request import MEMORY_RESERVE

    mem = plan.predicted["memory_bytes_per_device"]
    device = float(plan.cluster["device"]["memory"])
    budget = (plan.training or {}).get("memory_budget_bytes")
    recorded = budget is not None
    if not recorded:
        budget = device - reserve_bytes(int(device), MEMORY_RESERVE)
    return MemoryMargin(float(mem.get("peak", mem.get("total", 0.0))), float(budget), device,
                        recorded)


def _margin_line(m: MemoryMargin) -> str:
    budget = f"the {format_bytes(m.budget)} budget" if m.recorded else (
        f"the default {format_bytes(m.budget)} budget")
    return (f"memory margin: predicted peak {format_bytes(m.peak)} per device, "
            f"{m.peak / m.budget:.0%} of {budget} (device {format_bytes(m.device)})")


def memory_edge_warning(plan: Plan) -> str | None:
    """A one-line warning when the plan's predicted peak is within the memory
    model's stated error of its budget, else None."""
    from planner.request import MEMORY_MODEL_ERROR

    m = memory_margin(plan)
    if not m.near_edge:
        return None
    return (f"the predicted peak ({format_bytes(m.peak)} per device) is within the memory "
            f"model's {MEMORY_MODEL_ERROR:.0%} error of the {format_bytes(m.budget)} budget: "
            f"the run may need more; for a margin, plan a smaller batch or more devices")
