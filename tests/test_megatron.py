"""Megatron-LM manual plans in the Plan format (layout, grid, single stages and
pipelines, uneven layouts), and `planner compare`."""

import json
from typing import Any

import pytest

from training.launch import launch
from costmodel.presets import load_cluster
from ir import trace
from models.source import build_model
from planner.api import PlanningError, pipeline_plan
from planner.baselines.compare import compare
from planner.baselines.megatron import (MegatronConfig, MegatronDoesNotFit, megatron_configs,
                              megatron_layout, megatron_plan)
from planner.megatron_layout import _classify_linears


@pytest.mark.parametrize("name, column, row", [
    ("gpt-tiny", ["attn.c_attn", "mlp.c_fc"], ["attn.c_proj", "mlp.c_proj"]),
    ("llama-tiny", ["attention.wq", "attention.wk", "attention.wv", "feed_forward.w1",
                    "feed_forward.w3"], ["attention.wo", "feed_forward.w2"]),
])
def test_linears_are_classified_as_megatron_would(name, column, row):
    model, inputs = build_model(name, device="meta")
    kinds = _classify_linears(trace(model, inputs))
    for fqn, kind in kinds.items():
        if any(f".{c}.weight" in fqn for c in column):
            assert kind == "column", fqn
        elif any(f".{r}.weight" in fqn for r in row):
            assert kind == "row", fqn
    assert sum(k == "row" for k in kinds.values()) == 2 * len(row)


def test_row_parallel_linears_are_found_through_dropout():
    """Megatron's GPT drops out each block's projection before the residual add."""
    from models.zoo import GPTConfig, build_from_config

    model, inputs = build_from_config(GPTConfig(2, 64, 4, vocab_size=128, block_size=32,
                                                attention="unfused", dropout=0.1),
                                      batch_size=2, seq_len=32)
    kinds = _classify_linears(trace(model, inputs))
    assert sorted(k for k, v in kinds.items() if v == "row") == [
        f"transformer.h.{i}.{m}.c_proj.weight" for i in (0, 1) for m in ("attn", "mlp")]


def test_megatron_grid_is_powers_of_two_inside_a_node():
    cfgs = megatron_configs(load_cluster("dgx-a100-80g:2"))
    assert [(c.tensor_model_parallel_size, c.data_parallel_size, c.sequence_parallel)
            for c in cfgs] == [(1, 16, False), (2, 8, False), (2, 8, True), (4, 4, False),
                               (4, 4, True), (8, 2, False), (8, 2, True)]
    assert [c.label() for c in megatron_configs(load_cluster("dgx-a100-80g:2"),
                                                sequence_parallel=[True])] == [
        "tp=1 pp=1 dp=16", "tp=2 pp=1 dp=8 sp", "tp=4 pp=1 dp=4 sp", "tp=8 pp=1 dp=2 sp"]


def test_labels_use_megatron_terms():
    cfg = MegatronConfig(2, 8, pipeline_model_parallel_size=4, micro_batch_size=1,
                         virtual_pipeline_model_parallel_size=2)
    assert cfg.label() == "tp=2 pp=4 dp=8 mbs=1 vpp=2"
    assert cfg.schedule == "interleaved_1f1b" and cfg.world_size == 64
    assert cfg.mesh_shape == (8, 2)
    assert cfg.num_microbatches(512) == 64  # 512 / (mbs 1 x dp 8)
    plain = MegatronConfig(4, 1, pipeline_model_parallel_size=2, micro_batch_size=2)
    assert plain.label() == "tp=4 pp=2 dp=1 mbs=2" and plain.schedule == "1f1b"
    assert plain.mesh_shape == (4,)
    assert MegatronConfig(2, 2, use_distributed_optimizer=False).label() == "tp=2 pp=1 dp=2 no-dist-opt"
    assert MegatronConfig(2, 2, sequence_parallel=True).label() == "tp=2 pp=1 dp=2 sp"


