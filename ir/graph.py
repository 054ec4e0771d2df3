"""The planner's record of a captured training graph.

A :class:`Graph` is a topologically ordered list of :class:`ir.node.Node`
records, one per placeholder (parameter, buffer or user input) and per aten
call in the captured forward program. The node vocabulary (:class:`Node`,
:class:`TensorInfo` and the node kinds) is defined in :mod:`ir.node` and handed
on here, so that a reader of graphs imports all it needs from this module.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Iterable, Iterator

import networkx as nx

from ir.node import BUFFER, INPUT, OP, PARAM, Node, TensorInfo
from ir.repeated_blocks import Layer, find_layers

__all__ = ["BUFFER", "INPUT", "OP", "PARAM", "Graph", "Node", "TensorInfo"]


@dataclass
class Graph:
    """A captured forward program with the metadata the planner needs.

    Attributes:
        nodes: all nodes in topological order.
        output_names: names of the nodes whose values the program returns to
            its caller (the capture's user outputs; the loss first).
        model_name: class name of the traced module.
        exported: the ``torch.export.ExportedProgram`` the graph was read from
            (kept for code generation; not serialised).
        grad_inputs: input nodes that carry gradients back to where they came
            from (a pipeline stage's activations from the stage before it).
        buffer_updates: value name -> FQN of each buffer forward writes
            (BatchNorm's running statistics in training mode), read off the
            capture's signature: state the program updates, not outputs.
    """

    nodes: list[Node]
    output_names: tuple[str, ...]
    model_name: str = ""
    exported: Any = field(default=None, repr=False, compare=False)
    grad_inputs: tuple[str, ...] = ()
    buffer_updates: dict[str, str] = field(default_factory=dict)

    @cached_property
    def by_name(self) -> dict[str, Node]:
        return {n.name: n for n in self.nodes}

    @cached_property
    def layers(self) -> list[Layer]:
        """:func:`ir.repeated_blocks.find_layers` of this graph, found once (the
        planner prices each stage graph on many meshes)."""
        return find_layers(self)

    def layer_ops(self, names: Iterable[str]) -> set[str]:
        """Names of the ops in the :attr:`layers` named ``names`` (a plan's
        checkpointed layers, say)."""
        wanted = set(names)
        return {op for layer in self.layers if layer.name in wanted for op in layer.nodes}

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

    @cached_property
    def weight_groups(self) -> int:
        """Parameter groups of a split backward, as torch.distributed.pipelining's
        ``stage_backward_input`` forms them for a stage whose inputs are
        ``grad_inputs``: from each parameter, through the ops computed from
        parameters alone (views, casts), to the first ops on the inputs' path;
        parameters that reach a common such op (a weight and its bias at one
        matmul) are one group. Parameters that reach none form none (torch's
        first stage, whose inputs carry no gradient, runs its backward whole)."""
        on_path = set(self.grad_inputs)
        for n in self.nodes:
            if n.kind == OP and any(a in on_path for a in n.args):
                on_path.add(n.name)
        users = self.users()
        parent: dict[str, str] = {}  # union-find over parameters and the ops they reach

        def find(name: str) -> str:
            while parent[name] != name:
                name = parent[name]
            return name

        reaching: list[str] = []  # the parameters that reach the inputs' path
        for n in self.nodes:
            if n.kind != PARAM:
                continue
            parent.setdefault(n.name, n.name)
            stack, seen = [n.name], {n.name}
            while stack:
                for user in users[stack.pop()]:
                    if user in on_path:
                        parent[find(parent.setdefault(user, user))] = find(n.name)
                        reaching.append(n.name)
                    elif user not in seen:
                        seen.add(user)
                        stack.append(user)
        return len({find(name) for name in reaching})

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
