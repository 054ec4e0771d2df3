"""Hugging Face checkpoints in training (training/hf_checkpoint.py): a folder
``save_pretrained`` wrote loads into the planner's model, plain or as DTensor
shards (each rank reading its block only); an export loads back with
``from_pretrained`` and gives the same logits; nothing is ever overwritten,
and a checkpoint of another model is refused in one line."""

from __future__ import annotations

import contextlib
import json
import os
import warnings
import weakref

import pytest
import torch

pytest.importorskip("transformers", reason="Hugging Face transformers is not installed "
                    "(pip install '.[hf]')")
pytest.importorskip("safetensors", reason="safetensors is not installed")

from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from ir.exported_graph import tied_parameters  # noqa: E402
from models.source import build_model  # noqa: E402
from training.hf_checkpoint import (  # noqa: E402
    CheckpointError, check_export_target, export_hf, export_plain, is_hf_folder,
    load_hf_weights,
)

QWEN2 = dict(model_type="qwen2", num_hidden_layers=2, hidden_size=64, intermediate_size=128,
             num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
             tie_word_embeddings=True)
GPT2 = dict(model_type="gpt2", n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=64,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def _hf_model(fields: dict, seed: int = 7, dtype: torch.dtype = torch.float32):
    fields = dict(fields)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).to(dtype).eval()


def _saved(tmp_path, fields: dict, name: str = "ckpt", **save) -> tuple[str, torch.nn.Module]:
    """A folder save_pretrained wrote, and the model it holds."""
    model = _hf_model(fields, dtype=save.pop("dtype", torch.float32))
    folder = str(tmp_path / name)
    model.save_pretrained(folder, **save)
    return folder, model