def test_configs_that_do_not_divide_are_rejected():
    with pytest.raises(PlanningError, match="pipeline_model_parallel_size >= 2"):
        MegatronConfig(2, 2, virtual_pipeline_model_parallel_size=2)
    with pytest.raises(PlanningError, match="v >= 2"):
        MegatronConfig(2, 2, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=1)
    cfg = MegatronConfig(1, 2, pipeline_model_parallel_size=4, micro_batch_size=3)
    with pytest.raises(PlanningError, match="do not split evenly"):
        cfg.layer_split(6)
    assert cfg.layer_split(8) == [2, 2, 2, 2]
    with pytest.raises(PlanningError, match="does not divide the batch"):
        cfg.num_microbatches(16)
    assert MegatronConfig(2, 2, micro_batch_size=1).num_microbatches(8) == 4  # accumulation
    with pytest.raises(PlanningError, match="multiple of pp"):
        MegatronConfig(1, 1, pipeline_model_parallel_size=4, micro_batch_size=2,
                       virtual_pipeline_model_parallel_size=2).num_microbatches(12)
    model, inputs = build_model("gpt-tiny", device="meta")  # 2 layers
    with pytest.raises(PlanningError, match="do not split evenly"):
        megatron_plan(model, "local-cpu:4", MegatronConfig(
            2, 1, pipeline_model_parallel_size=2, micro_batch_size=2,
            virtual_pipeline_model_parallel_size=2), example_inputs=inputs)
    with pytest.raises(PlanningError, match="needs 8 devices"):
        megatron_plan(model, "local-cpu:4", MegatronConfig(2, 2, pipeline_model_parallel_size=2,
                                                           micro_batch_size=2),
                      example_inputs=inputs)
    with pytest.raises(MegatronDoesNotFit, match="parameter states"):
        megatron_plan(model, "local-cpu:4", MegatronConfig(2, 2), example_inputs=inputs,
                      memory_budget=1e4)


def test_uneven_first_and_last_stages_and_forced_recompute_are_megatron_options():
    cfg = MegatronConfig(8, 1, pipeline_model_parallel_size=12,
                         decoder_first_pipeline_num_layers=5, decoder_last_pipeline_num_layers=5)
    assert cfg.layer_split(70) == [5] + [6] * 10 + [5]
    assert MegatronConfig(1, 1, pipeline_model_parallel_size=3,
                          decoder_last_pipeline_num_layers=2).layer_split(8) == [3, 3, 2]
    with pytest.raises(PlanningError, match="do not split evenly"):
        cfg.layer_split(71)
    with pytest.raises(PlanningError, match="no virtual pipeline stages"):
        MegatronConfig(1, 1, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2,
                       decoder_first_pipeline_num_layers=1)
    with pytest.raises(PlanningError, match="not modelled"):
        MegatronConfig(1, 1, recompute_granularity="selective")
    model, inputs = build_model("gpt-tiny", device="meta", batch_size=8)
    full = megatron_plan(model, "local-cpu:2", MegatronConfig(
        1, 2, recompute_granularity="full"), example_inputs=inputs)
    free = megatron_plan(model, "local-cpu:2", MegatronConfig(1, 2), example_inputs=inputs)
    assert full.checkpoint and not free.checkpoint
    assert full.predicted["step_time_s"] > free.predicted["step_time_s"]


def test_megatron_ddp_reduces_gradients_once_per_step():
    """Without the distributed optimizer Megatron's DDP accumulates gradients over
    the micro-batches and all-reduces them once: more micro-batches of the same
    batch do not add data-parallel communication."""
    model, inputs = build_model("gpt-tiny", device="meta", batch_size=8)
    sync = []
    for mbs in (2, 1):  # 2 and 4 micro-batches per step
        p = megatron_plan(model, "local-cpu:2", MegatronConfig(
            1, 2, use_distributed_optimizer=False, micro_batch_size=mbs), example_inputs=inputs)
        sync.append(p.predicted["grad_sync_s"])
    assert sync[0] > 0 and sync[1] == pytest.approx(sync[0], rel=1e-9)


def test_pipeline_grid_is_valid():
    cluster = load_cluster("dgx-a100-80g:2")
    cfgs = megatron_configs(cluster, 64, 24)
    labels = [c.label() for c in cfgs]
    assert len(set(labels)) == len(labels)
    assert {c.pp for c in cfgs} == {1, 2, 4, 8}  # 16 devices, 24 layers: 16 does not divide 24
    assert any(c.virtual_pipeline_model_parallel_size for c in cfgs)
    for c in cfgs:
        assert c.world_size == 16 and c.tp in (1, 2, 4, 8)
        assert sum(c.layer_split(24)) == 24
        m = c.num_microbatches(64)  # raises if the batch does not split
        if c.pp == 1 and m == 1:  # the whole local batch at once
            assert c.micro_batch_size * c.dp == 64
        else:  # pipelined, or gradient accumulation without a pipeline
            assert m >= c.pp and c.micro_batch_size in (1, 2, 4)
    # without a pipeline: accumulation over micro-batches of 1, 2, 4, or the whole batch
    assert [c.micro_batch_size for c in cfgs if (c.pp, c.tp, c.sequence_parallel) ==
            (1, 2, False)] == [1, 2, 4, 8]
    assert [c.label() for c in megatron_configs(
        cluster, 64, 24, micro_batch_sizes=[1], virtual_stages=[None])[-2:]] == [
        "tp=2 pp=8 dp=1 mbs=1", "tp=2 pp=8 dp=1 mbs=1 sp"]


