"""The program the runtime runs: the model captured exactly as the planner captured it.

:func:`capture_program` traces the model the way the planner did
(:func:`ir.trace.trace`), so a plan's node names and its fingerprint match the
program; :func:`check_plan_fits_program` refuses a plan made for another one
(:class:`PlanMismatchError`, also raised for a plan of another mesh or
parameter set).
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import Any

import torch
from torch.export.graph_signature import ExportGraphSignature

from ir.block_capture.trace import SynthesizedProgram
from ir.graph import INPUT, OP, PARAM
from ir.placements import parse_planned
from ir.device_capture import planned_copy
from ir.precision import Precision, compute_copy, get_precision
from ir.trace import trace
from plan.format import Plan

__all__ = ["CapturedProgram", "PlanMismatchError", "WrittenOutProgram", "capture_program",
           "check_plan_fits_program"]


class PlanMismatchError(ValueError):
    """The plan was made for another program, mesh or parameter set than the one given."""


@dataclass
class WrittenOutProgram:
    """A fast trace's program (:class:`ir.block_capture.trace.SynthesizedProgram`) with
    the model's own parameters and buffers: the parts of an ``ExportedProgram``
    the executor reads."""

    graph: torch.fx.Graph
    graph_signature: ExportGraphSignature
    state_dict: dict[str, torch.Tensor]  # FQN -> the model's parameter or buffer
    constants: dict[str, torch.Tensor]


@dataclass
class CapturedProgram:
    """A model captured as the planner captures it: the program and its Graph."""

    ep: torch.export.ExportedProgram | WrittenOutProgram
    graph: Any  # ir.graph.Graph


def capture_program(model: torch.nn.Module, example_inputs: Any,
                    precision: Precision | str = "fp32",
                    device: torch.device | None = None) -> CapturedProgram:
    """Capture ``model(*example_inputs)`` exactly as the planner did
    (:func:`ir.trace.trace` of :func:`ir.precision.compute_copy`: floating
    tensors in the precision's compute dtype): a model of many identical
    blocks from two short probe captures with the rest written out (the same
    program, node for node, as the full capture, and several times faster to
    make for a model of many blocks), any other with the full
    ``torch.export`` capture. The program's state is ``model``'s own
    parameters and buffers (the master copies; the executor casts them for
    each forward).

    A model on meta is captured as the planner captured it for ``device``'s
    kind (:func:`ir.device_capture.planned_copy`: fake CPU tensors for CPU
    ranks), and tensors the program creates on meta are created on ``device``
    instead when it runs."""
    on_meta = any(t.is_meta for t in model.parameters())
    if on_meta and device is not None:
        captured_model, inputs = planned_copy(model, _as_tuple(example_inputs),
                                              get_precision(precision), device.type)
    else:
        captured_model, inputs = compute_copy(model, _as_tuple(example_inputs),
                                              get_precision(precision))
    graph = trace(captured_model, inputs)
    program = graph.exported
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    if isinstance(program, SynthesizedProgram):
        program = WrittenOutProgram(program.graph, program.graph_signature, state, {})
    elif captured_model is not model:  # captured on a copy: run on the model's tensors
        program = WrittenOutProgram(program.graph, program.graph_signature, state,
                                    dict(program.constants))
    # the Graph keeps the program it runs, not the traced one: that one holds the
    # copy it traced (a compute-dtype copy of every parameter, for a whole step)
    graph.exported = program
    if captured_model is not model and not on_meta:
        # the trace leaves reference cycles that hold the copy's real tensors
        # until Python's cycle collector happens to run: free them now
        del captured_model, inputs
        gc.collect()
    if on_meta and device is not None:
        _create_on(program.graph, device)
    return CapturedProgram(program, graph)


def _create_on(graph: torch.fx.Graph, device: torch.device) -> None:
    """Make the ops of ``graph`` that create tensors on meta (``device=`` of
    ``arange``, ``full``, ...) create them on ``device``."""
    for node in graph.nodes:
        where = node.kwargs.get("device")
        if node.op == "call_function" and isinstance(where, torch.device) and where.type == "meta":
            node.update_kwarg("device", device)


def check_plan_fits_program(plan: Plan, program: CapturedProgram, model: torch.nn.Module) -> None:
    """Refuse a ``plan`` made for another program than ``program`` (its
    fingerprint), one whose ``nodes`` leave out or add ops of the program (an
    edited plan.json; an empty ``nodes`` follows DTensor instead), or one that
    shards a tensor along a dimension it does not have."""
    fingerprint = program.graph.fingerprint()
    expected = plan.model.get("fingerprint")
    if expected != fingerprint:
        raise PlanMismatchError(
            f"plan was made for program {expected} but model "
            f"'{plan.model.get('source', type(model).__name__)}' with these inputs captures "
            f"as {fingerprint}; re-plan this model (same batch size and sequence length)")
    graph = program.graph
    if plan.nodes:
        ops = [n.name for n in graph.nodes if n.kind == OP]
        missing = [n for n in ops if n not in plan.nodes]
        extra = sorted(set(plan.nodes) - set(ops))
        if missing or extra:
            name = missing[0] if missing else extra[0]
            raise PlanMismatchError(
                f"plan.json's nodes {'leave out' if missing else 'add'} node {name} "
                f"({len(missing)} missing, {len(extra)} unknown) of the captured program; "
                f"regenerate the plan with `planner plan`")
    for where, placements, info in _planned_tensors(plan, graph):
        for text in placements:
            p = parse_planned(text)
            dim = getattr(p, "dim", None)
            if isinstance(dim, int) and not -len(info.shape) <= dim < len(info.shape):
                raise PlanMismatchError(
                    f"{where} has placement {text} but is a tensor of {len(info.shape)} "
                    f"dimension(s) {list(info.shape)}; regenerate the plan with `planner plan`")


def _planned_tensors(plan: Plan, graph: Any) -> list[tuple[str, list[str], Any]]:
    """(where, placements, TensorInfo) of every placement ``plan`` gives a tensor
    of ``graph``: parameters, inputs, and each op's inputs and outputs."""
    out: list[tuple[str, list[str], Any]] = []
    for n in graph.nodes:
        if n.kind == PARAM and n.fqn in plan.parameters and n.outputs:
            out.append((f"parameter {n.fqn}", plan.parameters[n.fqn], n.outputs[0]))
        elif n.kind == INPUT and n.name in plan.inputs and n.outputs:
            out.append((f"input {n.name}", plan.inputs[n.name], n.outputs[0]))
        elif n.kind == OP and n.name in plan.nodes:
            op = plan.nodes[n.name]
            for i, (pl, info) in enumerate(zip(op.outputs, n.outputs)):
                if pl is not None:
                    out.append((f"node {n.name} output {i}", pl, info))
            for i, (pl, info) in enumerate(zip(op.inputs, n.inputs)):
                if pl is not None:
                    out.append((f"node {n.name} input {i}", pl, info))
    return out


def _as_tuple(inputs: Any) -> tuple:
    return tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
