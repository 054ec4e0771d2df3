"""Exact stage solutions carried over between stages of the same layers
(planner.search.stage_reuse) equal solving each stage on its own."""

from __future__ import annotations

import pytest

from costmodel.presets import local_cpu_cluster
from models.source import build_model
from planner.search import pipeline_search as ps
from planner.search.context import SearchContext
from planner.search.settings import SearchSettings
from planner.search.stage_reuse import node_map, total_memory


def _context(budget: float) -> SearchContext:
    model, inputs = build_model("tests/pipeline_model.py:gpt8", device="meta")
    return SearchContext(model, inputs, SearchSettings(
        local_cpu_cluster(8), dtype="float32", optimizer="adam", budget=budget, time_limit_s=10),
        min_layers=2)


@pytest.mark.parametrize("budget, reused", [(2e9, 4), pytest.param(1.55e6, 1, marks=pytest.mark.xfail(
    strict=True, reason="since the backward-transient memory term, the head stage's exact "
    "solve (exact_stage) and its own ILP (solve_stage) disagree under this tight budget: "
    "both fit and are OPTIMAL, 20.39 ms against 20.47 ms (issue 25 note)"))])
def test_reused_stage_solutions_equal_solving_every_stage(budget, reused):
    """1F1B over 4 stages of 2 blocks: stages 1-2 hold 3 and 2 micro-batches,
    stage 3 (with the head) 1. With room to spare every stage takes the
    fastest plan of its layers; under a tighter budget only the 2-copy
    stage's solution carries over (to the 3-copy stage). Either way every
    stage's answer is what its own ILP gives."""
    ctx = _context(budget)
    prog = ctx.program(4, traced=True)
    mesh = ps.stage_mesh_options(ctx.settings.cluster, 4)[0]
    copies = ps.stage_in_flight("1f1b", 4, 4, 1)
    bounds = [(0, 2), (2, 4), (4, 6), (6, 8)]
    for s in sorted(range(4), key=lambda s: copies[s]):
        (a, b), c = bounds[s], copies[s]
        got = ctx.exact_stage(prog, a, b, mesh, budget, c)
        own = ctx.solve_stage(prog, a, b, mesh, budget, c)
        assert got.solution.objective_s == pytest.approx(own.solution.objective_s, rel=1e-12)
        assert total_memory(got) == pytest.approx(total_memory(own), rel=1e-12)
        assert got.checkpointed == own.checkpointed
        assert set(got.chosen) == {n.name for n in got.graph.nodes} == set(own.chosen)
    assert ctx.stages_reused == reused


def test_graphs_of_different_layers_do_not_map():
    ctx = _context(2e9)
    prog = ctx.program(4, traced=True)
    middle = ctx.stage_graph(prog, 2, 4)
    assert node_map(ctx.stage_graph(prog, 4, 6), middle) is not None
    assert node_map(ctx.stage_graph(prog, 0, 2), middle) is None  # the embedding
    assert node_map(ctx.stage_graph(prog, 2, 5), middle) is None  # one block more