@pytest.fixture(scope="module")
def megatron_pp2():
    model, inputs = build_model("gpt-tiny", device="meta")
    cfg = MegatronConfig(2, 1, pipeline_model_parallel_size=2, micro_batch_size=2)
    return megatron_plan(model, "local-cpu:4", cfg, example_inputs=inputs,
                         model_source="gpt-tiny"), cfg


def test_megatron_pipeline_plan_has_stages_and_the_layout(megatron_pp2):
    p, cfg = megatron_pp2
    pipe = p.pipeline
    assert p.mesh["shape"] == [2, 2] and pipe.schedule == "1f1b"
    assert pipe.num_microbatches == 4  # batch 8 / (mbs 2 x dp 1)
    assert [s.layers for s in pipe.stages] == [
        ["transformer.wte+transformer.wpe", "transformer.h.0"],
        ["transformer.h.1", "transformer.ln_f+lm_head"]]
    assert [s.ranks for s in pipe.stages] == [[0, 1], [2, 3]]
    assert p.parameters["transformer.h.0.attn.c_attn.weight"] == ["S(0)"]
    assert p.parameters["transformer.h.1.mlp.c_proj.weight"] == ["S(1)"]
    assert p.parameters["transformer.wte.weight"] == ["S(0)"]
    assert p.training["manual"]["pipeline_model_parallel_size"] == 2
    # the same plan as pipeline_plan() with the layout fixed and Megatron's uniform split
    model, inputs = build_model("gpt-tiny", device="meta")
    q = pipeline_plan(model, "local-cpu:4", example_inputs=inputs, pp=2, stage_mesh=(2,),
                      schedule="1f1b", num_microbatches=4, layer_split=[1, 1],
                      fixed=megatron_layout(trace(model, inputs), cfg), model_source="gpt-tiny")
    # the same parameters and prices; the two routes (with and without a memory
    # budget) may take different ones of equally fast placements of a view.
    # Our runtime adds each micro-batch's gradients in a pass of its own, which
    # Megatron fuses into its weight-gradient GEMMs
    assert q.parameters == p.parameters and q.nodes.keys() == p.nodes.keys()
    assert all(q.nodes[k] == e or "view" in e.op for k, e in p.nodes.items())
    assert p.predicted["accumulate_s"] == 0 < q.predicted["accumulate_s"]
    assert q.predicted["step_time_s"] == pytest.approx(
        p.predicted["step_time_s"] + q.predicted["accumulate_s"], rel=1e-9)


def test_megatron_without_a_pipeline_accumulates_microbatches():
    """tp=4 pp=1 with micro-batches of 2 of the batch of 8: one stage whose
    1F1B accumulates the gradients of 4 micro-batches, the same plan as
    pipeline_plan() of that one stage with the layout fixed: the same
    parameters, prices and memory, but for the pass that adds each
    micro-batch's gradients, which Megatron fuses into its weight-gradient
    GEMMs. (The two reach the stage's ILP by other routes, with and without a
    memory budget, and may take different ones of equally fast activation
    placements: the c_proj weight's transpose is one.)"""
    model, inputs = build_model("gpt-tiny", device="meta")
    cfg = MegatronConfig(4, 1, micro_batch_size=2)
    p = megatron_plan(model, "local-cpu:4", cfg, example_inputs=inputs, model_source="gpt-tiny")
    assert p.pipeline is not None and p.pipeline.pp == 1 and p.pipeline.schedule == "1f1b"
    assert p.pipeline.num_microbatches == 4 and p.mesh["shape"] == [1, 4]
    q = pipeline_plan(model, "local-cpu:4", example_inputs=inputs, pp=1, stage_mesh=(4,),
                      schedule="1f1b", num_microbatches=4, layer_split=[2],
                      fixed=megatron_layout(trace(model, inputs), cfg), model_source="gpt-tiny")
    assert q.parameters == p.parameters and q.nodes.keys() == p.nodes.keys()
    assert q.predicted["step_time_s"] == pytest.approx(
        p.predicted["step_time_s"] + q.predicted["accumulate_s"], rel=1e-9)
    assert (q.predicted["memory_bytes_per_device"]
            == pytest.approx(p.predicted["memory_bytes_per_device"], rel=1e-9))