def _ours(spec: str) -> torch.nn.Module:
    """The planner's model of ``hf:spec`` on the CPU (random weights of seed 1)."""
    model, _ = build_model("hf:" + spec, device="cpu", seed=1, batch_size=2, seq_len=16)
    return model


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters (tied ones once) and persistent buffers."""
    persistent = set(model.state_dict())
    return {**dict(model.named_parameters()),
            **{n: b for n, b in model.named_buffers() if n in persistent}}


@pytest.mark.parametrize("fields", [QWEN2, GPT2], ids=["qwen2-tied", "gpt2"])
def test_a_saved_checkpoint_loads_into_the_planners_model(tmp_path, fields):
    folder, hf = _saved(tmp_path, fields)
    assert is_hf_folder(folder) and not is_hf_folder(str(tmp_path))
    ours = _ours(folder)
    state = _state(ours)
    reference = hf.state_dict()
    assert any(not torch.equal(t, reference[n[3:]]) for n, t in state.items())  # other weights
    load_hf_weights(folder, state)
    for fqn, tensor in state.items():
        assert torch.equal(tensor, reference[fqn[len("hf."):]]), fqn
    if fields is QWEN2:
        assert ours.hf.lm_head.weight is ours.hf.model.embed_tokens.weight


def test_a_bf16_sharded_checkpoint_loads_converted(tmp_path):
    folder, hf = _saved(tmp_path, QWEN2, dtype=torch.bfloat16, max_shard_size="40KB")
    assert os.path.isfile(os.path.join(folder, "model.safetensors.index.json"))
    assert len([n for n in os.listdir(folder) if n.endswith(".safetensors")]) > 1
    state = _state(_ours(folder).float())  # the config says bf16: train in fp32
    load_hf_weights(folder, state)
    for fqn, tensor in state.items():
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, hf.state_dict()[fqn[3:]].float()), fqn


def test_a_tied_weight_stored_under_its_second_name_is_read(tmp_path):
    folder, hf = _saved(tmp_path, QWEN2)
    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    tensors["lm_head.weight"] = tensors.pop("model.embed_tokens.weight")
    save_file(tensors, path, metadata={"format": "pt"})
    state = _state(_ours(folder))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the tied duplicate is no unread tensor
        load_hf_weights(folder, state)
    assert torch.equal(state["hf.model.embed_tokens.weight"], hf.lm_head.weight)


def test_unknown_tensors_in_the_checkpoint_give_one_warning(tmp_path):
    folder, _ = _saved(tmp_path, GPT2)
    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    tensors.update({"extra.a": torch.ones(2), "extra.b": torch.ones(3)})
    save_file(tensors, path, metadata={"format": "pt"})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_hf_weights(folder, _state(_ours(folder)))
    messages = [str(w.message) for w in caught if "not read" in str(w.message)]
    assert len(messages) == 1 and "2 tensor(s)" in messages[0] and "extra.a" in messages[0]


def _expected_block(full: torch.Tensor, placements: tuple, coordinate: tuple[int, int]):
    """The block of ``full`` a rank at ``coordinate`` of a (2, 2) mesh holds,
    worked out with torch.chunk (plain Shard placements, applied in mesh order)."""
    from torch.distributed.tensor import Shard

    block = full
    for axis, placement in enumerate(placements):
        if isinstance(placement, Shard):
            block = block.chunk(2, dim=placement.dim)[coordinate[axis]]
    return block


@contextlib.contextmanager
def _fake_mesh(rank: int):
    """A (2, 2) DeviceMesh seen by ``rank`` (coordinate (rank // 2, rank % 2))
    on a fake process group of 4, destroyed after."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from ir.torch_compat import fake_store_type

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("fake", store=fake_store_type()(), rank=rank, world_size=4)
    try:
        yield init_device_mesh("cpu", (2, 2))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("two_d", [("S0", "S1"), ("S1", "S0"), ("R", "S1")])
def test_each_rank_reads_its_block_of_dtensor_parameters(tmp_path, two_d):
    """Rank 3 of a (2, 2) mesh, coordinate (1, 1); 1-D tensors over (S0, R)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    from ir.torch_compat import local_tensor

    folder, hf = _saved(tmp_path, QWEN2)  # before the process group: rank 0 saves
    codes = {"R": Replicate(), "S0": Shard(0), "S1": Shard(1)}
    full = _state(_ours(folder))
    with _fake_mesh(3) as mesh:
        state = {}
        for fqn, tensor in full.items():
            placements = (tuple(codes[c] for c in two_d) if tensor.dim() == 2
                          else (Shard(0), Replicate()))
            state[fqn] = distribute_tensor(torch.zeros_like(tensor), mesh, placements,
                                           src_data_rank=None)
        load_hf_weights(folder, state)
    reference = hf.state_dict()
    for fqn, value in state.items():
        assert isinstance(value, DTensor) and value.shape == reference[fqn[3:]].shape
        expected = _expected_block(reference[fqn[3:]], value.placements, (1, 1))
        assert local_tensor(value).shape == expected.shape and expected.numel() > 0
        assert torch.equal(local_tensor(value), expected), fqn


def test_uneven_and_strided_shards_read_their_rows(tmp_path):
    """On rank 2, coordinate (1, 0): of 7 rows over Shard(0) x Shard(0) it holds
    rows 4 and 5 (torch.chunk's split: 0-3 | 4-6, then 4-5 | 6); of 8 rows
    over a strided shard (FSDP over tensor parallel: tensor-parallel halves
    first, each halved by FSDP) rows 2 and 3, where plain shards would be 4, 5."""
    from torch.distributed.tensor import Shard, distribute_tensor

    from ir.torch_compat import local_tensor, strided_shard

    folder = tmp_path / "rows"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    uneven = torch.arange(7 * 3, dtype=torch.float32).reshape(7, 3)
    even = torch.arange(8 * 3, dtype=torch.float64).reshape(8, 3)
    save_file({"uneven": uneven, "strided": even}, str(folder / "model.safetensors"))
    with _fake_mesh(2) as mesh:
        state = {
            "hf.uneven": distribute_tensor(torch.zeros(7, 3), mesh, (Shard(0), Shard(0)),
                                           src_data_rank=None),
            "hf.strided": distribute_tensor(torch.zeros(8, 3), mesh,
                                            (strided_shard(0, 2), Shard(0)), src_data_rank=None),
        }
        load_hf_weights(str(folder), state)
        assert torch.equal(local_tensor(state["hf.uneven"]), uneven[4:6])
        assert torch.equal(local_tensor(state["hf.strided"]), even[2:4].float())


def test_a_checkpoint_of_another_model_is_refused_in_one_line(tmp_path):
    folder, _ = _saved(tmp_path, {**QWEN2, "vocab_size": 512})
    state = _state(_ours(_other(tmp_path)))
    with pytest.raises(CheckpointError) as err:
        load_hf_weights(folder, state)
    text = str(err.value)
    assert "\n" not in text and "hf.model.embed_tokens.weight as [512, 64]" in text
    assert "the plan's model has [256, 64]" in text and f"--model hf:{folder}" in text
    gpt2_folder, _ = _saved(tmp_path, GPT2, name="gpt2")
    with pytest.raises(CheckpointError, match=r"has no model\.embed_tokens\.weight") as err:
        load_hf_weights(gpt2_folder, state)
    assert "\n" not in str(err.value)


def _other(tmp_path) -> str:
    """A config.json folder of the 256-token Qwen2 (the plan's model)."""
    fields = dict(QWEN2)
    folder = str(tmp_path / "plan_config")
    AutoConfig.for_model(fields.pop("model_type"), **fields).save_pretrained(folder)
    return folder


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("fields, names", [(QWEN2, "first"), (QWEN2, "both"), (QWEN2, "second"),
                                            (GPT2, "first")],
                         ids=["qwen2-tied", "qwen2-state-dict", "qwen2-lm-head", "gpt2"])
def test_an_export_loads_with_from_pretrained_and_gives_the_same_logits(tmp_path, fields, names):
    """Tied weights given under their first name, both (``state_dict()``) or
    the second; each full tensor is let go before the next one is asked for."""
    source, hf = _saved(tmp_path, fields)
    ours = _ours(source)
    load_hf_weights(source, _state(ours))
    named = list(ours.state_dict().items() if names == "both" else _state(ours).items())
    if names == "second":
        named = [("hf.lm_head.weight" if n == "hf.model.embed_tokens.weight" else n, t)
                 for n, t in named]
    target = str(tmp_path / "export")
    yielded = []

    def one_at_a_time():
        for name, tensor in named:
            assert all(ref() is None for ref in yielded), "an earlier tensor is still held"
            full = tensor.detach().clone()
            yielded.append(weakref.ref(full))
            yield name, full
            del full

    written = export_hf(target, one_at_a_time(), config_source=source,
                        tied=tied_parameters(ours))
    assert sorted(os.path.basename(p) for p in written) == sorted(os.listdir(target))
    assert "model.safetensors" in os.listdir(target) and "config.json" in os.listdir(target)
    loaded, info = AutoModelForCausalLM.from_pretrained(target, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert not info["mismatched_keys"]
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    assert torch.equal(_logits(loaded.eval(), ids), _logits(hf, ids))
    with safe_open(os.path.join(target, "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert names == set(load_file(os.path.join(source, "model.safetensors")))  # tied: once
    assert json.load(open(os.path.join(target, "config.json")))["dtype"] == "float32"
    assert len(yielded) == len(named)


def test_an_export_from_a_type_spec_writes_the_config(tmp_path):
    spec = "gpt2,n_layer=2,n_embd=64,n_head=4,vocab_size=256,n_positions=64"
    ours = _ours(spec)
    target = str(tmp_path / "export")
    export_hf(target, ((n, t.detach().to(torch.bfloat16)) for n, t in _state(ours).items()),
              config_source=spec)
    config = json.load(open(os.path.join(target, "config.json")))
    assert config["n_layer"] == 2 and config["architectures"] == ["GPT2LMHeadModel"]
    assert config["dtype"] == "bfloat16"
    assert os.path.isfile(os.path.join(target, "generation_config.json"))  # GPT-2 generates
    loaded = AutoModelForCausalLM.from_pretrained(target)
    assert torch.equal(loaded.transformer.wte.weight, ours.hf.transformer.wte.weight.bfloat16())


def test_an_export_lacking_a_tensor_is_refused_and_leaves_nothing(tmp_path):
    ours = _ours(_other(tmp_path))
    state = _state(ours)
    state.pop("hf.model.norm.weight")
    target = tmp_path / "export"
    with pytest.raises(CheckpointError, match="lacks 1 tensor.*model.norm.weight"):
        export_hf(str(target), iter(state.items()), config_source=_other(tmp_path))
    assert not target.exists()


def test_an_export_never_overwrites(tmp_path):
    target = tmp_path / "export"
    target.mkdir()
    (target / "model.safetensors").write_bytes(b"precious")
    ours = _ours(_other(tmp_path))
    for export in (lambda: export_hf(str(target), iter(_state(ours).items()),
                                     config_source=_other(tmp_path)),
                   lambda: export_plain(str(target), iter(_state(ours).items())),
                   lambda: check_export_target(str(target))):
        with pytest.raises(CheckpointError, match="already holds model.safetensors") as err:
            export()
        assert "\n" not in str(err.value)
    assert os.listdir(target) == ["model.safetensors"]
    assert (target / "model.safetensors").read_bytes() == b"precious"
    with pytest.raises(CheckpointError, match="is a file"):
        check_export_target(str(target / "model.safetensors"))
    check_export_target(str(tmp_path / "new"))  # missing or empty: fine
    (tmp_path / "empty").mkdir()
    check_export_target(str(tmp_path / "empty"))


def test_a_plain_export_holds_our_names_and_a_failed_one_leaves_nothing(tmp_path):
    tensors = {"layers.0.w": torch.randn(3, 4), "layers.0.b": torch.randn(4).bfloat16(),
               "steps": torch.tensor(5), "mask": torch.tensor([True, False, True]),
               "empty": torch.zeros(0, 2), "t": torch.randn(4, 3).t()}
    target = tmp_path / "plain"
    written = export_plain(str(target), iter(tensors.items()))
    assert written == [str(target / "model.safetensors")] and os.listdir(target) == [
        "model.safetensors"]
    back = load_file(written[0])
    assert set(back) == set(tensors)
    for name, tensor in tensors.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name

    def broken():
        yield "a", torch.ones(2)
        raise RuntimeError("gather failed")

    with pytest.raises(RuntimeError, match="gather failed"):
        export_plain(str(tmp_path / "broken"), broken())
    assert not (tmp_path / "broken").exists()
