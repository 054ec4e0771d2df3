"""Trace a model: its forward program as the planner's :class:`ir.graph.Graph`.

:func:`trace` is the entry point. It writes out the program of a model of many
identical blocks from short probe captures (:mod:`ir.block_capture.trace`) and
otherwise captures the whole model (:func:`ir.program_capture.capture`) and
reads it with shapes, FLOPs and bytes (:func:`ir.exported_graph.graph_from_exported`);
either way the Graph is the same. Works on the meta device, so a
175B-parameter model is traced without memory.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Sequence

import torch

from ir.exported_graph import graph_from_exported, tied_parameters
from ir.functional_backward import register_functional_backward
from ir.block_capture.program import SynthesizedProgram
from ir.block_capture.trace import fast_trace
from ir.graph import Graph
from ir.grouped_mm import GROUPED_MM, register_grouped_mm_sharding
from ir.grouped_mm_aten import register_aten_grouped_mm_sharding
from ir.program_capture import (TraceError, as_tuple, capture, eager_error, torch_output_logged,
                                value_read, value_read_reason, write_torch_log)

#: The aten op of ``Tensor.item()`` (a tensor's value read as a Python number).
SCALAR_READ = "aten._local_scalar_dense.default"


def trace(model: torch.nn.Module, example_inputs: Sequence[Any] | Any,
          like: Graph | None = None, beside: Callable | None = None) -> Graph:
    """Capture ``model`` called on ``example_inputs`` as a planner Graph.

    Pass a model built on the meta device (and meta example inputs) to plan
    models of any size without allocating weights.

    Models whose blocks sit in an ``nn.ModuleList`` of many identical modules
    are captured from two short probes and the rest written out
    (:mod:`ir.block_capture.trace`); the Graph is the same, node for node, as the full
    capture's. ``like``: an earlier trace of the same model (other input
    shapes), whose checked method the fast path may reuse with one probe.
    ``beside``: runs two functions at once, the second in another process
    (:data:`ir.block_capture.trace.Beside`); the fast path captures its two probes so.
    ``PLANNER_FULL_TRACE=1`` in the environment always captures fully.

    What torch prints or logs meanwhile (a failed export's program dumps)
    stays off the terminal; a failure's error names the file it went to.
    A program with Hugging Face's grouped expert matmul registers its DTensor
    sharding (:func:`ir.grouped_mm.register_grouped_mm_sharding`, torch's own
    :func:`ir.grouped_mm_aten.register_aten_grouped_mm_sharding`), one with
    functional writes their backward (:mod:`ir.functional_backward`).

    Raises:
        ir.program_capture.TraceError: when the full capture fails, or the
            program reads a tensor's value as a Python number (``.item()``):
            one line naming the construct, the model's source line and the fix.
    """
    with torch_output_logged() as torch_output:
        try:
            graph = _trace(model, example_inputs, like, beside)
        except TraceError as err:
            log = write_torch_log(torch_output.getvalue())
            if log is None:
                raise
            raise TraceError(f"{err} (torch's output: {log})") from err.__cause__
    _register_op_support(graph)
    return graph


def _register_op_support(graph: Graph) -> None:
    """What planning and running ``graph``'s ops needs that torch lacks: the
    grouped expert matmul's strategies and sharded runs (the planner asks
    DTensor for strategies, the ranks capture before they run), the
    backward of functional writes (:mod:`ir.functional_backward`)."""
    targets = {node.target for node in graph.nodes}
    if targets.intersection(GROUPED_MM):
        register_grouped_mm_sharding()
        register_aten_grouped_mm_sharding()
    register_functional_backward(targets)


def _trace(model: torch.nn.Module, example_inputs: Sequence[Any] | Any,
           like: Graph | None, beside: Callable | None) -> Graph:
    """:func:`trace` with torch's output where the caller sends it."""
    if os.environ.get("PLANNER_FULL_TRACE", "0") in ("", "0"):
        earlier = like.exported if like is not None else None
        graph = fast_trace(model, example_inputs, like=earlier if isinstance(
            earlier, SynthesizedProgram) else None, beside=beside)
        if graph is not None:
            _refuse_value_reads(graph, model, example_inputs)
            return graph
    ep = capture(model, example_inputs)
    graph = graph_from_exported(ep, model_name=type(model).__name__, tied=tied_parameters(model))
    _refuse_value_reads(graph, model, example_inputs)
    return graph


def _refuse_value_reads(graph: Graph, model: torch.nn.Module, example_inputs: Any) -> None:
    """Refuse a program that reads a tensor's value as a Python number
    (``.item()``: ``aten._local_scalar_dense``) and computes tensors from it:
    the planner prices and shards tensors only (a number read only by
    torch's own assertions is harmless). The error names the model's line,
    found by running forward on the capture's fake or meta inputs, where the
    read fails."""
    users = graph.users()
    for node in graph.nodes:
        if node.target != SCALAR_READ:
            continue
        seen, todo = set(), list(users[node.name])
        while todo:
            name = todo.pop()
            if name in seen:
                continue
            seen.add(name)
            if graph[name].outputs:  # a tensor computed from the number
                eager = eager_error(model, as_tuple(example_inputs))
                raise TraceError(value_read(model, (eager,)) or value_read_reason(
                    type(model).__name__, None))
            todo.extend(users[name])
