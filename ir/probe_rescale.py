"""A captured program at another batch size, written out without capturing.

Two captures of the same model at batch sizes ``a`` and ``b`` are the same
``torch.fx`` program except for the integer literals that follow the batch
(view and expand sizes, ``full`` shapes, element counts) and the values of the
nodes. :func:`rescale_program` infers, literal by literal, the affine rule
``c0 + c1 * batch`` (integers, exact) that gives both captures' literals,
writes the program at a third batch size with those literals, and computes
every node's value by running the program on fake tensors
(``torch.fx.passes.fake_tensor_prop``): about a tenth of a second against
seconds for ``torch.export`` and ``run_decompositions``.

Anything else that differs between the two captures (float literals, other
names, targets or wiring) raises :class:`RescaleError`. Two points cannot tell
an affine rule from every other one, so callers check the result against a
rule confirmed on a third capture (:meth:`ir.rescale.BatchRule.matches`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch.export.graph_signature import ExportGraphSignature, InputKind


class RescaleError(Exception):
    """The two captures do not differ by batch-affine integer literals alone."""


@dataclass
class RescaledProgram:
    """The parts of an ``ExportedProgram`` the planner reads: ``graph`` (node
    values in ``meta["val"]``) and ``graph_signature``."""

    graph: torch.fx.Graph
    graph_signature: ExportGraphSignature


def rescale_program(a: Any, batch_a: int, b: Any, batch_b: int, batch: int,
                    example_inputs: Sequence[Any]) -> RescaledProgram:
    """The program of captures ``a`` (at ``batch_a``) and ``b`` (at ``batch_b``)
    at ``batch``, for ``example_inputs`` (the user inputs, in order, with dim 0
    of size ``batch``).

    ``a`` and ``b`` are exported programs (or anything with ``graph`` and
    ``graph_signature``) of the same model; the result keeps ``a``'s node
    names, metadata other than values, and signature.

    Raises:
        RescaleError: the captures differ in more than batch-affine integers,
            or the program does not run on the new shapes.
    """
    if len({batch_a, batch_b, batch}) != 3:
        raise RescaleError("three different batch sizes are needed")
    nodes_a, nodes_b = list(a.graph.nodes), list(b.graph.nodes)
    if len(nodes_a) != len(nodes_b):
        raise RescaleError(f"the captures have {len(nodes_a)} and {len(nodes_b)} nodes")
    rule = _LiteralRule(batch_a, batch_b, batch)
    graph = torch.fx.Graph()
    made: dict[str, torch.fx.Node] = {}
    for x, y in zip(nodes_a, nodes_b):
        if (x.op, x.name, x.target) != (y.op, y.name, y.target):
            raise RescaleError(f"node {x.name} differs from {y.name} between the captures")
        args = rule.at(x.args, y.args, made)
        kwargs = rule.at(x.kwargs, y.kwargs, made)
        node = graph.create_node(x.op, x.target, args, kwargs, name=x.name)
        if node.name != x.name:
            raise RescaleError(f"node name {x.name} would change")
        node.meta = {k: v for k, v in x.meta.items() if k not in ("val", "tensor_meta")}
        made[x.name] = node
    _propagate(graph, a, example_inputs)
    return RescaledProgram(graph, a.graph_signature)


class _LiteralRule:
    """Writes the arguments of a node at the new batch size from its two captures."""

    def __init__(self, batch_a: int, batch_b: int, batch: int):
        self.batch_a, self.batch_b, self.batch = batch_a, batch_b, batch

    def at(self, x: Any, y: Any, made: dict[str, torch.fx.Node]) -> Any:
        if isinstance(x, torch.fx.Node):
            if not isinstance(y, torch.fx.Node) or x.name != y.name:
                raise RescaleError(f"an argument of another node ({x.name}) between the captures")
            return made[x.name]
        if type(x) is not type(y):
            raise RescaleError(f"literal {x!r} against {y!r} between the captures")
        if isinstance(x, (list, tuple)):
            if len(x) != len(y):
                raise RescaleError(f"literal {x!r} against {y!r} between the captures")
            return type(x)(self.at(p, q, made) for p, q in zip(x, y))
        if isinstance(x, dict):
            if x.keys() != y.keys():
                raise RescaleError(f"keyword arguments {sorted(x)} against {sorted(y)}")
            return {k: self.at(x[k], y[k], made) for k in x}
        if x == y:
            return x
        if type(x) is int:
            slope, rest = divmod(x - y, self.batch_a - self.batch_b)
            if rest:
                raise RescaleError(f"literal {x} at batch {self.batch_a} and {y} at batch "
                                   f"{self.batch_b} is not an integer multiple of the batch")
            return x - slope * self.batch_a + slope * self.batch
        raise RescaleError(f"literal {x!r} against {y!r} between the captures")


def _propagate(graph: torch.fx.Graph, source: Any, example_inputs: Sequence[Any]) -> None:
    """Set every node's ``meta["val"]``: parameters and buffers as in ``source``,
    user inputs from ``example_inputs``, the rest by running on fake tensors."""
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    from ir.torch_compat import fake_tensor_mode_type, kept_fused_ops

    specs = {s.arg.name: s for s in source.graph_signature.input_specs}
    values = {n.name: n.meta.get("val") for n in source.graph.nodes if n.op == "placeholder"}
    user = iter(example_inputs)
    mode = fake_tensor_mode_type()()
    inputs = []
    for node in graph.nodes:
        if node.op != "placeholder":
            continue
        spec = specs.get(node.name)
        if spec is None:
            raise RescaleError(f"placeholder {node.name} is not in the signature")
        if spec.kind == InputKind.USER_INPUT:
            value = next(user, None)
            if not isinstance(value, torch.Tensor):
                raise RescaleError("a user input that is not a tensor")
            inputs.append(mode.from_tensor(value))
        elif spec.kind in (InputKind.PARAMETER, InputKind.BUFFER):
            val = values[node.name]
            if not isinstance(val, torch.Tensor):
                raise RescaleError(f"placeholder {node.name} has no tensor value")
            with mode:  # a fake tensor of the same layout, nothing allocated
                fake = torch.empty_strided(val.shape, val.stride(), dtype=val.dtype,
                                           device=val.device)
            inputs.append(fake.requires_grad_(val.requires_grad))
        else:
            raise RescaleError(f"input of kind {spec.kind.name}")
    if next(user, None) is not None:
        raise RescaleError("more user inputs than the captured program takes")
    try:
        with kept_fused_ops():  # fused attention stays one op, laid out as the kernels write it
            FakeTensorProp(torch.fx.GraphModule(torch.nn.Module(), graph),
                           mode).propagate_dont_convert_inputs(*inputs)
    except Exception as err:  # noqa: BLE001 - the shapes do not fit the program
        raise RescaleError(f"the program does not run at the new batch size: {err}") from err
