"""The executor's program as Python code that ``torch.compile`` can take.

:class:`codegen.executor.PlanExecutor` interprets the captured aten program
op by op. Its compiled path (and, on one device, its fast path) runs the same
ops as a ``torch.fx.GraphModule`` instead (:func:`program_code`): the op nodes
copied in program order, each called through the public function that
dispatches its overload where one does (:func:`codegen.node_runner.public_binding`),
and two kinds of submodule, each a program of its own:

* a checkpointed layer (:class:`CheckpointedLayer`), run under
  ``torch.utils.checkpoint`` as :func:`codegen.checkpointed_layers.run_checkpointed`
  runs it;
* a region that runs eager, before the rest (:class:`EagerRegion`): context
  parallelism's token positions
  (:meth:`codegen.context_parallel.ContextParallelRuntime.positions_region`),
  whose local values per rank do not trace; apart, each of their ops would
  break the graph, leaving graphs that only return a view of their input,
  which AOTAutograd cannot remake of a DTensor.

A submodule's results are the items of its call, named after it: the
lowering (:mod:`codegen.lowered_program`) finds the plan's placements by node
name, and an item named ``getitem`` would take another op's (and rename the
captured op of that name).
"""

from __future__ import annotations

import operator
from typing import Any, Callable, Sequence

import torch

from codegen.checkpointed_layers import checkpointed, segment_boundary
from codegen.compiled_program import CompiledRegion
from codegen.node_runner import public_binding
from ir.torch_compat import is_assertion_op

__all__ = ["CheckpointedLayer", "EagerRegion", "program_code", "segment_program"]


class CheckpointedLayer(torch.nn.Module):
    """A checkpointed layer's program (its external values in, the values read
    after it out, as a tuple) run as :func:`codegen.checkpointed_layers.run_checkpointed`
    runs it (:func:`codegen.checkpointed_layers.checkpointed`).

    On one device, compiled with the program around it, the checkpoint
    traces into the program's graph, the recomputation too. On a mesh
    :attr:`region` is set instead: the layer's own compiled region, run inside
    a checkpoint the program's compile leaves out (its graph breaks there)."""

    def __init__(self, program: torch.fx.GraphModule):
        super().__init__()
        self.program = program
        self.region: CompiledRegion | None = None

    def forward(self, *values: Any) -> tuple:
        if self.region is None:
            return checkpointed(self.program, *values)
        return _checkpointed_region(self.region, *values)


@torch.compiler.disable
def _checkpointed_region(region: CompiledRegion, *values: Any) -> tuple:
    """``region`` (compiled on its own) under an eager checkpoint."""
    return checkpointed(region, *values)


class EagerRegion(torch.nn.Module):
    """A part of the program (``program``, lowered with it) that runs eager
    inside the compiled program: its graph breaks there."""

    def __init__(self, program: torch.fx.GraphModule):
        super().__init__()
        self.program = program

    def forward(self, *values: Any) -> Any:
        return _run_eager(self.program, *values)


@torch.compiler.disable
def _run_eager(program: Callable[..., Any], *values: Any) -> Any:
    """``program(*values)``, left out of the compile around it."""
    return program(*values)


def program_code(calls: Sequence[torch.fx.Node], inputs: Sequence[torch.fx.Node], outputs: Any,
                 memo: dict[Any, Any], *, layers: Sequence[Sequence[torch.fx.Node]] = (),
                 eager_first: Sequence[torch.fx.Node] = ()) -> torch.fx.GraphModule:
    """Op nodes ``calls`` (in program order) as a program taking the values
    ``inputs`` (its placeholders, named as they are) and returning
    ``outputs`` (nodes, in any structure ``map_arg`` walks). Each of
    ``layers`` (checkpointed layers' op nodes) is a :class:`CheckpointedLayer`;
    ``eager_first`` (op nodes no other op of ``calls`` before them feeds) is
    one :class:`EagerRegion` called first and left out of the layers.
    ``memo``: :func:`codegen.node_runner.public_binding`'s, shared."""
    root, graph = torch.nn.Module(), torch.fx.Graph()
    copied: dict[torch.fx.Node, torch.fx.Node] = {}
    for value in inputs:
        copied[value] = graph.placeholder(value.name)
        copied[value].meta.update(value.meta)
    first = set(eager_first)
    kept = [[n for n in layer if n not in first] for layer in layers]
    starts = {layer[0]: layer for layer in kept if layer}
    skipped = {n for layer in kept for n in layer} | first
    if eager_first:
        _call_segment(graph, root, eager_first, copied, memo, EagerRegion, "eager")
    for node in calls:
        if node in starts:
            _call_segment(graph, root, starts[node], copied, memo, CheckpointedLayer,
                          "checkpointed")
        elif node not in skipped:
            copied[node] = graph.node_copy(node, copied.__getitem__)
    graph.output(torch.fx.node.map_arg(outputs, copied.__getitem__))
    _bind_publicly(graph, memo)
    return torch.fx.GraphModule(root, graph)


def segment_program(segment: Sequence[torch.fx.Node], memo: dict[Any, Any], *,
                    eager_first: Sequence[torch.fx.Node] = ()
                    ) -> tuple[torch.fx.GraphModule, list[torch.fx.Node], list[torch.fx.Node]]:
    """The op nodes of ``segment`` as a program of their own
    (:func:`program_code`). Returns it, the values it reads from outside (its
    inputs, in first use order) and those read after it (its outputs, a
    tuple)."""
    external, outputs = segment_boundary(segment)
    program = program_code(segment, external, tuple(outputs), memo, eager_first=eager_first)
    return program, external, outputs


def _call_segment(graph: torch.fx.Graph, root: torch.nn.Module, segment: Sequence[torch.fx.Node],
                  copied: dict[torch.fx.Node, torch.fx.Node], memo: dict[Any, Any],
                  kind: Callable[[torch.fx.GraphModule], torch.nn.Module], prefix: str) -> None:
    """Append to ``graph`` a call of ``segment`` (op nodes) as ``kind`` makes
    a module of their program, a new submodule of ``root`` named ``prefix_N``,
    on the copies of the values it reads; the values read after it are copied
    as the items of the call's result (named after the call: see the module
    doc)."""
    program, external, outputs = segment_program(segment, memo)
    name = f"{prefix}_{len(list(root.children()))}"
    root.add_module(name, kind(program))
    call = graph.call_module(name, tuple(copied[v] for v in external))
    for i, out in enumerate(outputs):
        copied[out] = graph.create_node("call_function", operator.getitem, (call, i),
                                        name=f"{name}_item_{i}")
        copied[out].meta.update(out.meta)


def _bind_publicly(graph: torch.fx.Graph, memo: dict[Any, Any]) -> None:
    """Call each aten op of ``graph`` through the public function that
    dispatches its overload, where one does (:func:`codegen.node_runner.public_binding`)."""
    for node in graph.nodes:
        # an assertion keeps its aten op: the lowering drops it by its schema
        if node.op == "call_function" and not is_assertion_op(node.target):
            node.target = public_binding(node, memo) or node.target
