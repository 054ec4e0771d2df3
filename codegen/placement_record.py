"""What placements a run of the program met: the record, its checks, the plan it gives.

:class:`PlacementRecord` is filled by the node-by-node interpreter
(:mod:`codegen.node_runner`) in the recording forward: the placements each op
consumed and produced, every redistribution (:class:`ReshardEvent`) and every
difference from the plan. :meth:`PlacementRecord.compare_with_plan` lists those
differences; :meth:`PlacementRecord.recorded_plan` turns the record into a
complete Plan (follow-DTensor recording: run a plan that lists only parameter
and input placements, and the result makes every reshard explicit).
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch

from codegen.redistribution import same_placements
from ir.placements import MASKED_PARTIAL
from plan.format import OpPlacement, Plan, Reshard

__all__ = ["PlacementRecord", "ReshardEvent"]


@dataclass
class ReshardEvent:
    """One redistribution the executor performed (or saw DTensor perform)."""

    node: str
    arg: str          # producing node for inputs; "out<k>" for outputs
    kind: str         # "explicit" (plan input), "output" (mismatch), "implicit" (inside DTensor)
    src: list[str]
    dst: list[str]

    def to_dict(self) -> dict[str, Any]:
        return {"node": self.node, "arg": self.arg, "kind": self.kind,
                "src": list(self.src), "dst": list(self.dst)}


class PlacementRecord:
    """The placements of one forward, as the executor saw them.

    Attributes:
        recording: whether this forward records (reshard events, observed
            placements, mismatches); ``explicit_reshards`` is counted always.
        observed: node name -> {"inputs": [...], "outputs": [...]}, the placements
            each op consumed and produced (after the executor's own reshards).
        reshards: every :class:`ReshardEvent` of the last recorded forward.
        explicit_reshards: redistributions the plan asked for (last forward).
        mismatches: human-readable lines: outputs that came out of DTensor with a
            placement other than the plan's, and reshards DTensor did on its own.
        placeholder_placements: placeholder name -> the placements it was given
            (parameters, buffers, constants and user inputs; kept across forwards).
        fallback_ops: aten ops that ran replicated because DTensor could not shard
            them (kept across forwards).
    """

    def __init__(self) -> None:
        self.recording = True
        self.observed: dict[str, dict[str, list[list[str]]]] = {}
        self.reshards: list[ReshardEvent] = []
        self.explicit_reshards = 0
        self.mismatches: list[str] = []
        self.placeholder_placements: dict[str, list[str]] = {}
        self.fallback_ops: list[str] = []

    def begin(self, recording: bool) -> None:
        """Start a forward: reset the per-forward records (kept when not ``recording``)."""
        self.recording = recording
        if recording:
            self.observed = {}
            self.reshards = []
            self.mismatches = []
        self.explicit_reshards = 0

    @contextlib.contextmanager
    def replaying(self) -> Iterator[None]:
        """Record and count nothing inside: a checkpointed layer's recomputation in
        backward repeats what its forward already recorded."""
        saved = (self.recording, self.explicit_reshards)
        self.recording = False
        try:
            yield
        finally:
            self.recording, self.explicit_reshards = saved

    # ---------------------------------------------------------------- filling
    def explicit(self, node: str, arg: str, have: list[str], want: Sequence[str]) -> None:
        """The executor redistributed argument ``arg`` of ``node`` as the plan asks."""
        self.explicit_reshards += 1
        if self.recording:
            self.reshards.append(ReshardEvent(node, arg, "explicit", have, list(want)))

    def dtensor_reshard(self, node: torch.fx.Node, arg: str, have: list[str], chose: list[str],
                        want: Sequence[str] | None, planned_node: bool) -> None:
        """DTensor redistributes argument ``arg`` of ``node`` from ``have`` to
        ``chose`` inside its dispatcher: planned when that is the plan's ``want``,
        else a mismatch where the plan lists the node (``planned_node``)."""
        planned = bool(want) and same_placements(chose, want)
        self.reshards.append(ReshardEvent(node.name, arg, "inside" if planned else "implicit",
                                          have, chose))
        if planned_node and not planned:
            self.mismatches.append(f"{node.name} ({node.target}): DTensor resharded argument "
                                   f"{arg} from {have} to {chose} by itself")

    def output_mismatch(self, node: torch.fx.Node, k: int, got: list[str],
                        want: Sequence[str]) -> None:
        """Output ``k`` of ``node`` came out ``got`` and was redistributed to the plan's ``want``."""
        self.mismatches.append(f"{node.name} ({node.target}): output {k} came out {got}, "
                               f"plan says {list(want)}")
        self.reshards.append(ReshardEvent(node.name, f"out{k}", "output", got, list(want)))

    def fallback(self, op: str) -> None:
        """Op ``op`` runs replicated: DTensor could not shard it."""
        if op not in self.fallback_ops:
            self.fallback_ops.append(op)

    def observe(self, node: str, inputs: Sequence[Sequence[str]],
                outputs: list[list[str]]) -> None:
        """The placements ``node`` consumed and produced."""
        self.observed[node] = {"inputs": [list(p) for p in inputs], "outputs": outputs}

    # ---------------------------------------------------------------- reading
    @property
    def implicit_reshards(self) -> int:
        """Redistributions DTensor did inside its dispatcher in the last recorded forward."""
        return sum(1 for r in self.reshards if r.kind == "implicit")

    def compare_with_plan(self, plan: Plan, names: Sequence[str]) -> list[str]:
        """Differences between the recorded placements of nodes ``names`` and
        ``plan``'s, one line each."""
        diffs = []
        for name in names:
            entry = plan.nodes.get(name)
            if entry is None:
                continue
            obs = self.observed.get(name)
            if obs is None:
                diffs.append(f"{name}: in the plan but not executed")
                continue
            for i, (want, got) in enumerate(zip(entry.inputs, obs["inputs"])):
                if want and got and not same_placements(got, want):
                    diffs.append(f"{name}: input {i} is {got}, plan says {list(want)}")
            for k, (want, got) in enumerate(zip(entry.outputs, obs["outputs"])):
                if want and got and not same_placements(got, want):
                    diffs.append(f"{name}: output {k} is {got}, plan says {list(want)}")
        return diffs

    def recorded_plan(self, plan: Plan, graph: Any) -> Plan:
        """A copy of ``plan`` whose ``nodes`` and ``reshards`` are what was observed
        running the ops of ``graph`` (an :class:`ir.graph.Graph`)."""
        if not self.observed:
            raise RuntimeError("run forward() once before asking for the recorded plan")
        plan = copy.deepcopy(plan)
        nodes: dict[str, OpPlacement] = {}
        produced: dict[str, list[list[str]]] = {
            n: [list(p)] for n, p in self.placeholder_placements.items()}
        reshards: list[Reshard] = []
        for gnode in graph.ops:
            obs = self.observed.get(gnode.name)
            if obs is None:
                continue
            nodes[gnode.name] = OpPlacement(op=gnode.target, module=gnode.module_path,
                                            inputs=[list(p) for p in obs["inputs"]],
                                            outputs=[list(p) for p in obs["outputs"]])
            if gnode.arg_index is None:
                for arg, dst in zip(gnode.args, obs["inputs"]):
                    src = produced.get(arg, [[]])[0] if produced.get(arg) else []
                    if dst and src and any(a != b and b != MASKED_PARTIAL for a, b in zip(src, dst)):
                        reshards.append(Reshard(node=gnode.name, arg=arg, module=gnode.module_path,
                                                src=list(src), dst=list(dst), time_s=0.0))
            produced[gnode.name] = [list(p) for p in obs["outputs"]]
        plan.nodes = nodes
        plan.reshards = reshards
        return plan
