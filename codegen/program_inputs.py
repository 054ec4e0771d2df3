"""The program's inputs on the mesh, as the plan places them.

:class:`InputPlacer` distributes the parameters, buffers and constants once
(:meth:`InputPlacer.place_state`: parameters become ``nn.Parameter`` DTensors
in the master dtype, buffers and constants take the compute dtype) and the
user inputs at every forward (:meth:`InputPlacer.place_input`). On a mesh of
one device everything stays a plain tensor.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.export.graph_signature import ExportGraphSignature, InputKind

from codegen.capture import PlanMismatchError
from codegen.redistribution import redistribute
from ir.placements import parse_placements
from ir.precision import cast_float
from plan.format import Plan

__all__ = ["InputPlacer", "Materialize", "PlacedState"]

#: (FQN, meta tensor) -> the tensor's whole value on this rank's device.
Materialize = Callable[[str, torch.Tensor], torch.Tensor]


@dataclass
class PlacedState:
    """The program's placeholders, placed: what :meth:`InputPlacer.place_state` returns."""

    params: dict[str, torch.nn.Parameter] = field(default_factory=dict)  # FQN -> parameter
    placeholders: dict[str, Any] = field(default_factory=dict)  # name -> param/buffer/constant
    user_input_names: list[str] = field(default_factory=list)  # in the program's order


