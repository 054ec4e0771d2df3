"""ZeRO-3 units (ir.shard_units.shard_units): what FSDP2 gathers one at a time."""

from __future__ import annotations

import torch
from torch import nn

from ir.shard_units import shard_units
from models.source import build_model
from ir.trace import trace


def _fqns(graph, unit) -> list[str]:
    return [graph[p].fqn for p in unit.params]


def test_gpt_units_are_its_embeddings_layers_final_norm_and_head_in_program_order():
    """Each layer is a unit, and so is each module outside the layers; the
    head's unit covers the matmul that reads the transposed weight (a view of
    the parameter shares the storage FSDP2 frees), so no op outside a unit
    reads a unit's parameter."""
    model, inputs = build_model("gpt-tiny", device="meta")
    graph = trace(model, inputs)
    units = shard_units(graph)
    assert [u.name for u in units] == ["transformer.wte", "transformer.wpe", "transformer.h.0",
                                       "transformer.h.1", "transformer.ln_f", "lm_head"]
    assert _fqns(graph, units[-1]) == ["lm_head.weight"]
    assert sorted(f for u in units for f in _fqns(graph, u)) == sorted(
        n for n, _ in model.named_parameters())
    inside = {op: u for u in units for op in u.ops}
    for n in graph.nodes:
        if n.kind == "op":
            for a in n.args:
                owner = next((u for u in units if a in u.params), None)
                if owner is not None:
                    assert inside.get(n.name) is owner


class _Tied(nn.Module):
    """An embedding whose weight the head reads too, around two blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.norm = nn.LayerNorm(8)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        for block in self.blocks:
            h = torch.relu(block(h))
        return (self.norm(h) @ self.emb.weight.t()).logsumexp(-1).mean()


def test_a_parameter_read_across_units_belongs_to_none_and_a_stage_keeps_its_own():
    """The tied embedding is read at both ends: FSDP2's stage unit keeps it for
    the pass, in no unit. ``within`` (one stage's ops) keeps the units whose
    ops are all in the stage."""
    model = _Tied()
    graph = trace(model, (torch.randint(0, 16, (2, 4)),))
    units = shard_units(graph)
    assert [u.name for u in units] == ["blocks.0", "blocks.1", "norm"]
    ops = [n.name for n in graph.nodes if n.kind == "op"]
    first = set(units[0].ops)
    stage = [op for op in ops if op not in set(units[1].ops) | set(units[2].ops)][:ops.index(
        units[0].ops[-1]) + 1]
    assert [u.name for u in shard_units(graph, within=stage)] == ["blocks.0"]
    assert first <= set(stage)
