"""Hugging Face causal LMs (``--model hf:...``): built from a config, planned as
the CPU ranks capture them, tied weights as one parameter, dropout refused by
the check with its reason. A tied Qwen2 plan runs with ``--check`` in
tests/test_readme.py (README's example); benchmarks/hf_models.py checks five
families on four ranks."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", reason="Hugging Face transformers is not installed "
                    "(pip install '.[hf]')")

from training.launch import launch  # noqa: E402
from training.torchrun import LaunchError  # noqa: E402
from ir.device_capture import on_device_type  # noqa: E402
from ir.exported_graph import tied_parameters  # noqa: E402
from models.source import ModelSourceError, build_model  # noqa: E402
from ir.trace import trace  # noqa: E402
from planner.api import plan  # noqa: E402
from planner.request import PlanRequest  # noqa: E402

SMALL = ("num_hidden_layers=2,hidden_size=64,intermediate_size=128,num_attention_heads=4,"
         "num_key_value_heads=2,vocab_size=256")
GPT2 = "hf:gpt2,n_layer=2,n_embd=64,n_head=4,vocab_size=256,n_positions=64"
NO_DROPOUT = ",resid_pdrop=0,embd_pdrop=0,attn_pdrop=0"


def test_a_config_field_list_builds_the_model_and_its_step():
    model, (ids, labels) = build_model(f"hf:llama,{SMALL}", device="meta", seq_len=16)
    assert type(model.hf).__name__ == "LlamaForCausalLM"
    assert model.hf.config.num_hidden_layers == 2 and model.hf.config.hidden_size == 64
    assert ids.shape == labels.shape == (8, 16) and ids.dtype == torch.int64


def test_a_config_json_folder_builds_the_model(tmp_path):
    from transformers import AutoConfig

    AutoConfig.for_model("qwen2", **{k: int(v) for k, v in
                                     (f.split("=") for f in SMALL.split(","))}
                         ).save_pretrained(tmp_path)
    model, (ids, _) = build_model(f"hf:{tmp_path}", device="meta", batch_size=2, seq_len=8)
    assert type(model.hf).__name__ == "Qwen2ForCausalLM" and ids.shape == (2, 8)


@pytest.mark.parametrize("spec, words", [
    ("hf:no-such-type", "unknown model type 'no-such-type'"),
    ("hf:llama,hidden_size", "'hidden_size' is not FIELD=VALUE"),
    ("hf:/nowhere/config.json", "no config file /nowhere/config.json"),
])
def test_a_bad_spec_is_one_line_naming_what_is_wrong(spec, words):
    with pytest.raises(ModelSourceError) as err:
        build_model(spec, device="meta")
    assert words in str(err.value) and "\n" not in str(err.value)


def test_a_sequence_longer_than_the_config_allows_is_refused():
    with pytest.raises(ModelSourceError, match="longer than the config's 64 positions"):
        build_model(GPT2, device="meta", seq_len=128)


def test_tied_embedding_and_head_are_one_parameter_of_the_program():
    model, inputs = build_model(GPT2 + NO_DROPOUT, device="meta", seq_len=16)
    assert tied_parameters(model) == {"hf.lm_head.weight": "hf.transformer.wte.weight"}
    graph = trace(model, inputs)
    assert "hf.transformer.wte.weight" in graph.parameters
    assert "hf.lm_head.weight" not in graph.parameters
    readers = [n for n in graph.nodes if "hf.transformer.wte.weight" in n.params]
    assert len(readers) == 2 and "aten.embedding.default" in {n.target for n in readers}


def test_full_size_gpt2_has_124m_parameters_with_its_tied_head_counted_once():
    model, inputs = build_model("hf:gpt2", device="meta", batch_size=1, seq_len=128)
    graph = trace(model, inputs)
    assert sum(info.numel for info in graph.parameters.values()) == 124_439_808


def test_a_pipeline_of_a_tied_model_is_refused_in_one_line():
    from planner.api import pipeline_plan
    from planner.request import PlanningError

    model, inputs = build_model(GPT2 + NO_DROPOUT, device="meta", seq_len=16)
    with pytest.raises(PlanningError, match="hf.lm_head.weight is tied to "
                       "hf.transformer.wte.weight.*plan pp=1"):
        pipeline_plan(model, "local-cpu:2", example_inputs=inputs, pp=2, stage_mesh=(1,),
                      schedule="1f1b", num_microbatches=2)


def test_a_cpu_plan_captures_the_program_cpu_ranks_capture():
    """Mixtral's experts count tokens in float32 on the CPU and int32 elsewhere
    (meta included): the plan for CPU ranks must capture the CPU's program."""
    spec = f"hf:mixtral,{SMALL},num_local_experts=4"
    meta_model, meta_inputs = build_model(spec, device="meta", seq_len=16)
    planned = trace(*on_device_type(meta_model, meta_inputs, "cpu"))
    ran = trace(*build_model(spec, device="cpu", seq_len=16))
    assert planned.fingerprint() == ran.fingerprint()
    assert trace(meta_model, meta_inputs).fingerprint() != ran.fingerprint()


