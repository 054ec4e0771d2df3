"""Trace a model: its forward program as the planner's :class:`ir.graph.Graph`.

:func:`trace` is the entry point. It writes out the program of a model of many
identical blocks from short probe captures (:mod:`ir.fast_trace`) and
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
from ir.fast_program import SynthesizedProgram
from ir.fast_trace import fast_trace
from ir.graph import Graph
from ir.program_capture import capture


def trace(model: torch.nn.Module, example_inputs: Sequence[Any] | Any,
          like: Graph | None = None, beside: Callable | None = None) -> Graph:
    """Capture ``model`` called on ``example_inputs`` as a planner Graph.

    Pass a model built on the meta device (and meta example inputs) to plan
    models of any size without allocating weights.

    Models whose blocks sit in an ``nn.ModuleList`` of many identical modules
    are captured from two short probes and the rest written out
    (:mod:`ir.fast_trace`); the Graph is the same, node for node, as the full
    capture's. ``like``: an earlier trace of the same model (other input
    shapes), whose checked method the fast path may reuse with one probe.
    ``beside``: runs two functions at once, the second in another process
    (:data:`ir.fast_trace.Beside`); the fast path captures its two probes so.
    ``PLANNER_FULL_TRACE=1`` in the environment always captures fully.

    Raises:
        ir.program_capture.TraceError: when the full capture fails.
    """
    if os.environ.get("PLANNER_FULL_TRACE", "0") in ("", "0"):
        earlier = like.exported if like is not None else None
        graph = fast_trace(model, example_inputs, like=earlier if isinstance(
            earlier, SynthesizedProgram) else None, beside=beside)
        if graph is not None:
            return graph
    ep = capture(model, example_inputs)
    return graph_from_exported(ep, model_name=type(model).__name__, tied=tied_parameters(model))
