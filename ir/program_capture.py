"""Capture a model's forward program as a core-ATen ``torch.fx`` program.

:func:`capture` runs ``torch.export.export(strict=False)`` and decomposes the
result to core ATen, which is the op set DTensor shards at run time;
:func:`capture_in_one_pass` gives the same program from one trace
(``aot_export_module``). Works on the meta device, so a 175B-parameter model is
captured without memory. :mod:`ir.exported_graph` reads such a program as the
planner's :class:`ir.graph.Graph`; :func:`ir.trace.trace` does both.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import warnings
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch.export.graph_signature import (
    ExportGraphSignature, InputKind, InputSpec, OutputKind, OutputSpec, TensorArgument,
)

from ir.torch_compat import (aot_export_module, capture_decompositions,
                             decomposition_registry_size, fused_attention_layout,
                             fx_without_stack_traces)


class TraceError(RuntimeError):
    """Neither torch.export nor torch.fx could capture the model."""


def as_tuple(example_inputs: Any) -> tuple:
    """The positional arguments ``example_inputs`` stands for: itself when a
    tuple, its items when a list, else the one argument."""
    if isinstance(example_inputs, tuple):
        return example_inputs
    if isinstance(example_inputs, list):
        return tuple(example_inputs)
    return (example_inputs,)


def capture(model: torch.nn.Module, example_inputs: Any) -> torch.export.ExportedProgram:
    """Export ``model(*example_inputs)`` and decompose it to core ATen.

    Tries ``torch.export.export(strict=False)`` first, then the ``torch.fx``
    front-end (``symbolic_trace`` followed by export of the traced module).
    ``F.scaled_dot_product_attention`` stays one node
    (``aten.scaled_dot_product_attention``): it runs as the device's fused
    kernel, so the meta capture the planner sees and the real capture the
    executor runs are the same program on any device.

    Raises:
        TraceError: naming the module and the construct that failed in both.
    """
    args = as_tuple(example_inputs)
    with warnings.catch_warnings(), fx_without_stack_traces(), fused_attention_layout(), \
            _quiet_fake_tensors():
        warnings.simplefilter("ignore")
        try:
            ep = torch.export.export(model, args, strict=False)
        except Exception as export_err:  # noqa: BLE001 - both errors are reported
            try:
                gm = torch.fx.symbolic_trace(model)
                ep = torch.export.export(gm, args, strict=False)
            except Exception as fx_err:  # noqa: BLE001
                eager = _eager_error(model, args)
                if eager is not None:  # not a capture problem: the step itself fails
                    raise TraceError(
                        f"{type(model).__name__}'s forward fails on the example inputs "
                        f"({_shapes(args)}): '{_first_line(eager)}'; give inputs of the "
                        f"shapes and dtypes the model takes") from eager
                raise TraceError(
                    f"cannot capture {type(model).__name__}: torch.export failed with "
                    f"'{_first_line(export_err)}' and torch.fx.symbolic_trace failed with "
                    f"'{_first_line(fx_err)}'; remove data-dependent Python control flow "
                    f"from its forward() or wrap that part in a leaf module"
                ) from fx_err
        return ep.run_decompositions(_export_decompositions())


@contextlib.contextmanager
def _quiet_fake_tensors() -> Iterator[None]:
    """Keep torch's fake-tensor logger from printing the stack of every op
    that fails while exporting: the failure is reported as one TraceError."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _eager_error(model: torch.nn.Module, args: tuple) -> Exception | None:
    """The exception ``model(*args)`` raises when run as it is (no gradients),
    or None when it runs: tells inputs the model cannot take from a forward
    that cannot be captured."""
    try:
        with torch.no_grad():
            model(*args)
    except Exception as err:  # noqa: BLE001 - returned for the message
        return err
    return None


def _shapes(args: tuple) -> str:
    return ", ".join(f"{list(a.shape)} {str(a.dtype).replace('torch.', '')}"
                     if isinstance(a, torch.Tensor) else type(a).__name__ for a in args)


@dataclass
class CapturedProgram:
    """What :func:`capture_in_one_pass` gives: the parts of an
    ``ExportedProgram`` the planner reads of a capture (``graph``, node values
    in ``meta["val"]``, and ``graph_signature``)."""

    graph: torch.fx.Graph
    graph_signature: ExportGraphSignature


