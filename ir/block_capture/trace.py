"""Fast capture of models made of many identical blocks.

``torch.export`` followed by ``run_decompositions`` costs time in proportion to
the number of ops: a 96-block GPT-3 takes tens of seconds, almost all of it
re-tracing the same block 96 times. When a model keeps its blocks in an
``nn.ModuleList`` of structurally identical modules, :func:`fast_trace`

1. captures two truncated copies of the model, keeping only the first 2 and the
   first 3 blocks (shallow copies: the user's model is not touched and nothing
   is allocated; :mod:`ir.block_capture.block_list`), one by
   :func:`ir.program_capture.capture` and the other by
   :func:`ir.program_capture.capture_in_one_pass` (so the check of step 3 also vouches
   that the two agree; a later trace ``like`` this one captures its probes
   in one pass);
2. checks that the captured program is uniform: the blocks issue the same ops
   on the same shapes with the same wiring relative to their own index, the
   code before and after the blocks does not depend on how many there are, and
   node names advance by a fixed step per block (:mod:`ir.block_capture.probe`);
3. writes out the program of the full model by replicating the last captured
   block, naming every node as the full capture names it, and checks the method
   on the probes themselves (the 3-block program rebuilt from the 2-block one
   must equal the 3-block capture exactly; :mod:`ir.block_capture.program`).

Node names: torch.fx numbers nodes per base name in creation order (``view``,
``view_1``, ...; a few bases such as ``any`` or ``sum`` start at ``_1``), and
nodes removed after naming (unused ``getitem`` outputs of ``native_layer_norm``)
leave gaps. Every block consumes the same numbers per base, so the name of a
node of block ``i`` is ``base_{n + (i - t) * step[base]}`` where ``n`` is the
number of the same node in captured block ``t``; nodes after the blocks shift
by the step measured between the two probes.

The result is a :class:`ir.graph.Graph` equal, node for node, to the one
:func:`ir.exported_graph.graph_from_exported` builds from the full capture (same names,
targets, wiring, shapes, FLOPs, bytes, parameters, module paths), so its
``fingerprint()`` is the same. Its ``exported`` is a
:class:`ir.block_capture.program.SynthesizedProgram`:
a real ``torch.fx.Graph`` of the whole program (nodes share the ``meta["val"]``
of the captured block they copy) and an ``ExportGraphSignature``, enough for
``planner.ilp.strategies``, and with the model's own tensors enough for code
generation to run (``codegen.capture.WrittenOutProgram``).

Anything that does not fit (no such ModuleList, blocks that differ in shapes,
attributes or hooks, ops between blocks, blocks called out of order, names
that do not advance uniformly, a probe capture that fails) makes
:func:`fast_trace` return ``None``, with the reason logged at debug level;
:func:`ir.trace.trace` then captures the full model.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any, Callable

import torch
from torch import nn
from torch.export.graph_signature import InputKind

from ir.exported_graph import graph_from_exported, tied_parameters
from ir.block_capture.block_list import find_block_list, truncated
from ir.block_capture.probe import (Layout, ProbeFacts, facts, input_records, node_record, structure,
                           suffix_steps)
from ir.block_capture.program import SynthesizedProgram, synthesize
from ir.block_capture.unsupported import Unsupported
from ir.graph import Graph
from ir.probe_rescale import RescaleError, rescale_program
from ir.program_capture import as_tuple, capture, capture_in_one_pass

__all__ = ["MIN_BLOCKS", "Beside", "SynthesizedProgram", "fast_trace", "rescaled_trace"]

log = logging.getLogger(__name__)

# Below this many blocks two probe captures cost about as much as the full one
# (8-block gpt-tiny on meta, this 2-core machine: 3.3 s for the two probes against
# 3.7 s for the full capture; a later trace at another batch size, one probe,
# 1.8 s against 4.8 s).
MIN_BLOCKS = 8
# Blocks kept by the two probe captures.
_PROBES = (2, 3)

# Runs two functions at once, the second in another process: ``beside(here,
# there)`` returns ``(here(), there())`` (the second's result must pickle).
Beside = Callable[[Callable[[], Any], Callable[[], Any]], tuple[Any, Any]]


def fast_trace(model: nn.Module, example_inputs: Any, *,
               min_blocks: int | None = None,
               like: SynthesizedProgram | None = None,
               beside: Beside | None = None) -> Graph | None:
    """The :class:`Graph` of ``model(*example_inputs)`` from two short probe captures.

    ``like``: the program of an earlier fast trace of the same model (say, at
    another batch size). When this trace's short probe is that trace's short
    probe up to values and literal sizes (same nodes, names, targets, wiring
    and module paths), the method checked there (names advancing by the same
    steps, the longer probe rebuilt exactly) holds here too, and the program
    is written out from the short probe alone: one probe capture instead of two.

    ``beside``: when given, the longer probe is captured by its other process
    while this one captures the short probe, and only the facts the checks
    read of it come back (:class:`ir.block_capture.probe.ProbeFacts`); should that fail, it is
    captured here after the short one.

    Returns None when the model has no ``nn.ModuleList`` of at least
    ``min_blocks`` (default :data:`MIN_BLOCKS`, at least 4) identical blocks or
    when anything in the probes leaves doubt that the result equals the full
    capture (the reason is logged at debug level).
    """
    name = type(model).__name__
    if min_blocks is None:
        min_blocks = MIN_BLOCKS
    try:
        path, num_blocks = find_block_list(model, min_blocks)
        args = as_tuple(example_inputs)
        if like is not None and like.probe and (like.block_path, like.num_blocks) == (
                path, num_blocks):
            short = _probe(model, path, _PROBES[0], args, one_pass=True)
            # where it is not, the method is checked anew on a long probe,
            # also in one pass: the one pass was checked against torch.export
            # on the first trace's probes
            long = None if structure(short) == like.probe else _probe_facts(
                model, path, _PROBES[1], args, one_pass=True)
        else:
            short, long = _probe_pair(model, path, args, beside)
        if long is None:  # the method was checked on ``like``'s probes
            steps = like.suffix_steps
        else:
            steps = suffix_steps(facts(short), long)
            # The method, checked on the probes: the 3-block program from the 2-block one.
            _require_same(synthesize(short, long.k, steps), long)
        program = synthesize(short, num_blocks, steps)
        program = replace(program, suffix_steps=dict(steps), probe=structure(short),
                          short_probe=short.ep, batch=_batch_of(args))
        _check_state(program, model)
        graph = graph_from_exported(program, model_name=name, tied=tied_parameters(model))
    except Unsupported as err:
        log.debug("fast trace not used for %s: %s", name, err)
        return None
    except Exception:  # noqa: BLE001 - any surprise: the full capture is always right
        log.debug("fast trace failed for %s", name, exc_info=True)
        return None
    log.debug("fast trace of %s: %d blocks of %s, %d nodes", name, num_blocks, path, len(graph))
    return graph


def rescaled_trace(model: nn.Module, example_inputs: Any, a: SynthesizedProgram,
                   b: SynthesizedProgram) -> Graph | None:
    """The :class:`Graph` of ``model(*example_inputs)`` written out, without a
    capture, from the short probes of two fast traces ``a`` and ``b`` of the
    same model at other batch sizes (:func:`ir.probe_rescale.rescale_program`
    for the probe, then the method of ``a``).

    Two traces cannot tell a batch-affine literal from every other rule, so
    the caller checks the result against one confirmed on a third capture
    (:class:`ir.rescale.BatchRule`). Returns None when the traces do not
    carry the method and probe of one model at two batch sizes, or the probe
    does not rescale (the reason is logged at debug level).
    """
    name = type(model).__name__
    try:
        args = as_tuple(example_inputs)
        batch = _batch_of(args)
        same = (a.block_path, a.num_blocks, a.probe, a.suffix_steps) == \
            (b.block_path, b.num_blocks, b.probe, b.suffix_steps)
        if not same or a.short_probe is None or b.short_probe is None or None in (
                a.batch, b.batch, batch):
            raise Unsupported("the two traces are not of one model at known batch sizes")
        probe = rescale_program(a.short_probe, a.batch, b.short_probe, b.batch, batch, args)
        short = Layout(probe, a.block_path, _PROBES[0])
        if structure(short) != a.probe:
            raise Unsupported("the rescaled probe has another structure")
        program = replace(synthesize(short, a.num_blocks, a.suffix_steps),
                          suffix_steps=dict(a.suffix_steps), probe=a.probe,
                          short_probe=probe, batch=batch)
        _check_state(program, model)
        graph = graph_from_exported(program, model_name=name, tied=tied_parameters(model))
    except (Unsupported, RescaleError) as err:
        log.debug("rescaled trace not used for %s: %s", name, err)
        return None
    except Exception:  # noqa: BLE001 - any surprise: a capture is always right
        log.debug("rescaled trace failed for %s", name, exc_info=True)
        return None
    return graph


def _batch_of(args: tuple) -> int | None:
    """Dim 0 shared by every tensor input, or None."""
    sizes = {int(t.shape[0]) for t in args if isinstance(t, torch.Tensor) and t.ndim > 0}
    return sizes.pop() if len(sizes) == 1 else None


def _probe(model: nn.Module, path: str, k: int, args: tuple, one_pass: bool) -> Layout:
    """The capture of ``model`` truncated to its first ``k`` blocks, laid out:
    by :func:`ir.program_capture.capture_in_one_pass` with ``one_pass``, else by
    :func:`ir.program_capture.capture`. Where a model's first trace checks the method
    on two probes, they are captured one each way, so the check also vouches
    that the two captures agree (the one pass is ~2.5x faster)."""
    try:
        ep = (capture_in_one_pass if one_pass else capture)(truncated(model, path, k), args)
    except Exception as err:  # noqa: BLE001 - the full capture reports it
        raise Unsupported(f"capture of the first {k} blocks failed: {err}") from err
    return Layout(ep, path, k)


def _probe_facts(model: nn.Module, path: str, k: int, args: tuple,
                 one_pass: bool) -> ProbeFacts:
    """The facts of the capture of ``model`` truncated to its first ``k`` blocks."""
    return facts(_probe(model, path, k, args, one_pass))


def _probe_pair(model: nn.Module, path: str, args: tuple,
                beside: Beside | None) -> tuple[Layout, ProbeFacts]:
    """The short probe, and the facts of the long one: captured by
    ``beside``'s other process at the same time when given and it works,
    else here after the short one."""
    def short() -> Layout:
        return _probe(model, path, _PROBES[0], args, one_pass=False)

    def long() -> ProbeFacts:
        return _probe_facts(model, path, _PROBES[1], args, one_pass=True)

    if beside is not None:
        try:
            return beside(short, long)
        except Unsupported:
            raise
        except Exception:  # noqa: BLE001 - the other process failed: capture here
            log.debug("probe capture beside failed; capturing here", exc_info=True)
    return short(), long()


def _require_same(program: SynthesizedProgram, want: ProbeFacts) -> None:
    """The synthesized program equals the captured probe ``want`` node for node."""
    got = list(program.graph.nodes)
    if len(got) != len(want.records):
        raise Unsupported(f"rebuilt probe has {len(got)} nodes, the capture "
                          f"{len(want.records)}")
    for a, b in zip(got, want.records):
        if node_record(a) != b:
            raise Unsupported(f"rebuilt probe differs from the capture at {b[1]}")
    if input_records(program.graph_signature) != want.inputs:
        raise Unsupported("rebuilt probe has different inputs than the capture")


def _check_state(program: SynthesizedProgram, model: nn.Module) -> None:
    """Parameters and buffers of the program are exactly those of the model."""
    sig = program.graph_signature
    params = [s.target for s in sig.input_specs if s.kind == InputKind.PARAMETER]
    buffers = [s.target for s in sig.input_specs if s.kind == InputKind.BUFFER]
    if params != [n for n, _ in model.named_parameters()]:
        raise Unsupported("parameters of the rebuilt program differ from the model's")
    if sorted(buffers) != sorted(n for n, _ in model.named_buffers()):
        raise Unsupported("buffers of the rebuilt program differ from the model's")
