"""The program of one micro-batch at each micro-batch size a pipeline search
asks for: captured by torch.export, written out from two captures' probes,
or derived from earlier captures by the batch rule (:mod:`ir.rescale`),
with its pipeline layers, their boundary values and layer kinds.

Units: micro-batch sizes in sequences (rows of dim 0 of every input).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from ir.block_capture.trace import SynthesizedProgram, rescaled_trace
from ir.graph import Graph
from ir.layers import PipelineLayer, pipeline_layers
from ir.rescale import BatchRule, batch_rule
from ir.subgraph import boundary_values
from ir.trace import trace
from planner.search.stage_dp import layer_signature


def microbatch_inputs(example_inputs: Sequence[Any], num_microbatches: int) -> tuple:
    """The first micro-batch of ``example_inputs`` (dim 0 split evenly)."""
    out = []
    for t in example_inputs:
        if isinstance(t, torch.Tensor) and t.ndim > 0:
            out.append(t[: t.shape[0] // num_microbatches])
        else:
            out.append(t)
    return tuple(out)


def global_batch_of(example_inputs: Sequence[Any]) -> int:
    sizes = {int(t.shape[0]) for t in example_inputs if isinstance(t, torch.Tensor) and t.ndim > 0}
    if len(sizes) != 1:
        raise ValueError(f"example inputs must share one batch dimension 0, got sizes {sorted(sizes)}")
    return sizes.pop()


@dataclass
class MicrobatchProgram:
    """The program of one micro-batch and its pipeline layers."""

    microbatch_size: int
    graph: Graph
    layers: list[PipelineLayer]
    boundaries: list[tuple[list[str], list[str]]]  # per layer: (receives, sends)
    signatures: list[str]
    # with a program for strategy queries (True: captured, or written out from
    # two captures' probes by ir.block_capture.trace.rescaled_trace) or derived by
    # ir.rescale (False: shapes, FLOPs and bytes only)
    traced: bool = True
    # captured by torch.export (not written out or derived)
    captured: bool = True


class MicrobatchPrograms:
    """The programs of one search by micro-batch size, and how the program
    follows the micro-batch size (the batch rule, once two captures gave it
    and a third confirmed it).

    ``programs``: a dict of programs by micro-batch size to fill, which
    several searches may share (e.g. the layouts of a Megatron grid share
    the traces); ``whole_batch_graph``: the program of the whole batch, when
    captured already."""

    def __init__(self, model: torch.nn.Module, example_inputs: Sequence[Any], min_layers: int,
                 programs: dict[int, MicrobatchProgram] | None = None,
                 whole_batch_graph: Graph | None = None):
        self.model = model
        self.example_inputs = tuple(example_inputs)
        self.min_layers = min_layers
        self.global_batch = global_batch_of(example_inputs)
        self._by_size: dict[int, MicrobatchProgram] = {} if programs is None else programs
        # False once captures disagreed with it
        self._batch_rule: BatchRule | None | bool = None
        self._batch_rule_checked = False
        if whole_batch_graph is not None and self.global_batch not in self._by_size:
            self._add(self.global_batch, whole_batch_graph)

    def _add(self, mb: int, graph: Graph, traced: bool = True, captured: bool = True) -> None:
        layers = pipeline_layers(graph, self.min_layers)
        self._by_size[mb] = MicrobatchProgram(
            mb, graph, layers, boundary_values(graph, [l.ops for l in layers]),
            [layer_signature(graph, l) for l in layers], traced, captured)

    def get(self, num_microbatches: int, traced: bool = False,
            progress: Callable[[str], None] = lambda msg: None) -> MicrobatchProgram:
        """The program of one micro-batch when the batch is split ``num_microbatches``
        ways: captured, or (unless ``traced``) derived from earlier captures when
        the program follows the batch size exactly (:mod:`ir.rescale`, checked
        on a third capture first). Derived programs price known placements;
        anything that enumerates strategies asks for a captured one. Micro-batch
        size 1 is always captured: torch specialises size-1 dimensions there
        (another program than the rule gives; once its capture replaced a
        derived one mid-search, and the search's two processes then priced with
        different programs). ``progress`` is told of each capture and write-out."""
        mb = self.global_batch // num_microbatches
        prog = self._by_size.get(mb)
        if prog is not None and (prog.traced or not traced):
            return prog
        if not traced and self._derivable(mb):
            self._add(mb, self._batch_rule.at(mb), traced=False, captured=False)
            return self._by_size[mb]
        inputs = microbatch_inputs(self.example_inputs, num_microbatches)
        graph = self._written_out(mb, inputs, progress)
        if graph is not None:
            self._add(mb, graph, captured=False)
            return self._by_size[mb]
        progress(f"tracing micro-batch {mb}")
        earlier = self._by_size.get(self.global_batch)
        graph = trace(self.model, inputs,
                      like=earlier.graph if earlier is not None and earlier.traced else None)
        if prog is not None and graph.fingerprint() != prog.graph.fingerprint():
            self._batch_rule = False  # the derived program was not the real one
        self._learn_batch_rule(mb, graph)
        self._add(mb, graph)
        return self._by_size[mb]

    def _written_out(self, mb: int, inputs: tuple,
                     progress: Callable[[str], None]) -> Graph | None:
        """The program at micro-batch size ``mb`` written out from the probes of
        the first two captures (:func:`ir.block_capture.trace.rescaled_trace`) once the
        batch rule is confirmed on a third, when it is exactly what that rule
        gives; None otherwise (the caller captures). About 0.6 s against 2-3 s
        for a capture (llama3-8b on meta). Never at micro-batch size 1: torch
        specialises size-1 dimensions there and captures another program
        (gpt3-1.3b: 1767 of its nodes differ), which the affine rule cannot
        tell, since the written-out program follows the rule too."""
        if mb < 2 or not (self._batch_rule_checked and self._batch_rule):
            return None
        bases = [p.graph.exported for p in self._by_size.values()
                 if p.captured and isinstance(p.graph.exported, SynthesizedProgram)][:2]
        if len(bases) < 2:
            return None
        progress(f"writing out micro-batch {mb}")
        graph = rescaled_trace(self.model, inputs, *bases)
        return graph if graph is not None and self._batch_rule.matches(graph, mb) else None

    def _learn_batch_rule(self, mb: int, graph: Graph) -> None:
        """Infer the batch rule from the first two captures, check it on the third."""
        if self._batch_rule is False or self._batch_rule_checked:
            return
        if self._batch_rule is None:
            others = [p for b, p in sorted(self._by_size.items()) if p.traced and b != mb]
            if others:
                self._batch_rule = batch_rule(others[0].graph, others[0].microbatch_size,
                                              graph, mb) or False
            return
        self._batch_rule_checked = True
        if not self._batch_rule.matches(graph, mb):
            self._batch_rule = False

    def has_traced(self, num_microbatches: int) -> bool:
        """Whether the program of ``num_microbatches`` micro-batches was
        captured or written out (not only derived, nor not yet made)."""
        prog = self._by_size.get(self.global_batch // num_microbatches)
        return prog is not None and prog.traced

    def will_capture(self, num_microbatches: int) -> bool:
        """Whether :meth:`get` would capture the program (seconds) rather
        than find it or derive it from earlier captures."""
        mb = self.global_batch // num_microbatches
        return mb not in self._by_size and not self._derivable(mb)

    def _derivable(self, mb: int) -> bool:
        """Whether the program at micro-batch size ``mb`` may be derived from
        the confirmed batch rule (never at size 1, see :meth:`get`)."""
        return mb > 1 and self._batch_rule_checked and bool(self._batch_rule)

    def made(self) -> list[MicrobatchProgram]:
        """The programs made so far (captured, written out or derived)."""
        return list(self._by_size.values())