def capture_in_one_pass(model: torch.nn.Module, example_inputs: Any) -> Any:
    """:func:`capture`'s program (the same nodes, names, targets, arguments,
    values, module paths and signature), traced once: straight to core ATen
    by ``aot_export_module`` with export's decomposition table, where
    :func:`capture` traces twice (``torch.export`` then
    ``run_decompositions``). llama3-8b's 2-block probe: 0.32 s against 0.85 s.

    Falls back to :func:`capture` (its ``ExportedProgram``) when the model
    does not fit the one pass: outputs other than a tensor or a tuple of
    tensors, keyword or variadic inputs, attributes lifted as constants.
    Callers that need the equality vouched for compare against a
    :func:`capture` of the same model (:mod:`ir.fast_trace` checks each new
    method on one probe of each kind)."""
    args = as_tuple(example_inputs)
    try:
        return _one_pass(model, args)
    except Exception:  # noqa: BLE001 - anything unusual: the two-pass capture
        return capture(model, args)


def _one_pass(model: torch.nn.Module, args: tuple) -> CapturedProgram:
    """:func:`capture_in_one_pass` without the fallback (raises where it applies)."""
    cls = type(model)
    forward = cls.forward
    names = list(inspect.signature(forward).parameters)[1:]
    if len(names) < len(args) or any(
            p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
            for p in list(inspect.signature(forward).parameters.values())[1:len(args) + 1]):
        raise TypeError("inputs that are not positional parameters")

    def as_tuple(self, *inputs):  # aot_export_module wants a tuple of outputs
        out = forward(self, *inputs)
        if isinstance(out, torch.Tensor):
            return (out,)
        if isinstance(out, tuple) and all(isinstance(o, torch.Tensor) for o in out):
            return out
        raise TypeError("outputs other than tensors")

    shell = torch.nn.Module.__new__(type(cls.__name__, (cls,), {"forward": as_tuple}))
    shell.__dict__ = dict(model.__dict__)  # the same submodules: module paths unchanged
    with warnings.catch_warnings(), fx_without_stack_traces():
        warnings.simplefilter("ignore")
        gm, signature = aot_export_module(shell, args, trace_joint=False,
                                          decompositions=_export_decompositions())
    graph = gm.graph
    if any(n.op == "get_attr" for n in graph.nodes):
        raise TypeError("attributes lifted as constants")
    non_persistent = {f"{prefix}{'.' if prefix else ''}{name}"
                      for prefix, mod in model.named_modules()
                      for name in getattr(mod, "_non_persistent_buffers_set", ())}
    users = iter(names[:len(args)])
    specs = []
    for node in [n for n in graph.nodes if n.op == "placeholder"]:
        if node.name in signature.inputs_to_parameters:
            fqn = signature.inputs_to_parameters[node.name]
            kind, name, persistent = InputKind.PARAMETER, "p_" + fqn.replace(".", "_"), None
        elif node.name in signature.inputs_to_buffers:
            fqn = signature.inputs_to_buffers[node.name]
            kind, name = InputKind.BUFFER, "b_" + fqn.replace(".", "_")
            persistent = fqn not in non_persistent
        else:
            fqn, kind, name, persistent = None, InputKind.USER_INPUT, next(users), None
        node._rename(name)
        if node.name != name:
            raise ValueError(f"placeholder {name} would be named {node.name}")
        node.target = name
        specs.append(InputSpec(kind, TensorArgument(name=name), target=fqn,
                               persistent=persistent))
    if next(users, None) is not None:
        raise ValueError("fewer user inputs than arguments")
    (output,) = [n for n in graph.nodes if n.op == "output"]
    if signature.user_inputs_to_mutate:
        raise TypeError("forward writes its inputs")
    updates = dict(signature.buffers_to_mutate)  # value name -> buffer FQN
    outputs = [OutputSpec(OutputKind.BUFFER_MUTATION, TensorArgument(name=a.name),
                          updates[a.name]) if a.name in updates else
               OutputSpec(OutputKind.USER_OUTPUT, TensorArgument(name=a.name), None)
               for a in output.args[0]]
    return CapturedProgram(graph, ExportGraphSignature(specs, outputs))


def _export_decompositions() -> dict:
    """``torch.export.default_decompositions()`` less the fused ops the capture
    keeps whole (:data:`ir.torch_compat.KEPT_FUSED_OPS`), materialised: the table
    collects every op with a CompositeImplicitAutograd kernel when first
    read (~60 ms, in every capture). Made once per process while no such op
    is registered anew (~0.3 ms to count them); each caller gets its own copy."""
    return capture_decompositions(_materialised_decompositions(*decomposition_registry_size()))


@functools.lru_cache(maxsize=1)
def _materialised_decompositions(cia_ops: int, python_decompositions: int) -> dict:
    """The table of :func:`_export_decompositions` for that many registered
    CompositeImplicitAutograd ops and Python decompositions."""
    from torch.export import default_decompositions

    return default_decompositions().materialize()


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:300]
