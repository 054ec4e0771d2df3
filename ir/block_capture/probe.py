"""A probe capture read: cut into blocks, and the facts compared between probes.

A probe is the capture of the model truncated to its first ``k`` blocks
(:mod:`ir.block_capture.trace`). :class:`Layout` cuts its program into placeholders,
ops before the blocks, the ops of each block and ops after them, and checks
that the blocks issue the same ops on the same shapes with the same wiring
relative to their own index and that node names advance by a fixed step per
block. :class:`ProbeFacts` holds what the checks compare of a probe, as plain
values (a probe captured in another process comes back as these);
:func:`suffix_steps` compares two probes' facts.

Node names: torch.fx numbers nodes per base name (``view``, ``view_1``, ...);
:func:`split_name` and :func:`join_name` take a name apart and put it back.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
from torch.export.graph_signature import ExportGraphSignature, InputKind, OutputKind

from ir.exported_graph import module_path
from ir.block_capture.unsupported import Unsupported
from ir.torch_compat import OpOverload

_NAME_RE = re.compile(r"(.*)_(\d+)")
# How export names the placeholder of a parameter or buffer: prefix, then its
# FQN sanitised (:func:`sanitize`).
PLACEHOLDER_PREFIX = {InputKind.PARAMETER: "p_", InputKind.BUFFER: "b_"}


def split_name(name: str) -> tuple[str, int]:
    """``view_3`` -> ``("view", 3)``, ``view`` -> ``("view", 0)``; raises
    :class:`Unsupported` for a name that does not join back the same."""
    m = _NAME_RE.fullmatch(name)
    base, num = (m.group(1), int(m.group(2))) if m else (name, 0)
    if join_name(base, num) != name:
        raise Unsupported(f"node name {name!r} does not follow base_<n> numbering")
    return base, num


def join_name(base: str, num: int) -> str:
    """The node name of number ``num`` of ``base`` (no suffix for 0)."""
    return f"{base}_{num}" if num else base


def sanitize(fqn: str) -> str:
    """``fqn`` as export writes it into a placeholder's name."""
    return re.sub(r"[^a-zA-Z0-9]", "_", fqn).lower()


def _val_sig(v: Any) -> Any:
    """What a node's value is, as a comparable record: a tensor's shape,
    strides, dtype and device type; raises for symbolic values."""
    if isinstance(v, torch.Tensor):
        return ("T", tuple(v.shape), tuple(v.stride()), v.dtype, v.device.type)
    if isinstance(v, (list, tuple)):
        return tuple(_val_sig(x) for x in v)
    if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        raise Unsupported("symbolic values in the captured program")
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    return type(v).__name__


def node_record(n: torch.fx.Node, literals: bool = True) -> tuple:
    """Kind, name, target, wiring, value and module path of a node; without
    ``literals``, literal arguments are replaced by their type and the value
    is left out (what stays the same when only the input shapes change)."""
    if literals:
        args = torch.fx.node.map_arg((n.args, n.kwargs), lambda a: ("node", a.name))
        value = _val_sig(n.meta.get("val"))
    else:
        args = torch.fx.node.map_aggregate((n.args, n.kwargs), lambda a: (
            ("node", a.name) if isinstance(a, torch.fx.Node) else type(a).__name__))
        value = None
    return (n.op, n.name, _target_name(n.target), args, value,
            module_path(n) if n.op == "call_function" else "")


def _target_name(target: Any) -> str:
    """A node's target by name: an ATen overload's qualified name
    (``aten.mm.default``, unique among registered ops), a placeholder's
    string, or a Python function's module and qualified name."""
    if isinstance(target, str):
        return target
    if isinstance(target, OpOverload):
        return str(target)
    return f"{getattr(target, '__module__', '')}.{getattr(target, '__qualname__', repr(target))}"


