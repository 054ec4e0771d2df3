"""The program of another batch size, derived instead of captured again.

Two captures of the same model at batch sizes ``a`` and ``b`` differ only in
shapes, FLOPs and bytes, and for the models the planner handles these are affine
in the batch size: every tensor dimension is fixed or a multiple of the batch
(``[b, T, C]``, ``[b * T, C]``, ``[b, H, T, T]``), and every op's FLOPs and bytes
are ``c0 + c1 * batch``. :func:`batch_rule` infers that rule from two captures
and :meth:`BatchRule.at` writes the program at any other batch size. The rule is
refused (None: capture for real) when the captures differ in anything else, or
a number does not follow it exactly in integers.

Two points cannot tell an affine rule from, say, a capacity rounded up to an
integer (MoE dispatch), so callers should check the rule against a third
capture before relying on it (:meth:`BatchRule.matches`). A derived program has
no ``exported`` program: DTensor's strategy queries need a real capture's fake
tensors, so it is for pricing known placements only.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ir.graph import Graph, Node, TensorInfo

# A dimension rule: ("fixed", size) or ("batch", size per batch element).
_Dim = tuple[str, int]


@dataclass(frozen=True)
class _NodeRule:
    inputs: tuple[tuple[_Dim, ...], ...]
    outputs: tuple[tuple[_Dim, ...], ...]
    flops: tuple[int, int]  # (constant, per batch element)
    bytes_moved: tuple[int, int]


@dataclass
class BatchRule:
    """How a captured program's numbers follow the batch size."""

    template: Graph
    rules: list[_NodeRule]

    def at(self, batch: int) -> Graph:
        """The program at ``batch`` (no ``exported`` program)."""
        nodes = []
        for n, r in zip(self.template.nodes, self.rules):
            nodes.append(dataclasses.replace(
                n, inputs=tuple(_info(t, d, batch) for t, d in zip(n.inputs, r.inputs)),
                outputs=tuple(_info(t, d, batch) for t, d in zip(n.outputs, r.outputs)),
                flops=_number(n.flops, r.flops, batch),
                bytes_moved=_number(n.bytes_moved, r.bytes_moved, batch)))
        return Graph(nodes, self.template.output_names, self.template.model_name,
                     exported=None, grad_inputs=self.template.grad_inputs,
                     buffer_updates=dict(self.template.buffer_updates))

    def matches(self, graph: Graph, batch: int) -> bool:
        """Whether the rule gives exactly ``graph``, a capture at ``batch``."""
        derived = self.at(batch)
        return len(derived.nodes) == len(graph.nodes) and all(
            _same(x, y) for x, y in zip(derived.nodes, graph.nodes))


def batch_rule(a: Graph, batch_a: int, b: Graph, batch_b: int) -> BatchRule | None:
    """The rule that turns capture ``a`` (at ``batch_a``) into capture ``b`` (at
    ``batch_b``), or None when the two do not differ by an affine batch rule."""
    if batch_a == batch_b or len(a.nodes) != len(b.nodes) or a.output_names != b.output_names:
        return None
    rules = []
    for x, y in zip(a.nodes, b.nodes):
        if (x.name, x.kind, x.target, x.args, x.arg_index, x.params, x.module_path, x.fqn) != \
                (y.name, y.kind, y.target, y.args, y.arg_index, y.params, y.module_path, y.fqn):
            return None
        inputs = _tensors(x.inputs, y.inputs, batch_a, batch_b)
        outputs = _tensors(x.outputs, y.outputs, batch_a, batch_b)
        flops = _affine(x.flops, y.flops, batch_a, batch_b)
        moved = _affine(x.bytes_moved, y.bytes_moved, batch_a, batch_b)
        if inputs is None or outputs is None or flops is None or moved is None:
            return None
        rules.append(_NodeRule(inputs, outputs, flops, moved))
    return BatchRule(a, rules)


def _tensors(xs: tuple[TensorInfo, ...], ys: tuple[TensorInfo, ...], batch_a: int,
             batch_b: int) -> tuple[tuple[_Dim, ...], ...] | None:
    if len(xs) != len(ys):
        return None
    out = []
    for x, y in zip(xs, ys):
        if x.dtype != y.dtype or len(x.shape) != len(y.shape):
            return None
        dims = []
        for da, db in zip(x.shape, y.shape):
            if da == db:
                dims.append(("fixed", int(da)))
            elif da % batch_a == 0 and da // batch_a * batch_b == db:
                dims.append(("batch", int(da) // batch_a))
            else:
                return None
        out.append(tuple(dims))
    return tuple(out)


def _affine(fa: float, fb: float, batch_a: int, batch_b: int) -> tuple[int, int] | None:
    """(c0, c1) with ``c0 + c1 * batch`` equal to both, in integers, or None."""
    if not (float(fa).is_integer() and float(fb).is_integer()):
        return None
    fa, fb = int(fa), int(fb)
    slope, rest = divmod(fa - fb, batch_a - batch_b)
    if rest:
        return None
    return fa - slope * batch_a, slope


def _info(t: TensorInfo, dims: tuple[_Dim, ...], batch: int) -> TensorInfo:
    return TensorInfo(tuple(size if kind == "fixed" else size * batch for kind, size in dims),
                      t.dtype)


def _number(value: float, rule: tuple[int, int], batch: int) -> float:
    """``c0 + c1 * batch`` with the captured value's type."""
    return type(value)(rule[0] + rule[1] * batch)


def _same(x: Node, y: Node) -> bool:
    return (x.name, x.kind, x.target, x.args, x.arg_index, x.inputs, x.outputs, x.flops,
            x.bytes_moved, x.params, x.module_path, x.fqn) == \
        (y.name, y.kind, y.target, y.args, y.arg_index, y.inputs, y.outputs, y.flops,
         y.bytes_moved, y.params, y.module_path, y.fqn)