def test_megatron_pipeline_prices_the_distributed_optimizer_over_dp():
    """Megatron's distributed optimizer in a pipeline (tp=1 pp=2 dp=2, 4
    micro-batches): its stages record ZeRO-1 over the dp axis, keep half the
    optimizer states of the same configuration without it and update half of
    them; both reduce the gradients once per step: DDP all-reduces them, and
    the distributed optimizer on gloo too (it reduce-scatters by
    all-reducing), then all-gathers the updated parameters. Which step is
    faster depends on the machine's bandwidths: not asserted."""
    model, inputs = build_model("gpt-tiny", device="meta")
    plans = [megatron_plan(model, "local-cpu:4", MegatronConfig(
        1, 2, use_distributed_optimizer=dist, pipeline_model_parallel_size=2,
        micro_batch_size=1), example_inputs=inputs) for dist in (True, False)]
    assert plans[0].pipeline.num_microbatches == 4
    for zero1, plain in zip(plans[0].pipeline.stages, plans[1].pipeline.stages):
        assert (zero1.zero_stage, zero1.zero_axis, plain.zero_stage) == (1, 0, 0)
        a = zero1.predicted["memory_bytes_per_device"]
        b = plain.predicted["memory_bytes_per_device"]
        assert a["optimizer"] == pytest.approx(b["optimizer"] / 2, rel=1e-6, abs=2)
        assert a["params"] == b["params"] and a["grads"] == b["grads"]
        assert zero1.predicted["grad_sync_s"] > plain.predicted["grad_sync_s"]
        assert zero1.predicted["backward_input_s"] == pytest.approx(
            plain.predicted["backward_input_s"])
        assert zero1.predicted["update_s"] < plain.predicted["update_s"]


@pytest.mark.multiprocess
def test_megatron_pipeline_plan_runs_and_matches_one_process(megatron_pp2, tmp_path):
    path = tmp_path / "plan.json"
    megatron_pp2[0].save(path)
    result = launch(path, steps=1, check=True)
    assert result["passed"], result.get("output")


@pytest.fixture(scope="module")
def megatron_2x2():
    model, inputs = build_model("gpt-tiny", device="meta")
    return megatron_plan(model, "local-cpu:4", MegatronConfig(2, 2), example_inputs=inputs,
                         model_source="gpt-tiny")


def test_megatron_plan_has_the_megatron_layout(megatron_2x2):
    p = megatron_2x2
    assert p.mesh_shape == (2, 2)
    assert p.parameters["transformer.h.0.attn.c_attn.weight"] == ["R", "S(0)"]
    assert p.parameters["transformer.h.0.mlp.c_proj.weight"] == ["R", "S(1)"]
    assert p.parameters["transformer.wte.weight"] == ["R", "S(0)"]
    assert p.inputs["idx"] == ["S(0)", "R"]
    assert p.training["manual"]["tensor_model_parallel_size"] == 2
    assert p.pipeline is None


@pytest.mark.multiprocess
def test_megatron_plan_runs_and_matches_one_process(megatron_2x2, tmp_path):
    path = tmp_path / "plan.json"
    megatron_2x2.save(path)
    result = launch(path, steps=2, check=True)
    assert result["passed"], result.get("output")
    assert result["max_rel_grad_err"] < 1e-5 and result["observed_match"]
    # the runtime reshards where the plan says, and only there
    assert result["num_mismatches"] == 0 and result["implicit_reshards"] == 0
    assert result["explicit_reshards"] == len(megatron_2x2.reshards) > 0


