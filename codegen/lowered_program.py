"""The plan's DTensor program as Python code that ``torch.compile`` can trace.

:class:`codegen.executor.PlanExecutor` interprets the captured aten program op
by op (:mod:`codegen.node_runner`): it brings each argument to the plan's
placement, dispatches the op on DTensors and fixes outputs DTensor placed
otherwise. That loop is Python that dynamo cannot follow. :func:`lower` writes
the same decisions into the program itself instead: the executor's
GraphModule of the aten ops (:meth:`codegen.executor.PlanExecutor._compile`:
checkpointed layers as submodules) gets, before each planned op, a call that
brings each tensor argument to the plan's placement, and after it one that
brings its output to the planned one. Those calls are submodules holding the
mesh and the placements, so the program's code names no object it cannot
hold; dynamo resolves each call's placement comparison when it traces, and
the redistributions become functional collectives in the compiled graph.

What the lowered program does not do (the interpreter decides it per op at
run time): run an op DTensor cannot shard replicated. A ZeRO-3 unit is
lowered on its own (one compiled program per unit, inside the unit's FSDP2
module).

Under context parallelism (:class:`codegen.context_parallel.ContextParallelRuntime`)
the program's token positions become the rank's own (:class:`RankPositions`),
and each op of them and each fused attention is a call into the runtime
(:class:`ContextParallelOp`), as the interpreter makes it. The positions'
ops run eager, first, as one region (:class:`codegen.program_code.EagerRegion`); so does each
attention's exchange across the cp group (ring or all-gather, with its own
backward): the program's graph breaks at each attention, and the code
between them compiles.

A redistribution *to* a partial sum (a replicated bias meeting a row-parallel
matmul's partial output) is left to DTensor's op, which makes it itself, with
the same result: the public ``redistribute`` that dynamo traces refuses it.
"""

from __future__ import annotations

import itertools
import operator
from typing import Any, Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.placement_types import Placement

from codegen.node_runner import (GRADIENT_RESHAPED, attention_gradient_placements,
                                 attention_mask, contiguous_gradient, fused_attention_layout,
                                 has_fused_attention_layout)
from codegen.redistribution import keep_layout, reachable_target, redistribute, unmask
from ir.torch_compat import SDPA, is_assertion_op, is_mask_partial
from plan.format import Plan

__all__ = ["ContextParallelOp", "RankPositions", "ToPlacement", "lower"]