class Layout:
    """A probe capture cut into placeholders, prefix ops, ``k`` blocks and suffix ops.

    Attributes:
        ep: the captured program; ``path`` the FQN of the block list; ``k``
            the blocks it keeps.
        specs: input spec of each placeholder, by name; ``out_specs`` the
            output specs.
        ph_block: ``(block, FQN relative to the block)`` of each block
            parameter's and buffer's placeholder, by name; ``ph_by_block``
            the placeholder of each such pair.
        ph_items: the placeholders in order: ``("outer", node)`` for one
            outside the blocks, ``("blocks", groups)`` for a run of the
            blocks' own, one group a block.
        prefix, blocks, suffix: the ops before the blocks, of each block, and
            after them; ``op_pos`` the ``(block, position)`` of each block op.
        output: the output node.
        block_steps: per base name, how far node numbers advance per block.
    """

    def __init__(self, ep: Any, path: str, k: int) -> None:
        self.ep, self.path, self.k = ep, path, k
        sig = ep.graph_signature
        for spec in sig.input_specs:
            if spec.kind not in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.USER_INPUT):
                raise Unsupported(f"input of kind {spec.kind.name} in the captured program")
        for spec in sig.output_specs:
            if spec.kind != OutputKind.USER_OUTPUT:
                raise Unsupported(f"output of kind {spec.kind.name} in the captured program")
        self.specs = {spec.arg.name: spec for spec in sig.input_specs}
        self.out_specs = list(sig.output_specs)
        nodes = list(ep.graph.nodes)
        self.placeholders = [n for n in nodes if n.op == "placeholder"]
        self.ph_map = {n.name: n for n in self.placeholders}
        ops = [n for n in nodes if n.op == "call_function"]
        if not nodes or nodes[-1].op != "output" or \
                len(self.placeholders) + len(ops) + 1 != len(nodes):
            raise Unsupported("captured program has nodes other than placeholders, "
                              "calls and one output")
        self.output = nodes[-1]
        self._read_placeholders()
        self._read_ops(ops)
        self.block_steps = _block_steps(self)

    def _block_of(self, fqn_or_path: str) -> tuple[int, str] | None:
        head = self.path + "."
        if not fqn_or_path.startswith(head):
            return None
        idx, _, rest = fqn_or_path[len(head):].partition(".")
        if not idx.isdigit() or str(int(idx)) != idx:
            raise Unsupported(f"unexpected name {fqn_or_path!r} under {self.path}")
        j = int(idx)
        if j >= self.k:
            raise Unsupported(f"block {j} of {self.path} appears in a {self.k}-block capture")
        return j, rest

    def _read_placeholders(self) -> None:
        # name -> (block, relative FQN) for block parameters and buffers
        self.ph_block: dict[str, tuple[int, str]] = {}
        runs: list[tuple[int | None, list[torch.fx.Node]]] = []
        for n in self.placeholders:
            spec = self.specs[n.name]
            where = self._block_of(spec.target) if spec.kind != InputKind.USER_INPUT else None
            j = None
            if where is not None:
                j, rel = where
                if not rel:
                    raise Unsupported(f"placeholder {n.name} is a whole block")
                prefix = PLACEHOLDER_PREFIX[spec.kind]
                if n.name != prefix + sanitize(spec.target):
                    raise Unsupported(f"placeholder {n.name} is not named after {spec.target}")
                self.ph_block[n.name] = (j, rel)
            if runs and runs[-1][0] == j:
                runs[-1][1].append(n)
            else:
                runs.append((j, [n]))
        # Placeholders: outer ones, and groups of runs for blocks 0..k-1 in order.
        self.ph_items: list[tuple[str, Any]] = []
        i = 0
        while i < len(runs):
            j, nodes = runs[i]
            if j is None:
                self.ph_items.extend(("outer", n) for n in nodes)
                i += 1
                continue
            group = [r[1] for r in runs[i:i + self.k]]
            if [r[0] for r in runs[i:i + self.k]] != list(range(self.k)):
                raise Unsupported("parameters of the blocks are not listed block by block")
            rels = [[(self.specs[n.name].kind, self.ph_block[n.name][1]) for n in g]
                    for g in group]
            if any(r != rels[0] for r in rels):
                raise Unsupported("blocks have different parameters in the capture")
            self.ph_items.append(("blocks", group))
            i += self.k
        # (block, relative FQN) -> placeholder
        self.ph_by_block = {where: self.ph_map[name] for name, where in self.ph_block.items()}

    def _read_ops(self, ops: list[torch.fx.Node]) -> None:
        self.prefix: list[torch.fx.Node] = []
        self.blocks: list[list[torch.fx.Node]] = [[] for _ in range(self.k)]
        self.suffix: list[torch.fx.Node] = []
        self.op_pos: dict[str, tuple[int, int]] = {}  # block op name -> (block, position)
        state = -1  # -1: prefix, 0..k-1: block, k: suffix
        for n in ops:
            where = self._block_of(module_path(n) + ".")
            j = where[0] if where is not None else None
            if j is None:
                if state == -1:
                    self.prefix.append(n)
                    continue
                if state != self.k - 1 and state != self.k:
                    raise Unsupported(f"{n.name} ({n.target}) runs between blocks {state} and "
                                      f"{state + 1}")
                state = self.k
                self.suffix.append(n)
                continue
            if j != state and j != state + 1:
                raise Unsupported(f"blocks of {self.path} do not run once each, in order "
                                  f"({n.name} of block {j} after block {state})")
            state = j
            self.op_pos[n.name] = (j, len(self.blocks[j]))
            self.blocks[j].append(n)
        if state < self.k - 1 or any(not b for b in self.blocks):
            raise Unsupported(f"the {self.k} blocks of {self.path} are not all followed by "
                              f"the rest of the program")
        if any(len(b) != len(self.blocks[0]) for b in self.blocks):
            raise Unsupported("blocks issue different numbers of ops")
        self.prefix_set = set(self.prefix)
        self.suffix_index = {n.name: i for i, n in enumerate(self.suffix)}


