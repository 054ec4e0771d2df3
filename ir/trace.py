"""Capture a model's forward program as an aten-level graph.

``capture`` runs ``torch.export.export(strict=False)`` and decomposes the result to
core ATen, which is the op set DTensor shards at run time; ``capture_in_one_pass``
gives the same program from one trace (``aot_export_module``); ``trace`` turns that
program into the planner's :class:`ir.graph.Graph` with shapes, FLOPs and bytes.
Works on the meta device, so a 175B-parameter model is captured without memory.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import operator
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch
from torch.export.graph_signature import (
    ExportGraphSignature, InputKind, InputSpec, OutputKind, OutputSpec, TensorArgument,
)
from torch.utils.flop_counter import flop_registry

from ir.graph import BUFFER, INPUT, OP, PARAM, Graph, Node, TensorInfo
from ir.torch_compat import (SDPA, aot_export_module, capture_decompositions,
                             fused_attention_layout, fx_without_stack_traces)


class TraceError(RuntimeError):
    """Neither torch.export nor torch.fx could capture the model."""


# Ops that only re-describe memory; they move no bytes.
_VIEW_OPS = {
    "aten.view.default", "aten._unsafe_view.default", "aten.permute.default",
    "aten.expand.default", "aten.unsqueeze.default", "aten.squeeze.dims",
    "aten.squeeze.dim", "aten.t.default", "aten.transpose.int", "aten.slice.Tensor",
    "aten.select.int", "aten.alias.default", "aten.split_with_sizes.default",
    "aten.split.Tensor", "aten.unbind.int", "aten.detach.default",
}


def _as_tuple(example_inputs: Any) -> tuple:
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
    args = _as_tuple(example_inputs)
    with warnings.catch_warnings(), fx_without_stack_traces(), fused_attention_layout():
        warnings.simplefilter("ignore")
        try:
            ep = torch.export.export(model, args, strict=False)
        except Exception as export_err:  # noqa: BLE001 - both errors are reported
            try:
                gm = torch.fx.symbolic_trace(model)
                ep = torch.export.export(gm, args, strict=False)
            except Exception as fx_err:  # noqa: BLE001
                raise TraceError(
                    f"cannot capture {type(model).__name__}: torch.export failed with "
                    f"'{_first_line(export_err)}' and torch.fx.symbolic_trace failed with "
                    f"'{_first_line(fx_err)}'; remove data-dependent Python control flow "
                    f"from its forward() or wrap that part in a leaf module"
                ) from fx_err
        return ep.run_decompositions(_export_decompositions())


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
    args = _as_tuple(example_inputs)
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
    outputs = [OutputSpec(OutputKind.USER_OUTPUT, TensorArgument(name=a.name), None)
               for a in output.args[0]]
    return CapturedProgram(graph, ExportGraphSignature(specs, outputs))


def _export_decompositions() -> dict:
    """``torch.export.default_decompositions()`` less the fused ops the capture
    keeps whole (:data:`ir.torch_compat.KEPT_FUSED_OPS`), materialised: the table
    collects every op with a CompositeImplicitAutograd kernel when first
    read (~60 ms, in every capture). Made once per process while no such op
    is registered anew (~0.3 ms to count them); each caller gets its own copy."""
    from torch._decomp import decomposition_table

    return capture_decompositions(_materialised_decompositions(
        len(torch._C._dispatch_get_registrations_for_dispatch_key("CompositeImplicitAutograd")),
        len(decomposition_table)))


@functools.lru_cache(maxsize=1)
def _materialised_decompositions(cia_ops: int, python_decompositions: int) -> dict:
    """The table of :func:`_export_decompositions` for that many registered
    CompositeImplicitAutograd ops and Python decompositions."""
    from torch.export import default_decompositions

    return default_decompositions().materialize()


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:300]


def _tensor_info(val: Any) -> TensorInfo | None:
    if isinstance(val, torch.Tensor):
        return TensorInfo(tuple(int(d) for d in val.shape), val.dtype)
    return None


def _outputs_of(val: Any) -> tuple[TensorInfo, ...]:
    if isinstance(val, (tuple, list)):
        return tuple(t for t in (_tensor_info(v) for v in val) if t is not None)
    t = _tensor_info(val)
    return (t,) if t is not None else ()


def _module_path(fx_node: torch.fx.Node) -> str:
    stack = fx_node.meta.get("nn_module_stack")
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    return path if isinstance(path, str) else ""


def attention_flops(query: Sequence[int], key: Sequence[int], value: Sequence[int],
                    is_causal: bool) -> float:
    """Forward FLOPs the fused attention kernel executes for ``query`` [..., Sq, D],
    ``key`` [..., Sk, D] and ``value`` [..., Sk, Dv]: the two products
    ``Q K^T`` and ``P V`` (2 FLOPs a multiply-add each); with a causal mask the
    flash kernels skip the blocks above the diagonal, about half of them."""
    *batch, sq, d = query
    sk, dv = key[-2], value[-1]
    heads = 1
    for n in batch:
        heads *= int(n)
    full = 2.0 * heads * sq * sk * (d + dv)
    return full / 2 if is_causal else full


def _sdpa_is_causal(fx_node: torch.fx.Node) -> bool:
    if "is_causal" in fx_node.kwargs:
        return bool(fx_node.kwargs["is_causal"])
    return bool(fx_node.args[5]) if len(fx_node.args) > 5 else False


def _flops(fx_node: torch.fx.Node) -> float:
    target = fx_node.target
    if target is SDPA:
        q, k, v = (a.meta["val"].shape for a in fx_node.args[:3])
        return attention_flops(q, k, v, _sdpa_is_causal(fx_node))
    packet = getattr(target, "overloadpacket", None)
    formula = flop_registry.get(packet)
    if formula is None:
        return 0.0
    args, kwargs = torch.fx.node.map_arg(
        (fx_node.args, fx_node.kwargs), lambda n: n.meta.get("val"))
    return float(formula(*args, **kwargs, out_val=fx_node.meta.get("val")))


def graph_from_exported(ep: torch.export.ExportedProgram, model_name: str = "") -> Graph:
    """Build a :class:`Graph` from a (decomposed) exported program."""
    sig = ep.graph_signature
    params = dict(sig.inputs_to_parameters)
    buffers = dict(sig.inputs_to_buffers)
    nodes: list[Node] = []
    output_names: tuple[str, ...] = ()
    for fx_node in ep.graph.nodes:
        val = fx_node.meta.get("val")
        if fx_node.op == "placeholder":
            if fx_node.name in params:
                kind, fqn = PARAM, params[fx_node.name]
            elif fx_node.name in buffers:
                kind, fqn = BUFFER, buffers[fx_node.name]
            else:
                kind, fqn = INPUT, None
            nodes.append(Node(name=fx_node.name, kind=kind, target=fqn or "input",
                              outputs=_outputs_of(val), fqn=fqn))
        elif fx_node.op == "call_function":
            tensor_args = [a for a in fx_node.all_input_nodes]
            flat_args = []
            torch.fx.node.map_arg((fx_node.args, fx_node.kwargs), flat_args.append)
            arg_names = tuple(a.name for a in flat_args)
            inputs = tuple(_tensor_info(a.meta.get("val")) for a in flat_args)
            outputs = _outputs_of(val)
            if fx_node.target is operator.getitem:
                nodes.append(Node(name=fx_node.name, kind=OP, target="getitem",
                                  args=(fx_node.args[0].name,), arg_index=int(fx_node.args[1]),
                                  inputs=(), outputs=outputs,
                                  module_path=_module_path(fx_node)))
                continue
            target = str(fx_node.target)
            moved = 0 if target in _VIEW_OPS else (
                sum(t.nbytes for t in inputs if t) + sum(t.nbytes for t in outputs))
            read_params = tuple(params[a.name] for a in tensor_args if a.name in params)
            nodes.append(Node(
                name=fx_node.name, kind=OP, target=target, args=arg_names,
                inputs=tuple(t if t else TensorInfo((), torch.float32) for t in inputs),
                outputs=outputs, flops=_flops(fx_node), bytes_moved=float(moved),
                params=read_params, module_path=_module_path(fx_node)))
        elif fx_node.op == "output":
            outs = []
            torch.fx.node.map_arg(fx_node.args, outs.append)
            output_names = tuple(o.name for o in outs)
    return Graph(nodes=nodes, output_names=output_names, model_name=model_name, exported=ep)


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
    """
    import os

    from ir.fast_trace import SynthesizedProgram, fast_trace

    if os.environ.get("PLANNER_FULL_TRACE", "0") in ("", "0"):
        earlier = like.exported if like is not None else None
        graph = fast_trace(model, example_inputs, like=earlier if isinstance(
            earlier, SynthesizedProgram) else None, beside=beside)
        if graph is not None:
            return graph
    ep = capture(model, example_inputs)
    return graph_from_exported(ep, model_name=type(model).__name__)