class InputPlacer:
    """Places the program's inputs on ``mesh`` as ``plan`` says.

    Args:
        plan: the Plan, read on the mesh (:func:`codegen.redistribution.plan_on_mesh`).
        mesh: the DeviceMesh.
        placed_as: placeholder name -> placements, filled with what each input is given.
        local: the mesh has one device: inputs stay plain tensors.
        materialize: gives the whole value, on this rank's device, of a state
            tensor the program holds on the meta device (a model built on meta:
            :mod:`codegen.deferred_init`), called with its FQN and the meta
            tensor, one tensor at a time; this rank keeps only its shard.
    """

    def __init__(self, plan: Plan, mesh: DeviceMesh, placed_as: dict[str, list[str]], *,
                 local: bool, materialize: Materialize | None = None,
                 parameters_on_meta: bool = False):
        self.plan = plan
        self.mesh = mesh
        self.precision = plan.precision
        self.placed_as = placed_as
        self.local = local
        self.materialize = materialize
        #: parameters held on meta stay there (an FSDP2 stage shards them on
        #: meta, then materialises its own shards one at a time)
        self.parameters_on_meta = parameters_on_meta
        #: FQN -> the model's own meta tensor of each parameter left on meta
        self.meta_originals: dict[str, torch.Tensor] = {}

    def place_state(self, ep: Any, wants: Callable[[str], bool],
                    tied: dict[str, str] | None = None) -> PlacedState:
        """Place the parameters, buffers and constants of program ``ep`` whose
        placeholder name ``wants`` accepts; list every user input's name.

        ``tied``: the model's tied parameter names -> their first name
        (:func:`ir.exported_graph.tied_parameters`): a tied name's placeholder is
        the first name's parameter itself, so both uses add to one gradient."""
        sig = ep.graph_signature
        self._refuse_unknown_parameters(sig)
        tied = tied or {}
        placed = PlacedState()
        aliases: list[tuple[str, str]] = []  # (placeholder, tied name)
        placeholder_of: dict[str, str] = {}  # parameter FQN -> its placeholder
        for spec in sig.input_specs:
            name = spec.arg.name
            if spec.kind == InputKind.USER_INPUT:
                placed.user_input_names.append(name)
            elif not wants(name):
                continue
            elif spec.kind == InputKind.PARAMETER and spec.target in tied:
                aliases.append((name, spec.target))
            elif spec.kind == InputKind.PARAMETER:
                param = self._parameter(name, spec.target, ep.state_dict)
                placed.params[spec.target] = param
                placed.placeholders[name] = param
                placeholder_of[spec.target] = name
            elif spec.kind == InputKind.BUFFER:
                placed.placeholders[name] = self._buffer(name, spec.target, ep)
            elif spec.kind == InputKind.CONSTANT_TENSOR:
                placed.placeholders[name] = ep.constants[spec.target]
                self.placed_as[name] = ["R"] * self.mesh.ndim
            else:
                raise NotImplementedError(f"input kind {spec.kind.name} of {name} is not supported")
        for name, fqn in aliases:
            first = tied[fqn]
            if first not in placed.params:
                raise PlanMismatchError(
                    f"parameter {fqn} is tied to {first}, which this part of the program "
                    f"does not hold; a tied parameter must be used within one pipeline stage")
            placed.placeholders[name] = placed.params[first]
            self.placed_as[name] = self.placed_as[placeholder_of[first]]
        return placed

    def place_input(self, name: str, value: Any) -> Any:
        """User input ``name`` in the compute dtype, placed as the plan says."""
        if not isinstance(value, torch.Tensor):
            return value
        value = cast_float(value, self.precision.compute_dtype)
        placements = self.plan.inputs.get(name)
        if placements is None:
            warnings.warn(f"plan gives no placement for input {name}; replicating it", stacklevel=3)
            placements = ["R"] * self.mesh.ndim
        self.placed_as[name] = list(placements)
        if self.local:
            return value
        if isinstance(value, DTensor):
            return redistribute(value, self.mesh, parse_placements(placements))
        return distribute_tensor(value, self.mesh, parse_placements(placements), src_data_rank=None)

    def _refuse_unknown_parameters(self, sig: ExportGraphSignature) -> None:
        unknown = [f for f in self.plan.parameters if f not in sig.inputs_to_parameters.values()
                   and f not in sig.inputs_to_buffers.values()]
        if unknown:
            raise PlanMismatchError(
                f"plan places {len(unknown)} parameter(s) the model does not have "
                f"(first: {unknown[0]}); re-plan this model")

    def _parameter(self, name: str, fqn: str, state: dict[str, Any]) -> torch.nn.Parameter:
        """Parameter ``fqn`` in the master dtype, distributed as planned."""
        placements = self._planned(fqn)
        requires_grad = state[fqn].requires_grad
        if self.parameters_on_meta and state[fqn].is_meta:
            value = self.meta_originals[fqn] = state[fqn]
        else:
            value = self._real(fqn, state[fqn])
        value = cast_float(value, self.precision.master_dtype)
        dt = value.detach() if self.local else distribute_tensor(
            value.detach(), self.mesh, parse_placements(placements), src_data_rank=None)
        self.placed_as[name] = placements
        return torch.nn.Parameter(dt, requires_grad=requires_grad)

    def _buffer(self, name: str, fqn: str, ep: Any) -> Any:
        """Buffer ``fqn`` in the compute dtype: distributed where the plan places
        it, else a constant, replicated."""
        state = ep.state_dict
        value = cast_float(self._real(fqn, state[fqn] if fqn in state else ep.constants[fqn]),
                           self.precision.compute_dtype)
        if fqn in self.plan.parameters and not self.local:
            placements = self.plan.parameters[fqn]
            self.placed_as[name] = placements
            return distribute_tensor(value.detach(), self.mesh, parse_placements(placements),
                                     src_data_rank=None)
        self.placed_as[name] = ["R"] * self.mesh.ndim
        return value

    def _real(self, fqn: str, value: torch.Tensor) -> torch.Tensor:
        """``value`` itself, or its whole value from :attr:`materialize` where it is on meta."""
        if not value.is_meta:
            return value
        if self.materialize is None:
            raise PlanMismatchError(f"{fqn} is on the meta device and has no values; build the "
                                    f"model on a real device, or parallelize it with an initializer")
        return self.materialize(fqn, value)

    def _planned(self, fqn: str) -> list[str]:
        """The plan's placements of parameter ``fqn`` (replicated, with a warning, if none)."""
        placements = self.plan.parameters.get(fqn)
        if placements is None:
            warnings.warn(f"plan gives no placement for parameter {fqn}; replicating it",
                          stacklevel=4)
            placements = ["R"] * self.mesh.ndim
        if len(placements) != self.mesh.ndim:
            raise PlanMismatchError(
                f"parameter {fqn} has {len(placements)} placements for a {self.mesh.ndim}-D mesh")
        return list(placements)