def node_sig(lay: Layout, n: torch.fx.Node, j: int | None) -> tuple:
    """What must agree between blocks of probe ``lay`` of op ``n`` of block
    ``j`` (None: after the blocks): op, arguments (block references relative
    to ``j``), value shapes and module path relative to the block."""

    def enc(a: torch.fx.Node) -> tuple:
        if a.name in lay.op_pos:
            jb, p = lay.op_pos[a.name]
            return ("op", j - jb, p) if j is not None else ("op_end", lay.k - jb, p)
        if a.name in lay.ph_block:
            jb, rel = lay.ph_block[a.name]
            return ("ph", j - jb, rel) if j is not None else ("ph_end", lay.k - jb, rel)
        return ("name", a.name) if j is not None or a.op == "placeholder" or \
            a in lay.prefix_set else ("suffix", lay.suffix_index[a.name])

    mp = module_path(n)
    if j is not None:
        mp = mp[len(f"{lay.path}.{j}"):]
    return (n.op, _target_name(n.target), split_name(n.name)[0],
            torch.fx.node.map_arg((n.args, n.kwargs), enc),
            _val_sig(n.meta.get("val")), mp)


def _block_steps(lay: Layout) -> dict[str, int]:
    """Per base name, how far node numbers advance from one block of probe
    ``lay`` to the next; raises unless the blocks after the first agree exactly."""
    steps: dict[str, int] = {}
    for j in range(1, lay.k):
        for a, b in zip(lay.blocks[j - 1], lay.blocks[j]):
            base_a, num_a = split_name(a.name)
            base_b, num_b = split_name(b.name)
            if base_a != base_b or a.target != b.target:
                raise Unsupported(f"blocks {j - 1} and {j} differ at {a.name} / {b.name}")
            step = num_b - num_a
            if step < 1 or steps.setdefault(base_a, step) != step:
                raise Unsupported(f"names of {base_a} nodes do not advance uniformly")
    # Blocks after the first must agree exactly (block 0 reads the prefix instead).
    for j in range(2, lay.k):
        for a, b in zip(lay.blocks[j - 1], lay.blocks[j]):
            if node_sig(lay, a, j - 1) != node_sig(lay, b, j):
                raise Unsupported(f"blocks {j - 1} and {j} differ at {a.name} / {b.name}")
    return steps


@dataclass(frozen=True)
class ProbeFacts:
    """What the method's checks read of a probe capture, as plain values
    that pickle (op targets by qualified name: :func:`_target_name`), so
    that a probe captured in another process is checked here.

    Attributes:
        k: blocks kept by the probe.
        prefix: ``(name, signature)`` of each op before the blocks
            (:func:`node_sig`); ``suffix`` the same after them.
        block_steps: per base name, how far node numbers advance per block.
        records: :func:`node_record` of every node.
        inputs: ``(kind, name, target, persistent)`` of every input.
    """

    k: int
    prefix: tuple[tuple[str, tuple], ...]
    suffix: tuple[tuple[str, tuple], ...]
    block_steps: dict[str, int]
    records: tuple[tuple, ...]
    inputs: tuple[tuple, ...]


def facts(lay: Layout) -> ProbeFacts:
    """The :class:`ProbeFacts` of probe ``lay``."""
    return ProbeFacts(
        k=lay.k, prefix=tuple((n.name, node_sig(lay, n, None)) for n in lay.prefix),
        suffix=tuple((n.name, node_sig(lay, n, None)) for n in lay.suffix),
        block_steps=dict(lay.block_steps),
        records=tuple(node_record(n) for n in lay.ep.graph.nodes),
        inputs=input_records(lay.ep.graph_signature))


def input_records(signature: ExportGraphSignature) -> tuple[tuple, ...]:
    """``(kind, name, target, persistent)`` of every input of ``signature``."""
    return tuple((s.kind, s.arg.name, s.target, s.persistent) for s in signature.input_specs)


def suffix_steps(short: ProbeFacts, long: ProbeFacts) -> dict[str, int]:
    """How far the numbers of the nodes after the blocks move per extra block."""
    if len(short.suffix) != len(long.suffix) or len(short.prefix) != len(long.prefix):
        raise Unsupported("the code around the blocks depends on the number of blocks")
    for a, b in zip(short.prefix, long.prefix):
        if a != b:
            raise Unsupported(f"the code before the blocks changes with their number ({b[0]})")
    steps: dict[str, int] = {}
    per_block = long.k - short.k
    for (name_a, sig_a), (name_b, sig_b) in zip(short.suffix, long.suffix):
        if sig_a != sig_b:
            raise Unsupported(f"the code after the blocks changes with their number ({name_b})")
        base, num_a = split_name(name_a)
        _, num_b = split_name(name_b)
        diff = num_b - num_a
        if diff < 0 or diff % per_block or steps.setdefault(base, diff // per_block) != \
                diff // per_block:
            raise Unsupported(f"names of {base} nodes after the blocks do not advance uniformly")
    for probe in (short, long):
        for base, step in probe.block_steps.items():
            if steps.get(base, step) != step:
                raise Unsupported(f"{base} nodes after the blocks move by {steps[base]} per "
                                  f"block, inside them by {step}")
    if short.block_steps != long.block_steps:
        raise Unsupported("block name steps differ between the probe captures")
    return steps


def structure(lay: Layout) -> tuple:
    """A probe's program without values and literal arguments
    (:func:`node_record` with ``literals=False`` of every node)."""
    return tuple(node_record(n, literals=False) for n in lay.ep.graph.nodes)