def test_auto_plan_is_never_slower_than_the_best_megatron_plan(tmp_path):
    result = compare("gpt-tiny", "local-cpu:4")
    rows = [r for r in result["plans"] if "step_time_s" in r]
    auto = next(r for r in rows if r["name"] == "auto")
    best_manual = min(r["step_time_s"] for r in rows if r["name"] == "megatron")
    assert auto["step_time_s"] <= best_manual * (1 + 1e-9)
    assert result["auto_speedup_over_best_megatron"] >= 1.0
    assert all(0 < r["mfu"] <= 1 for r in rows)
    configs = {r["config"] for r in result["plans"] if r["name"] == "megatron"}
    assert {"tp=2 pp=1 dp=2 mbs=4", "tp=2 pp=2 dp=1 mbs=1"} <= configs
    assert result["best_megatron"] in configs and len(result["runners_up"]) == 3
    assert any(r.get("megatron", {}).get("pp") == 2 and "step_time_s" in r for r in rows)


def test_compare_command_writes_table_json_and_chart(tmp_path, capsys):
    from app.cli import main

    prefix = tmp_path / "out" / "cmp"
    assert main(["compare", "--model", "gpt-tiny", "--cluster", "local-cpu:2", "--no-interleaved",
                 "--micro-batch-sizes", "2", "-o", str(prefix)]) == 0
    text = capsys.readouterr().out
    assert "tp=2 pp=1 dp=1 mbs=8" in text and "tp=1 pp=2 dp=1 mbs=2" in text
    assert "tp=2 pp=1 dp=1 mbs=8 sp" in text  # sequence parallelism is tried too
    assert "vpp" not in text and "auto plan is" in text and "best Megatron plan" in text
    data = json.loads((tmp_path / "out" / "cmp.json").read_text())
    assert data["devices"] == 2
    # the chart's title states the step compared
    assert (data["global_batch"], data["seq_len"], data["precision"]) == (8, 32, "fp32")
    assert {r["megatron"]["sequence_parallel"] for r in data["plans"] if "megatron" in r} == {
        False, True}
    from app.cli import build_parser
    assert not build_parser().parse_args(["compare", "--model", "m", "--cluster", "c",
                                          "--no-sequence-parallel"]).sequence_parallel
    assert (tmp_path / "out" / "cmp.png").read_bytes()[:4] == b"\x89PNG"


def test_published_megatron_row_fits_its_gpus():
    """Table 1's 1.7B run (Narayanan et al. 2021: 32 A100 80 GB, dp=32, micro-batch
    16, full recomputation) fits: a checkpointed layer keeps its input per device."""
    from benchmarks.published_megatron import TABLE_1, build_row, megatron_config

    run = TABLE_1[0]
    model, inputs, cluster = build_row(run)
    plan = megatron_plan(model, cluster, megatron_config(run), example_inputs=inputs)
    memory = plan.predicted["memory_bytes_per_device"]
    assert memory["peak"] <= memory["total"] <= cluster.device.memory
    assert plan.checkpoint  # every layer recomputed


def test_gradients_are_reduced_in_the_reduce_dtype():
    """bf16-mixed reduces gradients in fp32 unless told bf16: twice the bytes, and
    the plan records which."""
    from ir.precision import get_precision

    model, inputs = build_model("gpt-tiny", device="meta", batch_size=8)
    plans = [megatron_plan(model, "local-cpu:2", MegatronConfig(
        1, 2, use_distributed_optimizer=False, micro_batch_size=2), example_inputs=inputs,
        precision=get_precision("bf16-mixed", reduce)) for reduce in (None, "bf16")]
    assert [p.training["reduce_dtype"] for p in plans] == ["float32", "bfloat16"]
    assert plans[0].predicted["grad_sync_s"] > plans[1].predicted["grad_sync_s"]


