"""Which tensors autograd keeps for the backward of a captured forward program.

Units: bytes.

An op's output is kept from the forward to the backward only when some op's
derivative formula needs it (torch's ``derivatives.yaml``): a matmul keeps
both operands, a GELU its input, a softmax its result, an addition nothing.
:data:`SAVED` states, for the core ATen ops the zoo's models and usual
transformers capture to, which tensor arguments (by position) and which of its
own outputs each op saves; ``tests/test_saved_tensors.py`` checks every rule
against what autograd really packs (``torch.autograd.graph.saved_tensors_hooks``).
A saved view keeps its base, so a saved value is charged to the op that wrote
its memory (parameters and user inputs are counted with the training state and
the batch). An op with no rule is assumed to save its floating inputs.

The fused attention kernel saves q, k, v, its output and a float32 log-sum-exp
of ``b·h·s`` elements (:func:`extra_saved_bytes`), never an s x s tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

from costmodel.compute import FUSED_ATTENTION
from ir.graph import OP, Graph, Node

__all__ = ["SavedRule", "SAVED", "saved_outputs", "savers_of", "release_points", "extra_saved_bytes"]


@dataclass(frozen=True)
class SavedRule:
    """What one op keeps for its backward.

    Attributes:
        inputs: positions (in ``Node.args``) of the tensor arguments it saves;
            ``"both_operands"`` rules save argument i only when another operand
            needs a gradient (a product keeps x for dW and W for dx).
        outputs: indices of its own outputs it saves.
        operands: for products, the positions of the two operands.
    """

    inputs: tuple[int, ...] = ()
    outputs: tuple[int, ...] = ()
    operands: tuple[int, int] | None = None


_PRODUCT_01 = SavedRule(operands=(0, 1))
_NOTHING = SavedRule()
_INPUT0 = SavedRule(inputs=(0,))
_RESULT = SavedRule(outputs=(0,))

#: aten overload -> :class:`SavedRule`.
SAVED: Mapping[str, SavedRule] = {
    # products: each operand is kept for the other's gradient
    "aten.mm.default": _PRODUCT_01,
    "aten.bmm.default": _PRODUCT_01,
    "aten.addmm.default": SavedRule(operands=(1, 2)),
    "aten.mul.Tensor": _PRODUCT_01,
    "aten.div.Tensor": SavedRule(inputs=(1,), operands=(0, 1)),
    # element-wise ops whose gradient reads their input
    "aten.gelu.default": _INPUT0,
    "aten.silu.default": _INPUT0,
    "aten.pow.Tensor_Scalar": _INPUT0,
    "aten.log.default": _INPUT0,
    "aten.sin.default": _INPUT0,
    "aten.cos.default": _INPUT0,
    # ... or their result
    "aten.relu.default": _RESULT,
    "aten.sigmoid.default": _RESULT,
    "aten.tanh.default": _RESULT,
    "aten.exp.default": _RESULT,
    "aten.rsqrt.default": _RESULT,
    "aten.sqrt.default": _RESULT,
    "aten._softmax.default": _RESULT,
    "aten._log_softmax.default": _RESULT,
    # normalisation: the input, its scale and shift, and the per-row statistics
    "aten.native_layer_norm.default": SavedRule(inputs=(0, 1, 2), outputs=(1, 2)),
    # dropout keeps its mask
    "aten.native_dropout.default": SavedRule(outputs=(1,)),
    # losses, lookups and selections keep what indexes them
    "aten.nll_loss_forward.default": SavedRule(inputs=(0, 1), outputs=(1,)),
    "aten.embedding.default": SavedRule(inputs=(1,)),
    "aten.where.self": _INPUT0,
    # the fused attention kernel: q, k, v and its output (+ log-sum-exp, below)
    FUSED_ATTENTION: SavedRule(inputs=(0, 1, 2), outputs=(0,)),
    # ops whose gradient needs no tensor of the forward
    **{op: _NOTHING for op in (
        "aten.add.Tensor", "aten.sub.Tensor", "aten.neg.default", "aten.add.Scalar",
        "aten.mul.Scalar", "aten.div.Scalar", "aten.sub.Scalar", "aten.rsub.Scalar",
        "aten.sum.dim_IntList", "aten.sum.default", "aten.mean.dim", "aten.mean.default",
        "aten.cat.default", "aten.clone.default", "aten._to_copy.default", "aten.copy.default",
        "aten.slice_scatter.default", "aten.select_scatter.default", "aten.stack.default",
        "aten.index_select.default", "aten.gather.default", "aten.index.Tensor",
        "aten.scatter_add.default", "aten.masked_fill.Scalar", "aten.fill.Scalar",
        "aten.zeros_like.default", "aten.ones_like.default", "aten.full_like.default",
        "aten.constant_pad_nd.default", "aten.repeat.default", "aten.cumsum.default",
        "aten.topk.default", "aten.sort.default", "aten.amax.default", "aten.max.dim",
    )},
}


def _base_of(graph: Graph, name: str, index: int) -> tuple[str, int]:
    """The (node, output index) whose memory the value ``name``[``index``] is:
    views and tuple projections are followed back to the op that wrote it."""
    node = graph[name]
    while node.kind == OP and node.args:
        if node.target == "getitem":
            node, index = graph[node.args[0]], int(node.arg_index or 0)
            continue
        if node.is_view:
            node, index = graph[node.args[0]], 0
            continue
        break
    return node.name, index


def _rule(node: Node) -> SavedRule:
    rule = SAVED.get(node.target)
    if rule is not None:
        return rule
    # unknown op: assume it saves every floating input
    return SavedRule(inputs=tuple(i for i, t in enumerate(node.inputs) if t.is_float))


def _savers(graph: Graph, requires_grad: Callable[[str], bool] | set[str]
            ) -> list[tuple[str, str, int]]:
    """(saving op, base node, output index) for every tensor an op's backward
    keeps (:func:`saved_outputs`), in the forward's order."""
    needs = requires_grad.__contains__ if isinstance(requires_grad, (set, frozenset)) \
        else requires_grad
    out: list[tuple[str, str, int]] = []
    for node in graph.nodes:
        if node.kind != OP or node.is_view or not needs(node.name):
            continue
        rule = _rule(node)
        positions = set(rule.inputs)
        if rule.operands is not None:
            a, b = rule.operands
            if b < len(node.args) and needs(node.args[b]):
                positions.add(a)
            if a < len(node.args) and needs(node.args[a]):
                positions.add(b)
        for i in sorted(positions):  # masks and indices count as much as floats
            if i < len(node.args):
                out.append((node.name, *_base_of(graph, node.args[i], 0)))
        for i in rule.outputs:
            if i < len(node.outputs):
                out.append((node.name, node.name, i))
    return out