def test_check_refuses_a_model_with_dropout_before_starting_ranks(tmp_path):
    model, inputs = build_model(GPT2, device="meta", seq_len=16)
    result = plan(model, "local-cpu:2", example_inputs=inputs,
                  request=PlanRequest(model_source=GPT2, mesh_shape=(2,), pipeline=False,
                                      zoo_kwargs={"seq_len": 16}))
    path = tmp_path / "plan.json"
    result.save(str(path))
    with pytest.raises(LaunchError) as err:
        launch(path, check=True)
    message = str(err.value)
    assert err.value.user_error and "native_dropout" in message and "dropout to 0" in message


def test_a_mask_made_from_the_token_ids_is_recomputed_by_later_stages_not_sent():
    """A pipeline stage after the first computes Qwen2's boolean attention mask
    again from its own copy of the micro-batch (only values with a gradient cross
    stages); values of the activations are never recomputed. The pp=2 plan runs
    with ``--check`` in test_a_pipeline_of_qwen2_with_its_mask_passes_check."""
    import operator

    from codegen.capture import capture_program
    from codegen.stage_executor import recomputable_cones

    model, inputs = build_model(f"hf:qwen2,{SMALL},tie_word_embeddings=false", device="meta",
                                batch_size=2, seq_len=16)
    program = capture_program(model, inputs, device=torch.device("cpu")).ep
    values = [n for n in program.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)]
    cones = recomputable_cones(program, [n.name for n in values])
    masks = [n for n in values if n.name in cones and n.meta["val"].dtype == torch.bool
             and n.meta["val"].dim() == 4]
    assert masks, "no 4-d boolean mask among the recomputable values"
    user_inputs = set(program.graph_signature.user_inputs)
    for name, cone in cones.items():
        assert not cone[-1].meta["val"].is_floating_point() and cone[-1].name == name
        read = {a.name for n in cone for a in n.all_input_nodes if a.op == "placeholder"}
        assert read <= user_inputs | set(program.graph_signature.inputs_to_lifted_tensor_constants)
    floats = [n.name for n in values if n.op == "call_function"
              and n.meta["val"].is_floating_point() and n.target is not operator.getitem]
    assert not set(recomputable_cones(program, floats))


@pytest.mark.slow  # 60 s on 2 ranks; the mask's recompute is checked above without ranks
def test_a_pipeline_of_qwen2_with_its_mask_passes_check(tmp_path):
    from planner.api import pipeline_plan

    spec = f"hf:qwen2,{SMALL},tie_word_embeddings=false"
    model, inputs = build_model(spec, device="meta", batch_size=4, seq_len=16)
    result = pipeline_plan(model, "local-cpu:2", example_inputs=inputs, pp=2, stage_mesh=(1,),
                           schedule="1f1b", num_microbatches=2, model_source=spec,
                           zoo_kwargs={"batch_size": 4, "seq_len": 16})
    path = tmp_path / "plan.json"
    result.save(str(path))
    outcome = launch(path, check=True, steps=1)
    assert outcome["passed"], outcome["output"]


def test_the_cli_refuses_pipelines_of_a_tied_model_in_one_line(tmp_path, capsys):
    from app.cli import main

    code = main(["plan", "--model", f"hf:qwen2,{SMALL},tie_word_embeddings=true", "--cluster",
                 "local-cpu:2", "--seq-len", "16", "--pp", "2", "-o", str(tmp_path / "p.json")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and not (tmp_path / "p.json").exists()
    assert "no pipeline with pp=2: parameter hf.lm_head.weight is tied to " in err
