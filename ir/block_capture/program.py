"""The program of the full model, written out from a probe capture.

:func:`synthesize` replicates the last captured block of a probe
(:class:`ir.block_capture.probe.Layout`) up to the model's number of blocks, naming
every node as the full capture names it (the numbering is explained in
:mod:`ir.block_capture.trace`). The result, a :class:`SynthesizedProgram`, stands in
for the ``ExportedProgram`` of the full capture.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.export.graph_signature import (
    ExportGraphSignature, InputSpec, OutputSpec, TensorArgument,
)

from ir.block_capture.probe import PLACEHOLDER_PREFIX, Layout, join_name, sanitize, split_name
from ir.block_capture.unsupported import Unsupported


@dataclass
class SynthesizedProgram:
    """Stand-in for the ``ExportedProgram`` of a fast trace.

    Attributes:
        graph: ``torch.fx.Graph`` of the full program, node names as in the full
            capture; replicated nodes share ``meta["val"]`` with the captured
            block they copy.
        graph_signature: parameters, buffers and user inputs of the full program.
        source: the decomposed capture of the truncated model it was built from.
        block_path: FQN of the ``nn.ModuleList`` of repeated blocks.
        num_blocks: number of blocks of the full model.
        suffix_steps: how far node numbers after the blocks move per block.
        probe: the short probe's program without its values and literals
            (:func:`ir.block_capture.probe.structure`); a later trace of the same model
            at other shapes whose short probe has this structure is written
            out from that probe alone (see :func:`ir.block_capture.trace.fast_trace`'s
            ``like``).
        short_probe: the short probe's program itself (captured, or written out
            by :func:`ir.block_capture.trace.rescaled_trace`).
        batch: dim 0 of the user inputs it was traced at (None when they differ).
    """

    graph: torch.fx.Graph
    graph_signature: ExportGraphSignature
    source: Any
    block_path: str
    num_blocks: int
    suffix_steps: dict[str, int] = field(default_factory=dict)
    probe: tuple = ()
    short_probe: Any = None
    batch: int | None = None


def synthesize(lay: Layout, num_blocks: int, suffix_steps: dict[str, int]) -> SynthesizedProgram:
    """The program of the model with ``num_blocks`` blocks, from probe ``lay``;
    ``suffix_steps``: how far the numbers of the nodes after the blocks move
    per block (:func:`ir.block_capture.probe.suffix_steps`)."""
    if num_blocks < lay.k:
        raise Unsupported("fewer blocks than the probe")
    writer = _ProgramWriter(lay, num_blocks, suffix_steps)
    input_specs = writer.write_placeholders()
    writer.write_ops()
    output_specs = writer.write_output()
    signature = ExportGraphSignature(input_specs=input_specs, output_specs=output_specs)
    return SynthesizedProgram(graph=writer.graph, graph_signature=signature, source=lay.ep,
                              block_path=lay.path, num_blocks=num_blocks)


class _ProgramWriter:
    """Writes the nodes of the ``num_blocks``-block program into :attr:`graph`,
    in the full capture's order: placeholders, ops before the blocks, the
    blocks (those the probe captured as captured, the rest copies of its last
    block ``t``), ops after the blocks, the output."""

    def __init__(self, lay: Layout, num_blocks: int, suffix_steps: dict[str, int]) -> None:
        self.lay, self.num_blocks = lay, num_blocks
        self.k, self.t, self.path = lay.k, lay.k - 1, lay.path
        self.shift = num_blocks - lay.k  # blocks added after the probe's
        self.graph = torch.fx.Graph()
        self.made: dict[str, torch.fx.Node] = {}  # node written so far, by name
        # The names of the nodes after the blocks, moved on by the added blocks.
        self.suffix_names: dict[str, str] = {}
        for n in lay.suffix:
            base, num = split_name(n.name)
            self.suffix_names[n.name] = join_name(base, num + self.shift * suffix_steps[base])

    def op_name(self, j: int, p: int) -> str:
        """Name of op ``p`` of block ``j``."""
        lay, t = self.lay, self.t
        if j < self.k:
            return lay.blocks[j][p].name
        base, num = split_name(lay.blocks[t][p].name)
        return join_name(base, num + (j - t) * lay.block_steps[base])

    def ph_name(self, j: int, rel: str) -> str:
        """Name of the placeholder of block ``j``'s tensor at FQN ``rel`` in the block."""
        src = self.lay.ph_by_block[(min(j, self.t), rel)]
        if j < self.k:
            return src.name
        spec = self.lay.specs[src.name]
        return PLACEHOLDER_PREFIX[spec.kind] + sanitize(f"{self.path}.{j}.{rel}")

    def mapper(self, block: int | None) -> Callable[[torch.fx.Node], torch.fx.Node]:
        """Argument map for a node copied into ``block`` (None: after the blocks)."""
        lay, t, made = self.lay, self.t, self.made

        def written_block(jb: int) -> int:
            """The block that reads as captured block ``jb`` does in the written program."""
            return block - (t - jb) if block is not None else jb + self.shift

        def f(a: torch.fx.Node) -> torch.fx.Node:
            if a.name in lay.op_pos:
                jb, p = lay.op_pos[a.name]
                name = self.op_name(written_block(jb), p)
            elif a.name in lay.ph_block:
                jb, rel = lay.ph_block[a.name]
                name = self.ph_name(written_block(jb), rel)
            else:
                name = self.suffix_names.get(a.name, a.name)
            return made[name]

        return f

    def add(self, op: str, target: Any, args: tuple, kwargs: dict, name: str, meta: dict) -> None:
        """Write one node named ``name``."""
        node = self.graph.create_node(op, target, args, kwargs, name=name)
        if node.name != name:
            raise Unsupported(f"node name {name} would collide")
        node.meta = meta
        self.made[name] = node

    def write_placeholders(self) -> list[InputSpec]:
        """Write the placeholders; returns their input specs."""
        lay, path = self.lay, self.path
        input_specs = []
        for kind, item in lay.ph_items:
            if kind == "outer":
                self.add("placeholder", item.name, (), {}, item.name, dict(item.meta))
                input_specs.append(lay.specs[item.name])
                continue
            for j in range(self.num_blocks):
                for src in item[min(j, self.t)]:
                    rel = lay.ph_block[src.name][1]
                    name = self.ph_name(j, rel)
                    self.add("placeholder", name, (), {}, name, dict(src.meta))
                    spec = lay.specs[src.name]
                    input_specs.append(InputSpec(spec.kind, TensorArgument(name),
                                                 f"{path}.{j}.{rel}", spec.persistent))
        return input_specs

    def write_ops(self) -> None:
        """Write the ops before, inside and after the blocks."""
        lay, k, t, path, made = self.lay, self.k, self.t, self.path, self.made
        for n in lay.prefix:
            args, kwargs = torch.fx.node.map_arg((n.args, n.kwargs), lambda a: made[a.name])
            self.add(n.op, n.target, args, kwargs, n.name, dict(n.meta))
        for j in range(self.num_blocks):
            src_block = j if j < k else t
            for p, n in enumerate(lay.blocks[src_block]):
                if j < k:
                    args, kwargs = torch.fx.node.map_arg((n.args, n.kwargs),
                                                         lambda a: made[a.name])
                    meta = dict(n.meta)
                else:
                    args, kwargs = torch.fx.node.map_arg((n.args, n.kwargs), self.mapper(j))
                    meta = _remap_stack(n.meta, f"{path}.{t}", f"{path}.{j}")
                self.add(n.op, n.target, args, kwargs, self.op_name(j, p), meta)
        after = self.mapper(None)
        for n in lay.suffix:
            args, kwargs = torch.fx.node.map_arg((n.args, n.kwargs), after)
            self.add(n.op, n.target, args, kwargs, self.suffix_names[n.name], dict(n.meta))

    def write_output(self) -> list[OutputSpec]:
        """Write the output node; returns the output specs."""
        lay, after = self.lay, self.mapper(None)
        if len(lay.output.args) != 1 or lay.output.kwargs:
            raise Unsupported("unexpected output node")
        out = self.graph.output(torch.fx.node.map_arg(lay.output.args[0], after))
        out.meta = dict(lay.output.meta)
        if out.name != lay.output.name:
            raise Unsupported("output node name would collide")
        by_name = {n.name: n for n in lay.ep.graph.nodes}
        output_specs = []
        for s in lay.out_specs:
            if isinstance(s.arg, TensorArgument):
                s = OutputSpec(s.kind, TensorArgument(after(by_name[s.arg.name]).name), s.target)
            output_specs.append(s)
        return output_specs


def _remap_stack(meta: dict, old: str, new: str) -> dict:
    """``meta`` of a node copied from the block at FQN ``old`` into the one at
    ``new``: its ``nn_module_stack`` names the new block."""
    out = dict(meta)
    stack = meta.get("nn_module_stack")
    if stack:
        def swap(s: Any) -> Any:
            if not isinstance(s, str):
                return s
            if s == old or s.startswith(old + "."):
                return new + s[len(old):]
            if s.endswith(old):
                return s[:len(s) - len(old)] + new
            return s.replace(old + ".", new + ".", 1)

        out["nn_module_stack"] = {swap(k): (swap(v[0]),) + tuple(v[1:])
                                  for k, v in stack.items()}
    return out
