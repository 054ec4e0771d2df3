"""The planner's record of a captured training graph.

A :class:`Graph` is a topologically ordered list of :class:`Node` records, one per
placeholder (parameter, buffer or user input) and per aten call in the captured
forward program. Every number carries its unit in its name: FLOPs are floating
point operations of the forward pass, bytes are bytes.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any, Iterator

import networkx as nx
import torch

if TYPE_CHECKING:
    from ir.layers import Layer

PARAM = "param"
BUFFER = "buffer"
INPUT = "input"
OP = "op"


@dataclass(frozen=True)
class TensorInfo:
    """Shape and dtype of one tensor value (a global, unsharded view)."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= int(d)
        return n

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        """Bytes of the whole (unsharded) tensor."""
        return self.numel * self.itemsize

    @property
    def is_float(self) -> bool:
        return self.dtype.is_floating_point or self.dtype.is_complex

    def to_json(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "dtype": str(self.dtype).replace("torch.", "")}


@dataclass
class Node:
    """One value-producing step of the captured program.

    Attributes:
        name: unique node name (the torch.fx node name).
        kind: ``param``, ``buffer``, ``input`` or ``op``.
        target: aten overload name such as ``aten.mm.default``; ``getitem`` for
            tuple projections; the FQN for parameters and buffers.
        args: names of the nodes whose tensors this node reads, in argument order
            (one entry per tensor argument, repeats allowed).
        arg_index: for ``getitem`` nodes, the index of the projected output.
        inputs: TensorInfo of each tensor argument, aligned with ``args``.
        outputs: TensorInfo of each tensor output (several for multi-output ops).
        flops: forward FLOPs of this op (matmul/attention FLOPs from PyTorch's
            flop registry; 0 for memory-bound ops).
        bytes_moved: bytes read plus bytes written by this op in the forward pass
            (0 for view ops that move no data).
        params: FQNs of the parameters this node reads directly.
        module_path: FQN of the innermost nn.Module that issued the op ("" = root).
    """

    name: str
    kind: str
    target: str
    args: tuple[str, ...] = ()
    arg_index: int | None = None
    inputs: tuple[TensorInfo, ...] = ()
    outputs: tuple[TensorInfo, ...] = ()
    flops: float = 0.0
    bytes_moved: float = 0.0
    params: tuple[str, ...] = ()
    module_path: str = ""
    fqn: str | None = None

    @property
    def is_view(self) -> bool:
        """An op that moves no bytes and does no FLOPs: a view of its input
        (tuple projections included)."""
        return self.kind == OP and self.bytes_moved == 0 and self.flops == 0

    @property
    def output(self) -> TensorInfo:
        """The single tensor output; raises for multi-output nodes."""
        if len(self.outputs) != 1:
            raise ValueError(f"node {self.name} ({self.target}) has {len(self.outputs)} outputs")
        return self.outputs[0]

    @property
    def is_placeholder(self) -> bool:
        return self.kind in (PARAM, BUFFER, INPUT)


@dataclass
class Graph:
    """A captured forward program with the metadata the planner needs.

    Attributes:
        nodes: all nodes in topological order.
        output_names: names of the nodes whose values the program returns.
        model_name: class name of the traced module.
        exported: the ``torch.export.ExportedProgram`` the graph was read from
            (kept for code generation; not serialised).
        grad_inputs: input nodes that carry gradients back to where they came
            from (a pipeline stage's activations from the stage before it).
    """

    nodes: list[Node]
    output_names: tuple[str, ...]
    model_name: str = ""
    exported: Any = field(default=None, repr=False, compare=False)
    grad_inputs: tuple[str, ...] = ()

    @cached_property
    def by_name(self) -> dict[str, Node]:
        return {n.name: n for n in self.nodes}

    @cached_property
    def layers(self) -> list[Layer]:
        """:func:`ir.layers.find_layers` of this graph, found once (the
        planner prices each stage graph on many meshes)."""
        from ir.layers import find_layers  # ir.layers reads Graph: imported here

        return find_layers(self)

    def __getitem__(self, name: str) -> Node:
        return self.by_name[name]

    def __iter__(self) -> Iterator[Node]:
        return iter(self.nodes)

    def __len__(self) -> int:
        return len(self.nodes)

    @property
    def ops(self) -> list[Node]:
        return [n for n in self.nodes if n.kind == OP]

    @property
    def parameters(self) -> dict[str, TensorInfo]:
        """Parameter FQN -> TensorInfo, in capture order."""
        return {n.fqn: n.output for n in self.nodes if n.kind == PARAM}

    @property
    def num_parameters(self) -> int:
        return sum(t.numel for t in self.parameters.values())

    @property
    def forward_flops(self) -> float:
        """Total forward FLOPs of one step."""
        return float(sum(n.flops for n in self.nodes))

    @cached_property
    def gradient_path(self) -> frozenset[str]:
        """Names of the values a gradient flows back to: parameters, the inputs
        in ``grad_inputs``, and every floating op output computed from them."""
        out: set[str] = set(self.grad_inputs)
        for n in self.nodes:
            if n.kind == PARAM:
                out.add(n.name)
            elif n.kind == OP and n.outputs and any(o.is_float for o in n.outputs) and any(
                    a in out for a in n.args):
                out.add(n.name)
        return frozenset(out)

    @cached_property
    def parameter_views(self) -> frozenset[str]:
        """Parameters and the views of them (a transposed weight is still the weight)."""
        out: set[str] = set()
        for n in self.nodes:
            if n.kind == PARAM or (n.is_view and n.args and all(a in out for a in n.args)):
                out.add(n.name)
        return frozenset(out)

    def users(self) -> dict[str, list[str]]:
        """Node name -> names of the nodes that read it (in order, repeats removed)."""
        out: dict[str, list[str]] = {n.name: [] for n in self.nodes}
        for n in self.nodes:
            for a in dict.fromkeys(n.args):
                out[a].append(n.name)
        return out

    def to_networkx(self) -> nx.DiGraph:
        """Data-flow graph: an edge u -> v for every tensor v reads from u."""
        g = nx.DiGraph()
        for n in self.nodes:
            g.add_node(n.name, kind=n.kind, target=n.target)
        for n in self.nodes:
            for a in n.args:
                g.add_edge(a, n.name)
        return g

    def fingerprint(self) -> str:
        """Structural hash of the program: ops, wiring, shapes and dtypes.

        Two captures of the same model with the same input shapes give the same
        fingerprint, on any device; the code generator uses it to refuse a plan made for a
        different program.
        """
        h = hashlib.sha256()
        for n in self.nodes:
            # the dtype of an op's secondary outputs is the device kernel's
            # choice (layer norm's statistics: float32 on CUDA and meta, the
            # input's dtype on CPU); the program is the same
            outs = [o.to_json() if i == 0 else list(o.shape) for i, o in enumerate(n.outputs)]
            rec = [n.name, n.kind, n.target, list(n.args), n.arg_index, outs]
            h.update(json.dumps(rec, sort_keys=True).encode())
        return h.hexdigest()[:16]
