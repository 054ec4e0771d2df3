"""Read a captured core-ATen program as the planner's :class:`ir.graph.Graph`.

:func:`graph_from_exported` gives every placeholder and aten call of an
``ExportedProgram`` (or a program with its ``graph`` and ``graph_signature``:
:class:`ir.program_capture.CapturedProgram`,
:class:`ir.block_capture.program.SynthesizedProgram`) one :class:`ir.node.Node` with
its shapes, forward FLOPs, bytes moved, parameters and module path.

Tied parameters (one tensor under several names, such as GPT-2's embedding
and LM head) are one parameter of the Graph: :func:`tied_parameters` names
them, and the Graph keeps the first name's placeholder, its uses standing for
every name's.
"""

from __future__ import annotations

import operator
from typing import Any, Sequence

import torch
from torch.export.graph_signature import OutputKind
from torch.utils.flop_counter import flop_registry

from ir.graph import Graph
from ir.grouped_mm import GROUPED_MATMULS, grouped_mm_flops
from ir.node import BUFFER, INPUT, OP, PARAM, Node, TensorInfo
from ir.torch_compat import SDPA

# Ops that only re-describe memory; they move no bytes.
_VIEW_OPS = {
    "aten.view.default", "aten._unsafe_view.default", "aten.permute.default",
    "aten.expand.default", "aten.unsqueeze.default", "aten.squeeze.dims",
    "aten.squeeze.dim", "aten.t.default", "aten.transpose.int", "aten.slice.Tensor",
    "aten.select.int", "aten.alias.default", "aten.split_with_sizes.default",
    "aten.split.Tensor", "aten.unbind.int", "aten.detach.default",
}


# The view whose input must have strides it can be viewed with (the others of
# _VIEW_OPS take any strides).
_STRIDED_VIEW = "aten.view.default"


def layout_bound_args(fx_node: torch.fx.Node, tensor_args: Sequence[torch.fx.Node],
                      memo: dict[tuple[str, str], bool]) -> tuple[int, ...]:
    """The indices of ``tensor_args`` that ``fx_node`` must read as their
    producer made them: ``fx_node`` is a view op, the views from it on reach an
    ``aten.view``, and the argument is not contiguous or is a view of one.

    The program was captured with the strides each op gave its output (the
    fused attention writes [batch, seq, heads, dim] and returns it transposed,
    so the heads merge back with a view, no copy). DTensor's redistribute
    returns contiguous shards, and describes the global tensor with the
    strides DTensor's own rules gave it, which for such a chain are not the
    capture's: a reshard anywhere between the attention and the view that
    merges the heads makes that view fail ("Cannot view a tensor with shape
    ... and strides ..."), on DTensor and on its gradient. Elsewhere a
    contiguous tensor stays contiguous when resharded, and is free.
    ``memo``: shared by the calls on one program."""
    if str(fx_node.target) not in _VIEW_OPS or not _ends_in_view(fx_node, memo):
        return ()
    return tuple(k for k, arg in enumerate(tensor_args) if _strided(arg, memo))


def _strided(node: torch.fx.Node, memo: dict[tuple[str, str], bool]) -> bool:
    """Whether ``node``'s value is not contiguous, or is a view op's of such a
    value (its layout rests on strides the capture chose)."""
    key = ("strided", node.name)
    if key not in memo:
        val = node.meta.get("val")
        memo[key] = False  # a cycle cannot occur; this only guards recursion
        memo[key] = (isinstance(val, torch.Tensor) and val.dim() > 1
                     and not _is_contiguous(val)) or (
            str(node.target) in _VIEW_OPS
            and any(_strided(a, memo) for a in node.all_input_nodes))
    return memo[key]


def _is_contiguous(val: torch.Tensor) -> bool:
    try:
        return bool(val.is_contiguous())
    except (RuntimeError, TypeError):  # symbolic strides: assume the plain layout
        return True


def _ends_in_view(fx_node: torch.fx.Node, memo: dict[tuple[str, str], bool]) -> bool:
    """Whether ``fx_node`` (a view op) or a view op reached from it through
    view ops only is an ``aten.view``."""
    key = ("ends in view", fx_node.name)
    if key not in memo:
        memo[key] = False  # a cycle cannot occur; this only guards recursion
        memo[key] = str(fx_node.target) == _STRIDED_VIEW or any(
            str(u.target) in _VIEW_OPS and _ends_in_view(u, memo) for u in fx_node.users)
    return memo[key]


def _tensor_info(val: Any) -> TensorInfo | None:
    if isinstance(val, torch.Tensor):
        return TensorInfo(tuple(int(d) for d in val.shape), val.dtype)
    return None


def _outputs_of(val: Any) -> tuple[TensorInfo, ...]:
    if isinstance(val, (tuple, list)):
        return tuple(t for t in (_tensor_info(v) for v in val) if t is not None)
    t = _tensor_info(val)
    return (t,) if t is not None else ()