class ToPlacement(nn.Module):
    """Brings a value to placements ``want`` on ``mesh``, as the interpreter
    does for an op's argument (``output=False``: a plain tensor becomes a
    replica first) or its output (``output=True``: DTensor's masked partial
    made an ordinary one; a plain tensor is left as it is). Placement strings
    are the plan's (:mod:`ir.placements`)."""

    def __init__(self, mesh: DeviceMesh, want: Sequence[str], *, output: bool):
        super().__init__()
        self.mesh = mesh
        self.want = tuple(want)
        self.output = output

    def forward(self, value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        if not isinstance(value, DTensor):
            if self.output:
                return value
            value = DTensor.from_local(value, self.mesh, [Replicate()] * self.mesh.ndim,
                                       run_check=False)
        if self.output and any(is_mask_partial(p) for p in value.placements):
            value = unmask(value)
        target = _reachable(value, self.want)
        if target == tuple(value.placements):
            return value
        moved = redistribute(value, self.mesh, target)
        return moved if self.output else keep_layout(value, moved)


def _reachable(value: DTensor, want: Sequence[str]) -> tuple[Placement, ...]:
    """:func:`codegen.redistribution.reachable_target`, leaving a dim that is
    to become a partial sum as it is (the op makes it; see the module doc)."""
    target = reachable_target(value, list(want))
    return tuple(have if (to.is_partial() and not have.is_partial()) else to
                 for have, to in zip(value.placements, target))


class RankPositions(nn.Module):
    """The token positions this rank holds under context parallelism, in
    place of the program's ``arange`` (its value gives dtype and device)."""

    def __init__(self, runtime: Any):
        super().__init__()
        self.runtime = runtime

    def forward(self, value: torch.Tensor) -> torch.Tensor:
        return self.runtime.positions.to(device=value.device, dtype=value.dtype)


class ContextParallelOp(nn.Module):
    """Op ``node`` run by the context-parallel runtime: an op of the token
    positions (:meth:`ContextParallelRuntime.run_positions`) or, with
    ``attention``, fused attention across the cp group
    (:meth:`ContextParallelRuntime.attention`), which runs eager."""

    def __init__(self, runtime: Any, node: torch.fx.Node, *, attention: bool):
        super().__init__()
        self.runtime = runtime
        self.node = node
        self.attention = attention

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.attention:
            return _exchanged_attention(self.runtime, self.node, args, kwargs)
        return self.runtime.run_positions(self.node, args, kwargs)


@torch.compiler.disable
def _exchanged_attention(runtime: Any, node: torch.fx.Node, args: tuple, kwargs: dict) -> Any:
    """Attention across the cp group, eager: its exchange does not trace."""
    return runtime.attention(node, args, kwargs)


def lower(program: torch.fx.GraphModule, plan: Plan, mesh: DeviceMesh, *,
          context_parallel: Any = None) -> torch.fx.GraphModule:
    """``program`` (and the program of each checkpointed layer in it) with the
    plan's placements written in, and the ops ``context_parallel`` (the
    plan's :class:`codegen.context_parallel.ContextParallelRuntime`, None
    without cp) runs: in place, and returned."""
    modules = [program] + [m.program for m in program.children()
                           if isinstance(getattr(m, "program", None), torch.fx.GraphModule)]
    for module in modules:
        _place(module, plan, mesh, context_parallel)
        module.recompile()
    return program


def _place(module: torch.fx.GraphModule, plan: Plan, mesh: DeviceMesh,
           context_parallel: Any) -> None:
    """Insert the placement calls, and ``context_parallel``'s, into
    ``module``'s graph (see :func:`lower`)."""
    graph = module.graph
    cached: dict[tuple[tuple[str, ...], bool], str] = {}

    def placer(want: Sequence[str], output: bool) -> str:
        key = (tuple(want), output)
        if key not in cached:
            cached[key] = f"{'output' if output else 'input'}_placement_{len(cached)}"
            module.add_module(cached[key], ToPlacement(mesh, want, output=output))
        return cached[key]

    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        entry = plan.nodes.get(node.name)
        if is_assertion_op(node.target):
            # a metadata check (``_assert_tensor_metadata``...) that DTensor has no
            # rule for; the recording forward, interpreted, made it already
            if not node.users:
                graph.erase_node(node)
            continue
        if entry is not None and node.target is not operator.getitem:
            position = itertools.count()  # the argument's index among the node's inputs

            def place_argument(arg: torch.fx.Node) -> torch.fx.Node:
                i = next(position)
                want = entry.inputs[i] if i < len(entry.inputs) else None
                if not want:
                    return arg
                with graph.inserting_before(node):
                    return graph.call_module(placer(want, False), (arg,))
            node.args, node.kwargs = torch.fx.node.map_arg((node.args, node.kwargs),
                                                           place_argument)
        cp_call = _context_parallel_call(node, context_parallel)
        after = _after(node, entry, placer, runtime_attention=cp_call == "attention")
        if cp_call == "positions":
            name = f"rank_positions_{node.name}"
            module.add_module(name, RankPositions(context_parallel))
            after.insert(0, ("module", name))
        if after:
            _wrap_output(graph, node, after)
        if cp_call in ("attention", "op"):
            name = f"context_parallel_{node.name}"
            module.add_module(name, ContextParallelOp(context_parallel, node,
                                                      attention=cp_call == "attention"))
            with graph.inserting_before(node):
                call = graph.call_module(name, node.args, node.kwargs)
            call.meta.update(node.meta)
            node.replace_all_uses_with(call)
            graph.erase_node(node)


def _context_parallel_call(node: torch.fx.Node, runtime: Any) -> str | None:
    """What ``runtime`` (the plan's context parallelism, or None) makes of op
    ``node``: ``"positions"`` (the program's token positions: the rank's own
    instead), ``"op"`` (an op of them), ``"attention"`` or None (nothing)."""
    if runtime is None:
        return None
    if node.name in runtime.position_aranges:
        return "positions"
    if node.name in runtime.position_values:
        return "op"
    return "attention" if node.name in runtime.attention_ops else None


def _after(node: torch.fx.Node, entry: Any, placer: Any, *,
           runtime_attention: bool = False) -> list[tuple[str, Any]]:
    """The calls to apply to ``node``'s (single) output, in order: the
    attention's captured layout (which ``runtime_attention``, context
    parallelism's, gives its output itself), a view's contiguous gradient,
    the plan's output placement."""
    calls: list[tuple[str, Any]] = []
    if node.target is SDPA and not runtime_attention and has_fused_attention_layout(node):
        calls.append(("function", fused_attention_layout))
    if node.target is SDPA and attention_mask(node.args, node.kwargs) is not None:
        calls.append(("function", attention_gradient_placements))
    if node.target in GRADIENT_RESHAPED:
        calls.append(("function", contiguous_gradient))
    single = not isinstance(node.meta.get("val"), (tuple, list))
    if entry is not None and single and entry.outputs and entry.outputs[0]:
        calls.append(("module", placer(entry.outputs[0], True)))
    return calls


def _wrap_output(graph: torch.fx.Graph, node: torch.fx.Node,
                 calls: list[tuple[str, Any]]) -> None:
    """Route every reader of ``node`` through ``calls`` applied to its output."""
    readers = list(node.users)
    value = node
    for kind, target in calls:
        with graph.inserting_after(value):
            made = (graph.call_module(target, (value,)) if kind == "module"
                    else graph.call_function(target, (value,)))
        made.meta.update(node.meta)
        value = made
    for reader in readers:
        reader.replace_input_with(node, value)
