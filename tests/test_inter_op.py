"""Inter-op pass: pipeline layers, Alpa's stage DP against exhaustive cuts, and
pipeline plans (format, determinism, memory)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from costmodel.presets import load_cluster
from costmodel.collectives import axis_links, collective_time
from ir.layers import block_count, cluster_layers, manual_bounds, pipeline_layers
from models.source import build_model
from ir.subgraph import boundary_values
from ir.trace import trace
from planner.search import two_level as two_level_search
from planner.search import finalists as finalists_of_search
from planner.search import pipeline_search as pipeline_search
from planner.search.context import SearchContext
from planner.search.settings import SearchSettings
from planner.api import PlanningError, pipeline_plan, plan
from planner.search.stage_dp import (PipelineCandidate, exhaustive_split, in_flight,
                              layer_signature, split_layers)
from planner.search.stage_times import StageTimes
from planner.ilp.intra_op import (MemoryInfeasibleError, prepare_intra_op, solve_intra_op,
                              solve_prepared)


@pytest.fixture(scope="module")
def gpt_graph():
    model, inputs = build_model("gpt-tiny")
    return trace(model, inputs)


def test_pipeline_layers_cover_every_op_once_in_order(gpt_graph):
    layers = pipeline_layers(gpt_graph)
    assert [l.name for l in layers] == ["transformer.wte+transformer.wpe", "transformer.h.0",
                                        "transformer.h.1", "transformer.ln_f+lm_head"]
    ops = [n.name for n in gpt_graph.ops]
    assert [op for l in layers for op in l.ops] == ops
    # the embedding and the head with the loss are end layers of their own, so
    # both blocks are one layer kind
    assert [l.end for l in layers] == [True, False, False, True]
    assert {gpt_graph[op].module_path for op in layers[0].ops} <= {
        "", "transformer.wte", "transformer.wpe"}
    assert gpt_graph.output_names[0] in layers[-1].ops
    assert layer_signature(gpt_graph, layers[1]) == layer_signature(gpt_graph, layers[2])
    assert block_count(layers) == 2


def test_manual_splits_put_the_end_layers_with_the_first_and_last_stage(gpt_graph):
    layers = pipeline_layers(gpt_graph)
    assert manual_bounds(layers, [1, 1]) == [(0, 2), (2, 4)]
    assert manual_bounds(layers, [2]) == [(0, 4)]
    with pytest.raises(ValueError, match="add up to the 2 blocks"):
        manual_bounds(layers, [1, 2])


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_cluster_layers_cuts_a_model_without_blocks(k):
    model, inputs = build_model("mlp-tiny")
    graph = trace(model, inputs)
    layers = cluster_layers(graph, k)
    assert len(layers) == k
    assert [op for l in layers for op in l.ops] == [n.name for n in graph.ops]
    assert all(l.ops and graph[l.ops[0]].target != "getitem" for l in layers)


def test_boundaries_pass_user_inputs_through_to_the_loss(gpt_graph):
    layers = pipeline_layers(gpt_graph)
    bounds = boundary_values(gpt_graph, [l.ops for l in layers])
    assert bounds[0][0] == ["idx", "targets"]
    for (_, send), (recv, _) in zip(bounds, bounds[1:]):
        assert "targets" in send and send == recv
    assert bounds[-1][1] == list(gpt_graph.output_names)


_times = st.builds(StageTimes, *(st.floats(0.0, 10.0) for _ in range(4)),
                   st.floats(0.0, 100.0), st.floats(0.0, 50.0),
                   transient_bytes=st.floats(0.0, 80.0))


@settings(max_examples=150, deadline=None)
@given(data=st.data(), num_layers=st.integers(1, 6), levels=st.integers(1, 3),
       m=st.integers(1, 8))
def test_stage_dp_equals_exhaustive_enumeration(data, num_layers, levels, m):
    table = data.draw(st.lists(st.lists(_times, min_size=levels, max_size=levels),
                               min_size=num_layers, max_size=num_layers))
    stages = data.draw(st.integers(1, num_layers))
    copies = data.draw(st.lists(st.integers(1, 4), min_size=stages, max_size=stages))
    budget = data.draw(st.floats(50.0, 600.0))

    def layer_times(i, lv):
        return table[i][lv]

    dp = split_layers(layer_times, num_layers, stages, m, copies, budget, levels)
    brute = exhaustive_split(layer_times, num_layers, stages, m, copies, budget, levels)
    assert (dp is None) == (brute is None)
    if dp is not None:
        assert math.isclose(dp.objective_s, brute.objective_s, rel_tol=1e-9, abs_tol=1e-12)
        assert [b - a for a, b in dp.bounds] and sum(b - a for a, b in dp.bounds) == num_layers
        for (a, b), s_times, s in zip(dp.bounds, dp.times, range(stages)):
            assert s_times.memory(copies[s]) <= budget * (1 + 1e-12)


def test_a_stage_holds_the_largest_backward_transient_of_its_layers():
    """Layers' states and activations add up into a stage, their backward
    transients do not: the stage holds one at a time, its largest (as its own
    intra-op solve counts it), so two layers fit where the sum would not."""
    layer = StageTimes(1.0, 2.0, 0.0, 0.0, state_bytes=100.0, activation_bytes=10.0,
                       transient_bytes=50.0)
    assert (layer + layer).memory(2.0) == 200.0 + 2 * 20.0 + 50.0
    split = split_layers(lambda i, lv: layer, 2, 1, 1, [2.0], budget=300.0)
    assert split is not None and split.times[0].memory(2.0) == 290.0
    assert split_layers(lambda i, lv: layer, 2, 1, 1, [2.0], budget=289.0) is None


def test_in_flight_follows_the_schedule():
    # 1F1B: stage s keeps pp - s micro-batches; GPipe keeps all m
    assert in_flight("1f1b", 4, 8, 1) == [4.0, 3.0, 2.0, 1.0]
    assert in_flight("gpipe", 2, 4, 1) == [4.0, 4.0]


def test_search_equals_exhaustive_cuts_and_sub_meshes(monkeypatch):
    """On <= 6 layers and <= 8 devices, the DP inside the search picks what
    enumerating every cut (for every sub-mesh, schedule and micro-batch
    count) picks under the same layer costs: cuts of the same objective."""
    model, inputs = build_model("mlp-tiny", batch_size=16)

    def best(splitter):
        monkeypatch.setattr(pipeline_search, "split_layers", splitter)
        ctx = SearchContext(model, inputs, SearchSettings(
            _cluster(8), dtype="float32", optimizer="adam", budget=2e9, time_limit_s=10),
            min_layers=6)
        cands = pipeline_search.search(ctx, pipeline_search.SearchOptions(
            pp=[2, 4], schedules=["1f1b", "gpipe"], microbatch_options=2))
        return sorted((c.label(), round(c.split.objective_s, 12)) for c in cands)

    # the same objective for every candidate (where cuts tie on it, each may
    # take another of them)
    assert best(split_layers) == best(exhaustive_split) != []


def test_pipelines_of_more_stages_than_layers_are_not_searched():
    """Configurations whose stages outnumber the layers are left out before
    their micro-batch programs are made: nothing is captured for them."""
    model, inputs = build_model("mlp-tiny", batch_size=16)
    ctx = SearchContext(model, inputs, SearchSettings(
        _cluster(8), dtype="float32", optimizer="adam", budget=2e9, time_limit_s=10),
        min_layers=4)
    num_layers = len(ctx.program(1).layers)
    assert num_layers == 4
    configs = pipeline_search.configurations(ctx, pipeline_search.SearchOptions(
        schedules=["1f1b", "interleaved_1f1b"], microbatch_options=2))
    assert {(pp, v) for pp, v, *_ in configs if pp > 1} == {(2, 1), (4, 1), (2, 2)}
    pipeline_search.search(ctx, pipeline_search.SearchOptions(
        pp=[8], schedules=["1f1b"], num_microbatches=[16]))
    assert [p.microbatch_size for p in ctx.programs()] == [16]  # nothing captured at size 1


def test_finalists_far_behind_the_fastest_prediction_are_set_aside():
    def cand(step_s):
        return PipelineCandidate(2, 1, None, "1f1b", 4, None, step_s, 0.0, 0.0)

    accumulating = PipelineCandidate(1, 1, None, "1f1b", 8, None, 300.0, 0.0, 0.0)
    finalists = [cand(110.0), cand(100.0), cand(200.0), accumulating, cand(114.0), cand(116.0)]
    close, far = finalists_of_search.split_far_finalists(finalists, margin=1.15)
    # one stage accumulating micro-batches is always solved (its predictions are coarse)
    assert [c.step_time_s for c in close] == [110.0, 100.0, 300.0, 114.0]
    assert [c.step_time_s for c in far] == [200.0, 116.0]


def test_far_finalists_are_solved_when_no_close_one_has_a_plan(monkeypatch):
    """plan() falls back to the finalists it set aside when none of the
    others has a plan within limits."""
    model, inputs = build_model("gpt-tiny")
    real_solve, real_split = finalists_of_search.solve_finalists, finalists_of_search.split_far_finalists
    asked: list[list[str]] = []

    def solve(ctx, finalists):
        asked.append([c.label() for c in finalists])
        results = real_solve(ctx, finalists)
        return [None] * len(results) if len(asked) == 1 else results  # the close ones: no plan

    monkeypatch.setattr(two_level_search, "solve_finalists", solve)  # as plan() calls them
    # only the fastest prediction is close
    monkeypatch.setattr(two_level_search, "split_far_finalists", lambda f: real_split(f, 1.0))
    p = plan(model, "local-cpu:4", example_inputs=inputs, model_source="gpt-tiny",
             pp=[2], schedules=["1f1b"], num_microbatches=[2, 4], zero_stages=[0])
    assert len(asked) == 2 and asked[1] and not set(asked[0]) & set(asked[1])
    assert p.predicted["step_time_s"] > 0


def _cluster(n):
    from costmodel.presets import local_cpu_cluster

    return local_cpu_cluster(n)


@pytest.fixture(scope="module")
def pp_plan():
    model, inputs = build_model("gpt-tiny")
    return pipeline_plan(model, "local-cpu:4", example_inputs=inputs, pp=2, stage_mesh=(2,),
                         schedule="1f1b", num_microbatches=2, model_source="gpt-tiny",
                         zoo_kwargs={"batch_size": 8})


def test_pipeline_plan_records_stages_on_the_world_mesh(pp_plan):
    pipe = pp_plan.pipeline
    assert pp_plan.mesh["shape"] == [2, 2] and pp_plan.mesh["axis_names"][0] == "pp"
    assert pipe.schedule == "1f1b" and pipe.num_microbatches == 2 and pipe.pp == 2
    s0, s1 = pipe.stages
    assert (s0.ranks, s1.ranks) == ([0, 1], [2, 3])
    assert list(s0.outputs) == list(s1.inputs)
    assert s0.outputs == s1.inputs  # the sender reshards into what the receiver reads
    assert set(s0.nodes).isdisjoint(s1.nodes)
    assert set(s0.nodes) | set(s1.nodes) == set(pp_plan.nodes)
    assert pp_plan.training["microbatch_size"] == 4 and pp_plan.training["global_batch"] == 8
    assert pp_plan.predicted["step_time_s"] > pp_plan.predicted["bubble_s"] > 0


def test_pipeline_plan_json_round_trips_and_is_deterministic(pp_plan, tmp_path):
    pp_plan.save(tmp_path / "plan.json")
    from plan.format import load_plan

    again = load_plan(tmp_path / "plan.json")
    assert again.to_json() == pp_plan.to_json()
    model, inputs = build_model("gpt-tiny")
    second = pipeline_plan(model, "local-cpu:4", example_inputs=inputs, pp=2, stage_mesh=(2,),
                           schedule="1f1b", num_microbatches=2, model_source="gpt-tiny",
                           zoo_kwargs={"batch_size": 8})
    assert second.to_json() == pp_plan.to_json()


def test_stage_times_with_a_shared_pricer_are_the_same(gpt_graph):
    """The search splits each solved stage into forward, backward and sync
    seconds with the mesh's shared ReshardPricer: the same seconds as with
    a pricer of its own, whatever that pricer priced before."""
    from costmodel.resharding import ReshardPricer
    from planner.search.stage_dp import stage_times

    cluster = load_cluster("local-cpu:4")
    result = solve_intra_op(gpt_graph, cluster, (2, 2), dtype="float32", time_limit_s=30)
    alone = stage_times(result, cluster, "float32", "adam")
    shared = ReshardPricer((2, 2), axis_links(cluster, (2, 2)))
    for _ in range(2):  # the second time from its memo
        assert stage_times(result, cluster, "float32", "adam", pricer=shared) == alone
    # the cost the result was solved with, whose node prices the solve kept
    prepared = prepare_intra_op(gpt_graph, cluster, (2, 2), dtype="float32", pricer=shared)
    solved = solve_prepared(prepared, time_limit_s=30)
    assert solved.chosen == result.chosen
    for _ in range(2):
        assert stage_times(solved, cluster, "float32", "adam", cost=prepared.cost) == alone


def test_zero3_stages_count_sharded_states_and_gather_in_every_microbatch():
    """Under ZeRO-3 (FSDP2 over stage mesh axis 0 of size 2, each layer and
    each module outside the layers a unit of its own, codegen.zero3_units) a
    stage keeps half its parameters, gradients and optimizer states, and on
    top, at its peak, the whole parameters and gradients of the units FSDP2
    holds gathered at once. Every micro-batch all-gathers the parameters in
    its forward and reduce-scatters the gradients in its backward, overlapped
    with the compute: nothing is left to synchronise at the end of the step,
    where the plain stage all-reduces its gradient sums once."""
    from planner.megatron_layout import MegatronConfig, megatron_layout

    model, inputs = build_model("gpt-tiny")
    layout = megatron_layout(trace(model, inputs), MegatronConfig(1, 2))  # params replicated
    plans = [pipeline_plan(model, "local-cpu:4", example_inputs=inputs, pp=2, stage_mesh=(2,),
                           schedule="1f1b", num_microbatches=4, zero_stage=zero, fixed=layout)
             for zero in (0, 3)]
    link = axis_links(load_cluster("local-cpu:2"), (2,))[0]
    for plain, zero3 in zip(plans[0].pipeline.stages, plans[1].pipeline.stages):
        assert zero3.zero_stage == 3 and zero3.zero_axis == 0
        a = plain.predicted["memory_bytes_per_device"]
        b = zero3.predicted["memory_bytes_per_device"]
        assert 0.5 * a["params"] < b["params"] < 1.5 * a["params"]
        assert b["grads"] == pytest.approx(b["params"], rel=1e-6, abs=2)
        assert b["optimizer"] == pytest.approx(0.5 * a["optimizer"], rel=1e-6, abs=2)
        assert zero3.predicted["grad_sync_s"] == 0.0 < plain.predicted["grad_sync_s"]
        assert zero3.predicted["forward_s"] >= collective_time("all_gather", a["params"], 2, link)
        assert zero3.predicted["backward_input_s"] >= collective_time("reduce_scatter",
                                                                      a["params"], 2, link)


def test_zero3_counts_whole_only_the_units_fsdp2_holds_gathered_at_once():
    """On an 8-layer GPT (untied head) in one ZeRO-3 stage over 4 ranks, each
    rank holds a quarter of every parameter and gradient; whole, on top, only
    those of the two consecutive units that hold the most (two layers: the
    one computing and the one prefetched), not the whole model."""
    import os

    from training.torchrun import REPO_ROOT

    model, inputs = build_model(os.path.join(REPO_ROOT, "tests", "pipeline_model.py") + ":gpt8",
                                device="meta")
    p = pipeline_plan(model, "local-cpu:4", example_inputs=inputs, pp=1, stage_mesh=(4,),
                      schedule="1f1b", num_microbatches=2, zero_stage=3, optimizer="sgd")
    sizes = {n: q.numel() * 4 for n, q in model.named_parameters()}  # fp32 bytes
    total = sum(sizes.values())
    layer = sum(v for n, v in sizes.items() if n.startswith("transformer.h.0."))
    mem = p.predicted["memory_bytes_per_device"]
    whole = 2 * layer
    assert mem["params"] == pytest.approx(total / 4 + whole, rel=1e-3)
    assert mem["grads"] == pytest.approx(total / 4 + whole, rel=1e-3)
    assert mem["params"] < 0.6 * total


def test_zero3_is_refused_with_a_split_backward_and_the_search_takes_zero2_there():
    """ZeRO-3 reshards each unit after its backward, which zbv's separate
    weight-gradient pass would find resharded: a fixed ZeRO-3 zbv plan is one
    clear error, and a search allowed ZeRO-2 and 3 gives zbv no ZeRO-3 stage."""
    import os

    from training.torchrun import REPO_ROOT
    from planner.api import plan

    model, inputs = build_model(os.path.join(REPO_ROOT, "tests", "pipeline_model.py") + ":gpt8",
                                device="meta")
    with pytest.raises(PlanningError, match="zbv computes weight gradients in a separate pass"):
        pipeline_plan(model, "local-cpu:4", example_inputs=inputs, pp=2, stage_mesh=(2,),
                      schedule="zbv", num_microbatches=4, zero_stage=3)
    found = plan(model, "local-cpu:4", example_inputs=inputs, pp=[2], schedules=["zbv"],
                 num_microbatches=[4], zero_stages=[0, 2, 3], time_limit_s=10,
                 precision="bf16-mixed")
    assert found.pipeline is not None and found.pipeline.schedule == "zbv"
    assert {st.zero_stage for st in found.pipeline.stages} <= {0, 2}


def test_plan_searches_zero3_stages_and_keeps_the_faster():
    """plan() also tries ZeRO for pipeline stages (under bf16-mixed ZeRO-3,
    FSDP2 over stage mesh axis 0): on gpt-tiny, pp=2 x 2 with 4
    micro-batches, allowed ZeRO-3 and none it keeps the faster of the plans
    each alone gives. Other stages are refused in one line (fp32 and ZeRO-1,
    which on 2 ranks holds as little as ZeRO-3 and is taken when allowed:
    tests/test_zero1.py)."""
    from planner.api import plan

    model, inputs = build_model("gpt-tiny")
    kwargs = dict(example_inputs=inputs, pp=[2], schedules=["1f1b"], num_microbatches=[4],
                  time_limit_s=10, precision="bf16-mixed")
    auto, plain, zero3 = (plan(model, "local-cpu:4", zero_stages=z, **kwargs)
                          for z in ([0, 3], [0], [3]))
    assert {(st.zero_stage, st.zero_axis) for st in zero3.pipeline.stages} == {(3, 0)}
    assert {st.zero_stage for st in plain.pipeline.stages} == {0}
    best = min(plain, zero3, key=lambda p: p.predicted["step_time_s"])
    assert auto.predicted["step_time_s"] == pytest.approx(best.predicted["step_time_s"], rel=1e-9)
    assert ({st.zero_stage for st in auto.pipeline.stages}
            == {st.zero_stage for st in best.pipeline.stages})
    with pytest.raises(PlanningError, match="ZeRO stages must be 0"):
        plan(model, "local-cpu:4", zero_stages=[5], **kwargs)


def test_pipeline_plan_rejects_impossible_requests():
    model, inputs = build_model("gpt-tiny")
    with pytest.raises(PlanningError, match="devices"):
        pipeline_plan(model, "local-cpu:4", example_inputs=inputs, pp=2, stage_mesh=(4,),
                      schedule="1f1b", num_microbatches=2)
    with pytest.raises(PlanningError, match="do not divide"):
        pipeline_plan(model, "local-cpu:4", example_inputs=inputs, pp=2, stage_mesh=(2,),
                      schedule="1f1b", num_microbatches=3)
    with pytest.raises(PlanningError, match="fits in memory"):
        pipeline_plan(model, "local-cpu:4", example_inputs=inputs, pp=2, stage_mesh=(2,),
                      schedule="1f1b", num_microbatches=2, memory_budget=1e5)


@pytest.mark.parametrize("devices", [4, 1])
def test_one_stage_accumulates_microbatches_when_the_whole_batch_does_not_fit(devices):
    """pp=1 is searched with the batch split into micro-batches whose gradients
    are accumulated (a one-stage 1F1B; on one device too): below the least
    memory of every whole-batch single-stage plan, that is the plan, and it fits."""
    from planner.api import plan
    from costmodel.cluster import candidate_mesh_shapes as mesh_candidates

    model, inputs = build_model("gpt-tiny", device="meta")
    graph, cluster = trace(model, inputs), load_cluster(f"local-cpu:{devices}")
    least = []
    for shape in mesh_candidates(devices):
        with pytest.raises(MemoryInfeasibleError) as err:
            solve_intra_op(graph, cluster, shape, memory_budget=1.0)
        least.append(err.value.least_bytes)
    # below every whole-batch plan; above the layer profiles' estimate of the best
    # accumulating plan (gpt-tiny's: 0.80 of it on one device, which counts the
    # value each end layer hands a block in both layers, as between blocks)
    budget = 0.9 * min(least)
    with pytest.raises(PlanningError):
        plan(model, cluster, example_inputs=inputs, pipeline=False, memory_budget=budget)
    got = plan(model, cluster, example_inputs=inputs, pp=[1], memory_budget=budget,
               time_limit_s=10)
    assert got.pipeline is not None and got.pipeline.pp == 1
    assert got.pipeline.schedule == "1f1b" and got.pipeline.num_microbatches > 1
    assert got.predicted["memory_bytes_per_device"]["total"] <= budget
    assert got.predicted["memory_bytes_per_device"]["peak"] <= budget


def test_plan_returns_a_pipeline_when_asked_and_the_same_one_twice():
    from planner.api import plan

    model, inputs = build_model("gpt-tiny")
    kwargs = dict(example_inputs=inputs, model_source="gpt-tiny", pp=[2],
                  schedules=["1f1b", "gpipe"], num_microbatches=[2, 4], time_limit_s=10)
    first = plan(model, "local-cpu:4", **kwargs)
    assert first.pipeline is not None and first.pipeline.pp == 2
    assert first.pipeline.schedule in ("1f1b", "gpipe")
    assert first.mesh["shape"][0] == 2 and first.world_size == 4
    assert plan(model, "local-cpu:4", **kwargs).to_json() == first.to_json()


def test_the_cycle_collector_is_paused_while_planning_and_restored_after(monkeypatch):
    """...and the search's schedule orders (its context's ScheduleBook) are
    freed by reference counting once plan() returns."""
    import gc
    import weakref

    from costmodel.schedules import ScheduleBook
    from planner.search import context as search_context
    books = []

    def recorded_book():
        book = ScheduleBook()
        books.append(weakref.ref(book))
        return book

    monkeypatch.setattr(search_context, "ScheduleBook", recorded_book)
    model, inputs = build_model("gpt-tiny")
    during = []

    def progress(msg):
        during.append((gc.isenabled(), any(b() is not None and b().holds("1f1b", 2, 2)
                                           for b in books)))

    kwargs = dict(example_inputs=inputs, pp=[2], schedules=["1f1b"], num_microbatches=[2],
                  zero_stages=[0], progress=progress)
    assert gc.isenabled()
    plan(model, "local-cpu:4", **kwargs)
    assert during and not any(enabled for enabled, _ in during) and gc.isenabled()
    assert any(held for _, held in during) and books and all(b() is None for b in books)
    gc.disable()  # a caller's own setting is left as it was
    try:
        plan(model, "local-cpu:4", **kwargs)
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_the_split_backward_groups_parameters_as_torch_does():
    """A stage of linear layers (with and without bias), a layer norm and a
    weight used twice: the graph's parameter groups are the ones torch's
    split backward forms (a weight and its bias at one op are one group, a
    weight read by two ops one group); without an input carrying a gradient,
    none (torch's first stage runs its backward whole)."""
    import dataclasses

    import torch

    from ir.torch_compat.split_backward import split_backward

    class Stage(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up = torch.nn.Linear(8, 16)
            self.norm = torch.nn.LayerNorm(16)
            self.down = torch.nn.Linear(16, 8, bias=False)
            self.gate = torch.nn.Parameter(torch.ones(8))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.down(torch.relu(self.norm(self.up(x)))) * self.gate
            return (h * self.gate).sum()

    torch.manual_seed(0)
    stage, x = Stage(), torch.randn(4, 8)
    graph = trace(stage, (x,))
    received = next(n.name for n in graph.nodes if n.kind == "input")
    with_input = dataclasses.replace(graph, grad_inputs=(received,))
    assert graph.weight_groups == 0
    torch_groups = split_backward(stage(x.requires_grad_()), [x], list(stage.parameters()))
    assert with_input.weight_groups == torch_groups == 4


def test_eager_zero_bubble_stages_pay_their_split_backward():
    """llama-tiny, pp=2, zbv: each stage's weight pass costs its parameter
    groups times the measured cost of one, but for the first stage (whose
    backward torch runs whole); 1F1B and compiled stages pay none."""
    import dataclasses

    model, inputs = build_model("llama-tiny", device="meta")
    base = load_cluster("local-cpu:2")
    split = dataclasses.replace(base, device=dataclasses.replace(
        base.device, split_backward_group_overhead=1e-3))
    kw = dict(example_inputs=inputs, pp=2, stage_mesh=(1,), num_microbatches=4, zero_stage=0,
              time_limit_s=10)

    def weight_passes(cluster, schedule="zbv", **extra):
        p = pipeline_plan(model, cluster, schedule=schedule, **kw, **extra)
        return [st.predicted["backward_weight_s"] for st in p.pipeline.stages], p

    (plain, _), (paid, p) = weight_passes(base), weight_passes(split)
    extra = [b - a for a, b in zip(plain, paid)]
    assert extra[0] == 0 and all(e > 0 for e in extra[1:])
    assert all(abs(e / 1e-3 - round(e / 1e-3)) < 1e-6 for e in extra)  # whole groups
    assert p.predicted["step_time_s"] > pipeline_plan(model, base, schedule="zbv",
                                                      **kw).predicted["step_time_s"]
    assert weight_passes(split, "1f1b")[0] == weight_passes(base, "1f1b")[0]
    assert weight_passes(split, compile=True)[0] == weight_passes(base, compile=True)[0]


def test_each_microbatch_after_the_first_adds_its_gradients_at_memory_speed():
    """llama-tiny, pp=2, 4 micro-batches of one device a stage: autograd adds
    each micro-batch's gradients after the first into the step's (reading
    both, writing one, fp32), so the stages pay three passes over their
    parameters' gradients at the device's streaming bandwidth, and the step
    waits for the slowest stage's."""
    import dataclasses

    model, inputs = build_model("llama-tiny", device="meta")
    cluster = load_cluster("local-cpu:2")
    kw = dict(example_inputs=inputs, pp=2, stage_mesh=(1,), num_microbatches=4, zero_stage=0,
              schedule="1f1b", time_limit_s=10)
    p = pipeline_plan(model, cluster, **kw)
    params = sum(t.numel() for t in model.parameters())
    stages = [st.predicted["accumulate_s"] for st in p.pipeline.stages]
    assert sum(stages) == pytest.approx(3 * 3 * 4 * params / cluster.device.streaming_bandwidth)
    assert p.predicted["accumulate_s"] == max(stages) > 0
    fast = dataclasses.replace(cluster, device=dataclasses.replace(
        cluster.device, memory_bandwidth=1e3 * cluster.device.memory_bandwidth))
    assert p.predicted["step_time_s"] > pipeline_plan(model, fast, **kw).predicted["step_time_s"]
