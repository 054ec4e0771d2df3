"""ZeRO-3 unit by unit: each layer of a stage, and each module outside the
layers (embedding, final norm, head), is an FSDP2 unit of its own.

A ZeRO-3 stage (:class:`codegen.stage_module.StageModule`) gives every unit that
:func:`ir.shard_units.shard_units` finds a :class:`UnitModule`: an
``nn.Module`` at the unit's module path that owns its parameters and whose
forward runs the unit's op nodes. ``fully_shard`` on each unit (then on the
stage) makes FSDP2 all-gather a unit's parameters just before its ops, free
them right after (``reshard_after_forward``), gather them again for its
backward and reduce-scatter its gradients as soon as that backward ends, as
torchtitan shards a transformer. A rank therefore holds its shards, the
parameters the stage's own unit keeps gathered for the whole pass (those read
across units, such as a tied embedding and head) and one or two units
gathered, never the whole stage (what
:class:`costmodel.strategy_cost.IntraOpCost` prices for ZeRO-3).

The executor reads a unit's parameters inside the unit's forward, where FSDP2
has just gathered them (:func:`run_unit`); a layer that the plan also
checkpoints runs under ``torch.utils.checkpoint`` inside it, as in
:mod:`codegen.checkpointed_layers`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import nn

from codegen.checkpointed_layers import (checkpointed, leave_segment, segment_boundary,
                                         segment_function)
from codegen.placement_record import PlacementRecord

__all__ = ["UnitModule", "UnitRun", "run_unit"]


class UnitModule(nn.Module):
    """One unit's parameters (registered under their paths below the unit's
    module path) and a forward that runs what it is given
    (``body(*values)``): the unit's ops, with the parameters read inside,
    after FSDP2's pre-forward gathered them."""

    def forward(self, body: Callable[..., tuple], *values: Any) -> tuple:
        return body(*values)


@dataclass
class UnitRun:
    """How the executor runs one :class:`UnitModule`.

    Attributes:
        module: the unit.
        segment: the unit's op nodes, in program order.
        params: the parameter placeholders read inside the unit.
        checkpoint: whether the plan checkpoints the unit (a layer).
        name: the unit's name (its module path).
        program: the unit's ops as one callable of the values named
            ``program_inputs`` (a compiled region,
            :mod:`codegen.compiled_program`); None: they are interpreted.
        program_inputs: the names of ``program``'s arguments, in order.
    """

    module: UnitModule
    segment: Sequence[torch.fx.Node]
    params: frozenset[str]
    checkpoint: bool
    name: str = ""
    program: Callable[..., Any] | None = None
    program_inputs: Sequence[str] = ()


def run_unit(unit: UnitRun, env: dict[str, Any],
             run_node: Callable[[torch.fx.Node, dict[str, Any]], Any],
             param_value: Callable[[str], Any], record: PlacementRecord,
             last_use: dict[str, list[str]]) -> None:
    """Run ``unit``'s ops by calling its module (so that FSDP2's hooks gather
    and reshard its parameters and reduce-scatter their gradients): their
    outputs read later go into ``env``, and the values read for the last time
    inside it (``last_use``: node name -> values) leave ``env``.
    ``param_value``: a parameter placeholder's value, read inside the unit."""
    external, outputs = ([n.name for n in nodes] for nodes in segment_boundary(unit.segment))
    params = [e for e in external if e in unit.params]
    values = [e for e in external if e not in unit.params]
    if unit.program is None:
        run = segment_function(unit.segment, values + params, outputs, run_node, record,
                               last_use)
    else:
        run = _by_name(unit.program, unit.program_inputs, values + params)

    def body(*args: Any) -> tuple:
        gathered = [param_value(p) for p in params]
        if unit.checkpoint:
            return checkpointed(run, *args, *gathered)
        return run(*args, *gathered)

    env.update(zip(outputs, unit.module(body, *[env[v] for v in values])))
    leave_segment(unit.segment, env, last_use)


def _by_name(program: Callable[..., Any], inputs: Sequence[str],
             names: Sequence[str]) -> Callable[..., tuple]:
    """``program`` (of the values named ``inputs``, in that order) as a
    function of the values named ``names``, returning a tuple."""
    order = [list(names).index(n) for n in inputs]

    def run(*args: Any) -> tuple:
        return tuple(program(*[args[i] for i in order]))
    return run