def module_path(fx_node: torch.fx.Node) -> str:
    """FQN of the innermost module that issued ``fx_node`` ("" = the root or none)."""
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
    if str(target) in GROUPED_MATMULS:
        x, w = (a.meta["val"].shape for a in fx_node.args[:2])
        return grouped_mm_flops(x, w)
    packet = getattr(target, "overloadpacket", None)
    formula = flop_registry.get(packet)
    if formula is None:
        return 0.0
    args, kwargs = torch.fx.node.map_arg(
        (fx_node.args, fx_node.kwargs), lambda n: n.meta.get("val"))
    return float(formula(*args, **kwargs, out_val=fx_node.meta.get("val")))


def tied_parameters(model: torch.nn.Module) -> dict[str, str]:
    """Every further name of a parameter the model holds under several names
    -> its first name (the one ``named_parameters()`` gives); empty when none
    is tied."""
    first: dict[int, str] = {}
    tied: dict[str, str] = {}
    for fqn, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            tied[fqn] = first[id(p)]
        else:
            first[id(p)] = fqn
    return tied


def _rewire_tied(ep: Any, params: dict[str, str], tied: dict[str, str]) -> set[str]:
    """Point every use of a tied name's placeholder in ``ep``'s graph at the
    first name's placeholder; return the tied names' placeholders."""
    placeholder_of = {fqn: name for name, fqn in params.items()}
    nodes = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    rewired: set[str] = set()
    for name, fqn in params.items():
        first = placeholder_of.get(tied.get(fqn, ""))
        if first is not None and name in nodes:
            nodes[name].replace_all_uses_with(nodes[first])
            rewired.add(name)
    return rewired


def graph_from_exported(ep: torch.export.ExportedProgram, model_name: str = "",
                        tied: dict[str, str] | None = None) -> Graph:
    """Build a :class:`Graph` from a (decomposed) exported program.

    ``tied``: :func:`tied_parameters` of the model; the placeholder of a tied
    name is left out of the Graph, and the program's ops that read it are
    rewired, in ``ep`` itself, to read the first name's placeholder (so the
    program the executor runs reads one parameter where the Graph plans one)."""
    sig = ep.graph_signature
    params = dict(sig.inputs_to_parameters)
    buffers = dict(sig.inputs_to_buffers)
    renamed = _rewire_tied(ep, params, tied or {})
    nodes: list[Node] = []
    layout_memo: dict[tuple[str, str], bool] = {}
    # a written-out program's nodes share the values of the block they copy,
    # and its ops a few targets: each read once (the values live in ep's graph)
    infos: dict[int, TensorInfo | None] = {}
    targets: dict[Any, str] = {}

    def info(val: Any) -> TensorInfo | None:
        found = infos.get(id(val), infos)
        if found is infos:
            found = infos[id(val)] = _tensor_info(val)
        return found

    for fx_node in ep.graph.nodes:
        val = fx_node.meta.get("val")
        if fx_node.name in renamed:
            continue
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
            inputs = tuple(info(a.meta.get("val")) for a in flat_args)
            outputs = _outputs_of(val)
            if fx_node.target is operator.getitem:
                nodes.append(Node(name=fx_node.name, kind=OP, target="getitem",
                                  args=(fx_node.args[0].name,), arg_index=int(fx_node.args[1]),
                                  inputs=(), outputs=outputs,
                                  module_path=module_path(fx_node)))
                continue
            target = targets.get(fx_node.target)
            if target is None:
                target = targets[fx_node.target] = str(fx_node.target)
            moved = 0 if target in _VIEW_OPS else (
                sum(t.nbytes for t in inputs if t) + sum(t.nbytes for t in outputs))
            read_params = tuple(params[a.name] for a in tensor_args if a.name in params)
            nodes.append(Node(
                name=fx_node.name, kind=OP, target=target, args=arg_names,
                inputs=tuple(t if t else TensorInfo((), torch.float32) for t in inputs),
                outputs=outputs, flops=_flops(fx_node), bytes_moved=float(moved),
                params=read_params, module_path=module_path(fx_node),
                layout_bound=layout_bound_args(fx_node, flat_args, layout_memo)))
    output_names, buffer_updates = _outputs_by_kind(sig)
    return Graph(nodes=nodes, output_names=output_names, model_name=model_name, exported=ep,
                 buffer_updates=buffer_updates)


def _outputs_by_kind(sig: Any) -> tuple[tuple[str, ...], dict[str, str]]:
    """The user outputs' value names (the loss first) and the buffer updates
    (value name -> buffer FQN) of a capture's signature: a buffer forward
    writes is state, never an output, whatever its position."""
    user: list[str] = []
    updates: dict[str, str] = {}
    for spec in sig.output_specs:
        name = getattr(spec.arg, "name", None)
        if spec.kind == OutputKind.BUFFER_MUTATION:
            updates[name] = spec.target
        elif spec.kind in (OutputKind.USER_OUTPUT, OutputKind.LOSS_OUTPUT) and name is not None:
            user.append(name)
        elif name is not None:
            from ir.program_capture import TraceError

            raise TraceError(
                f"the captured program returns {name} as {spec.kind.name} "
                f"({spec.target}); the planner supports a forward that returns the loss "
                f"and updates buffers, not one that writes its inputs")
    return tuple(user), updates
