"""Layers the plan checkpoints: found in the program, run under ``torch.utils.checkpoint``.

:func:`checkpoint_segments` finds each checkpointed layer's op nodes (they must
be contiguous in the program); :func:`run_checkpointed` runs one such segment
so that its activations are not kept and backward re-runs the same nodes
(same placements, same reshards), recording nothing the second time
(:func:`segment_function`, which ZeRO-3's units run through too:
:mod:`codegen.zero3_units`).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Sequence

import torch
import torch.utils.checkpoint

from codegen.capture import PlanMismatchError
from codegen.placement_record import PlacementRecord
from ir.repeated_blocks import find_layers

__all__ = ["checkpoint_segments", "checkpointed", "leave_segment", "run_checkpointed",
           "segment_boundary", "segment_function"]


def checkpoint_segments(graph: Any, calls: Sequence[torch.fx.Node],
                        names: Sequence[str]) -> dict[str, list[torch.fx.Node]]:
    """First node name -> the op nodes of each layer of ``names`` among ``calls``
    (the op nodes run, in program order; ``graph`` is the :class:`ir.graph.Graph`)."""
    if not names:
        return {}
    layers = {layer.name: set(layer.nodes) for layer in find_layers(graph)}
    segments: dict[str, list[torch.fx.Node]] = {}
    for name in names:
        members = layers.get(name)
        if members is None:
            raise PlanMismatchError(f"plan checkpoints layer '{name}' but the model has no "
                                    f"such layer; re-plan this model")
        idx = [i for i, n in enumerate(calls) if n.name in members]
        if not idx or idx[-1] - idx[0] + 1 != len(idx):
            raise PlanMismatchError(f"plan checkpoints layer '{name}' but its ops are not "
                                    f"contiguous in the program; re-plan this model")
        segments[calls[idx[0]].name] = list(calls[idx[0]: idx[-1] + 1])
    return segments


def segment_boundary(segment: Sequence[torch.fx.Node]
                     ) -> tuple[list[torch.fx.Node], list[torch.fx.Node]]:
    """The values ``segment`` reads from outside it (in first-use order) and
    its nodes whose values are read after it."""
    inside = set(segment)
    external = list(dict.fromkeys(a for n in segment for a in n.all_input_nodes
                                  if a not in inside))
    outputs = [n for n in segment if any(u not in inside for u in n.users)]
    return external, outputs


def checkpointed(fn: Callable[..., Any], *values: Any) -> Any:
    """``fn(*values)`` under non-reentrant ``torch.utils.checkpoint``: its
    activations are not kept, and backward re-runs it."""
    # Early stop would abort the recomputation with an exception mid-layer, which
    # the per-node DTensor fallback must not mistake for a sharding failure. Given
    # as an argument (not torch's context manager), torch.compile traces it.
    return torch.utils.checkpoint.checkpoint(fn, *values, use_reentrant=False, early_stop=False)


def segment_function(segment: Sequence[torch.fx.Node], names: Sequence[str],
                     outputs: Sequence[str],
                     run_node: Callable[[torch.fx.Node, dict[str, Any]], Any],
                     record: PlacementRecord, last_use: dict[str, list[str]]
                     ) -> Callable[..., tuple]:
    """``segment`` as a function of the values of ``names`` (in that order)
    returning those of ``outputs``, each node run with ``run_node``. Its first
    call records placements; a later one (a checkpointed layer's
    recomputation in backward) records nothing new. A value read for the last
    time inside (``last_use``: node name -> values) is let go as it goes."""
    kept = set(outputs)
    first_run = [True]

    def run(*values: Any) -> tuple:
        local = dict(zip(names, values))
        replay = record.replaying() if not first_run[0] else contextlib.nullcontext()
        first_run[0] = False
        with replay:
            for n in segment:
                local[n.name] = run_node(n, local)
                for name in last_use.get(n.name, ()):
                    if name not in kept:
                        local.pop(name, None)
        return tuple(local[o] for o in outputs)

    return run


def leave_segment(segment: Sequence[torch.fx.Node], env: dict[str, Any],
                  last_use: dict[str, list[str]]) -> None:
    """Let the values read for the last time inside ``segment`` leave ``env``."""
    for n in segment:
        for name in last_use.get(n.name, ()):
            env.pop(name, None)


def run_checkpointed(segment: list[torch.fx.Node], env: dict[str, Any],
                     run_node: Callable[[torch.fx.Node, dict[str, Any]], Any],
                     record: PlacementRecord, last_use: dict[str, list[str]]) -> None:
    """Run ``segment`` with ``run_node`` under ``torch.utils.checkpoint``: its
    outputs go into ``env``, and the values read for the last time inside it
    (``last_use``: node name -> values) leave ``env``."""
    external, outputs = ([n.name for n in nodes] for nodes in segment_boundary(segment))
    run = segment_function(segment, external, outputs, run_node, record, last_use)
    env.update(zip(outputs, checkpointed(run, *[env[e] for e in external])))
    leave_segment(segment, env, last_use)
