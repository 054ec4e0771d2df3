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
import io
import logging
import os
import re
import tempfile
import traceback
import warnings
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

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
                eager = eager_error(model, args)
                reads = value_read(model, (export_err, fx_err, eager))
                if reads is not None:
                    raise TraceError(reads) from export_err
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


#: What torch raises where forward reads a tensor's value in Python (a branch
#: on it, ``.item()``): on fake tensors (export, and the CPU plans' capture), and
#: on meta tensors (a GPU plan's capture), by the message.
_VALUE_READ_ERRORS = ("GuardOnDataDependentSymNode", "DataDependentOutputException")
_META_VALUE_READ = "cannot be called on meta tensors"
#: The project's own packages: a frame in them is no line of the user's model.
_OWN_DIRS = tuple(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), d)
                  + os.sep for d in ("ir", "planner", "codegen", "costmodel", "app", "training"))
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


def value_read(model: torch.nn.Module,
               errors: Sequence[BaseException | None]) -> str | None:
    """The one-line reason a capture failed when one of ``errors`` (or an
    exception it was raised from) is torch saying forward reads a tensor's
    value in Python, else None. It names the construct (a branch on a tensor's
    value, or ``.item()``), the model's source line (``file:line`` and its code,
    from the error's traceback) and the fix."""
    chain = [e for err in errors if err is not None for e in _chain(err)]
    hits = [e for e in chain if type(e).__name__ in _VALUE_READ_ERRORS
            or _META_VALUE_READ in str(e)]
    if not hits:
        return None
    frame = next((f for f in map(_user_frame, hits) if f is not None), None)
    return value_read_reason(type(model).__name__, frame)


def value_read_reason(model_name: str, frame: traceback.FrameSummary | None) -> str:
    """``model_name``'s forward reads a tensor's value at ``frame`` (None: at a
    line torch does not give), in words: the construct, where, and the fix."""
    code = (frame.line or "").strip() if frame is not None else ""
    code = code.split("  #")[0].rstrip()  # less an inline comment
    where = ""
    if frame is not None:
        path = os.path.relpath(frame.filename) if frame.filename.startswith(os.getcwd()) \
            else frame.filename
        where = f" at {path}:{frame.lineno}" + (f" (`{code[:80]}`)" if code else "")
    reads_number = re.search(r"\.(item|tolist)\(\)", code) or (
        re.search(r"\b(int|float)\(", code) and not re.match(r"(el)?if |while ", code))
    if reads_number:
        return (f"{model_name}'s forward reads a tensor's value as a Python number "
                f"(.item()){where}, which one captured program cannot hold; keep it a tensor "
                f"(torch ops take tensors), or move that code out of forward")
    return (f"{model_name}'s forward branches on a tensor's value (data-dependent control "
            f"flow){where}, which one captured program cannot follow; compute both sides "
            f"and pick with torch.where, use torch.cond, or move the branch out of forward")


def _chain(err: BaseException) -> list[BaseException]:
    """``err`` and the exceptions it was raised from or during."""
    out: list[BaseException] = []
    while err is not None and err not in out:
        out.append(err)
        err = err.__cause__ or err.__context__
    return out


def _user_frame(err: BaseException) -> traceback.FrameSummary | None:
    """The innermost frame of ``err``'s traceback in the model's own code: a
    source file outside torch and outside this project's packages."""
    for frame in reversed(traceback.extract_tb(err.__traceback__)):
        name = os.path.abspath(frame.filename)
        if frame.filename.startswith("<") or name.startswith(_TORCH_DIR) or \
                name.startswith(_OWN_DIRS):
            continue
        return frame
    return None


@contextlib.contextmanager
def torch_output_logged() -> Iterator[io.StringIO]:
    """Keep what torch prints or logs while a model is captured (the program
    dumps of a failed export, symbolic-shape warnings) off the terminal: it
    goes to the yielded buffer (:func:`write_torch_log` writes it to a file
    for an error to name). Python's stdout and stderr and torch's logging
    handlers are redirected; warnings are left to the caller."""
    buffer = io.StringIO()
    handlers = []
    for name in ["torch", *[n for n in logging.root.manager.loggerDict
                            if n.startswith("torch.")]]:
        logger = logging.getLogger(name)
        for handler in logger.handlers:
            if type(handler) is logging.StreamHandler:
                # swapped, not setStream(): that flushes the old stream, which a
                # handler made under a replaced sys.stderr may hold closed
                handlers.append((handler, handler.stream))
                handler.stream = buffer
    try:
        with contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(buffer):
            yield buffer
    finally:
        for handler, stream in handlers:
            handler.stream = stream


def write_torch_log(text: str) -> str | None:
    """Write torch's output ``text`` (from :func:`torch_output_logged`) to a
    log file in the temporary directory and return its path (None when
    there is nothing to write, or it cannot be written)."""
    if not text.strip():
        return None
    path = os.path.join(tempfile.gettempdir(), f"planner-capture-{os.getpid()}.log")
    try:
        with open(path, "w") as f:
            f.write(text)
    except OSError:
        return None
    return path


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


def eager_error(model: torch.nn.Module, args: tuple) -> Exception | None:
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
    :func:`capture` of the same model (:mod:`ir.block_capture.trace` checks each new
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