def saved_outputs(graph: Graph, requires_grad: Callable[[str], bool] | set[str]
                  ) -> dict[str, frozenset[int]]:
    """Node name -> indices of its outputs that autograd keeps for backward.

    ``requires_grad``: the names of the values on the gradient path (a set, or
    a predicate). Only ops whose output is on it record anything for backward.
    Parameters and user inputs appear too when an op saves them (their memory
    is counted with the training state and the batch)."""
    saved: dict[str, set[int]] = {}
    for _, base, idx in _savers(graph, requires_grad):
        saved.setdefault(base, set()).add(idx)
    return {k: frozenset(v) for k, v in saved.items()}


def savers_of(graph: Graph, requires_grad: Callable[[str], bool] | set[str]
              ) -> dict[str, list[str]]:
    """Node name (a base of :func:`saved_outputs`) -> the ops whose backward
    keeps it, in the forward's order."""
    out: dict[str, list[str]] = {}
    for saver, base, _ in _savers(graph, requires_grad):
        if saver not in out.setdefault(base, []):
            out[base].append(saver)
    return out


def release_points(graph: Graph, requires_grad: Callable[[str], bool] | set[str]
                   ) -> dict[str, str]:
    """Node name (a base of :func:`saved_outputs`) -> the op whose backward
    frees it: of the ops that keep it, the first in the forward. Autograd
    drops a node's saved tensors once the node has run (no ``retain_graph``),
    and the backward runs the ops in the reverse of the forward's order, so a
    tensor that several ops keep lives until the earliest of them has run."""
    return {base: keepers[0] for base, keepers in savers_of(graph, requires_grad).items()}


def extra_saved_bytes(node: Node) -> float:
    """Bytes an op saves for backward beyond its captured outputs: the fused
    attention kernel's float32 log-sum-exp, one per query row and head
    (``b·h·s``, the output's elements over its head dim)."""
    if node.target != FUSED_ATTENTION or not node.outputs:
        return 0.0
    out = node.outputs[0]
    return 4.0 * out.numel / max(1, out.shape[-1])