@pytest.mark.parametrize("reduce,whole,sharded", [(None, 6, 12), ("bf16", 4, 16)])
@pytest.mark.parametrize("cfg,d", [
    (MegatronConfig(1, 4), 4),                                  # one stage, the whole batch
    (MegatronConfig(1, 4, micro_batch_size=1), 4),              # one stage, 2 micro-batches
    (MegatronConfig(2, 2), 2),                                  # tp-sharded weights
    (MegatronConfig(1, 4, use_distributed_optimizer=False), 1),  # Megatron's optimizer alone
    (MegatronConfig(4, 1), 1),
])
def test_megatron_plans_hold_the_distributed_optimizers_bytes(cfg, d, reduce, whole, sharded):
    """A Megatron plan under bf16-mixed holds, per parameter element a device
    holds, what Megatron-LM's distributed optimizer does over d data-parallel
    ranks: 6 + 12/d bytes with fp32 gradients, 4 + 16/d with bf16 ones (d = 1
    without the distributed optimizer: 18 and 20); parameters (bf16) and
    gradients whole, the fp32 master copy with Adam's moments in 'optimizer'
    (with bf16 gradients an fp32 main-gradient slice besides them)."""
    import math

    from ir.graph import PARAM
    from ir.precision import get_precision
    from ir.strategy import local_numel

    model, inputs = build_model("gpt-tiny", device="meta")
    p = megatron_plan(model, "local-cpu:4", cfg, example_inputs=inputs,
                      precision=get_precision("bf16-mixed", reduce))
    graph = trace(model, inputs)
    layout = megatron_layout(graph, cfg)
    local = [math.ceil(local_numel(n.output, layout[n.fqn], cfg.mesh_shape))
             for n in graph.nodes if n.kind == PARAM]
    memory = p.predicted["memory_bytes_per_device"]
    grad = 4 if reduce is None else 2
    sliced = sum(-(-k // d) for k in local)
    assert memory["params"] == 2 * sum(local)
    assert memory["grads"] == grad * sum(local) + (sharded - 12) * sliced  # + fp32 main grads
    assert memory["optimizer"] == 12 * sliced  # fp32 master slice and Adam's moments
    assert 2 + grad == whole


def test_uneven_first_stage_is_planned_with_its_layer_count():
    from models.zoo import GPTConfig, build_from_config

    model, inputs = build_from_config(GPTConfig(4, 64, 4, vocab_size=128, block_size=32),
                                      batch_size=4, seq_len=32)
    plan = megatron_plan(model, "local-cpu:2", MegatronConfig(
        1, 1, pipeline_model_parallel_size=2, micro_batch_size=2,
        decoder_first_pipeline_num_layers=1), example_inputs=inputs)
    blocks = [[layer for layer in st.layers if ".h." in layer] for st in plan.pipeline.stages]
    assert [len(b) for b in blocks] == [1, 3]


def _llama3_uneven_layout_plan() -> Any:
    """llama-tiny on 2 H100s, pp 2 with 2 chunks each, Llama 3's layout: the
    first chunk the embedding alone, the last the head and loss."""
    model, inputs = build_model("llama-tiny", device="meta")
    cfg = MegatronConfig(1, 1, pipeline_model_parallel_size=2,
                         virtual_pipeline_model_parallel_size=2, micro_batch_size=1,
                         pipeline_model_parallel_layout=(0, 1, 1, 0))
    return megatron_plan(model, load_cluster("dgx-h100:1").sub_cluster(1, 2), cfg,
                         example_inputs=inputs)


def test_uneven_layout_may_leave_the_first_and_last_chunk_only_embedding_and_head():
    """Llama 3's layout: the first chunk the embedding alone, the last the head and loss."""
    plan = _llama3_uneven_layout_plan()
    layers = [st.layers for st in plan.pipeline.stages]
    assert len(layers) == 4 and not any("layers." in l for l in layers[0] + layers[-1])
    with pytest.raises(ValueError, match="at least one"):
        MegatronConfig(1, 1, pipeline_model_parallel_size=2,
                       virtual_pipeline_model_parallel_size=2,
                       pipeline_model_parallel_layout=(1, 0, 1, 0))


def test_the_head_chunk_of_an_uneven_layout_holds_one_microbatch_in_flight():
    """Each chunk is priced with its own micro-batches at its rank's peak:
    under interleaved 1F1B the last chunk (head and loss alone) runs each
    micro-batch's backward right after its forward, while the rank's other
    chunk holds several; an even share of the rank's peak would count the
    head's logits more than once."""
    from costmodel.schedules.peaks import stage_counts_at_peak
    from costmodel.schedules import peak_activations, rank_orders

    plan = _llama3_uneven_layout_plan()
    stages = plan.pipeline.stages
    m = plan.pipeline.num_microbatches
    assert m >= 4
    in_flight = [st.predicted["in_flight_microbatches"] for st in stages]
    assert in_flight[-1] == 1
    assert in_flight[1] > 1  # the last rank's layer chunk
    orders, _ = rank_orders("interleaved_1f1b", 2, m, 2)
    peaks, _ = peak_activations("interleaved_1f1b", 2, m, 2)
    assert stage_counts_at_peak(orders, 2)[3] == 1 and peaks[1] > 2
