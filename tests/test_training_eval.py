"""A training run a user can judge (issue 48): ``planner data`` (text to token
folders), validation in ``planner train`` (``--eval-data``, ``--eval-every``,
``--eval-batches``) and ``loss.png``.

One multi-process case: a pipeline plan of gpt-tiny on 2 CPU ranks, trained
from a folder ``planner data`` tokenized with a Hugging Face tokenizer (made
here, offline), whose validation loss equals one process's. The bad-input
cases start no rank.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from app.cli import main as planner

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPT_TINY_VOCAB = 128


def _docs_text(folder) -> str:
    """This repository's README and design notes as one text file."""
    path = folder / "docs.txt"
    path.write_bytes(b"".join(open(os.path.join(ROOT, f), "rb").read()
                              for f in ("README.md", "docs/design.md")))
    return str(path)


@pytest.fixture(scope="module")
def pipeline_plan(tmp_path_factory):
    """gpt-tiny on local-cpu:2 as a pp=2 1F1B pipeline (batch 8 x 32)."""
    path = str(tmp_path_factory.mktemp("plan") / "pp.json")
    assert planner(["plan", "--model", "gpt-tiny", "--cluster", "local-cpu:2", "--pp", "2",
                    "--schedule", "1f1b", "-o", path, "--quiet"]) == 0
    return path


def test_data_command_writes_bytes_folder(tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_bytes(bytes(range(256)) * 4)  # 1,024 tokens: every byte value
    out = tmp_path / "data"
    assert planner(["data", str(text), str(text), "-o", str(out), "--val-fraction", "0.25"]) == 0
    assert "1,536 tokens" in capsys.readouterr().out
    assert sorted(os.listdir(out)) == ["meta.json", "train.bin", "val.bin"]
    meta = json.loads((out / "meta.json").read_text())
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == 256
    assert meta["tokenizer"] == "bytes" and meta["tokens"] == {"train": 1536, "val": 512}
    tokens = np.concatenate([np.fromfile(out / "train.bin", dtype="<u2"),
                             np.fromfile(out / "val.bin", dtype="<u2")])
    assert tokens.tolist() == list(range(256)) * 8  # the two files in order, then split


def _one_line_exit_2(capsys, args: list[str]) -> str:
    assert planner(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("planner: error: "), err
    return err[0]


def test_bad_input_is_one_line_and_writes_nothing(pipeline_plan, tmp_path, capsys):
    text = _docs_text(tmp_path)
    out = tmp_path / "out"
    broken = tmp_path / "broken_tokenizer"
    broken.mkdir()
    (broken / "tokenizer.json").write_text("{not json")
    for args, says in (([str(tmp_path / "missing.txt")], "does not exist"),
                       ([text, "--tokenizer", str(broken)], "cannot load a tokenizer"),
                       ([text, "--tokenizer", str(tmp_path / "nowhere")], "is not a folder")):
        assert says in _one_line_exit_2(capsys, ["data", *args, "-o", str(out)])
        assert not out.exists()

    tokens = tmp_path / "tokens.bin"  # bytes below gpt-tiny's vocabulary
    ascii_bytes = np.frombuffer(open(text, "rb").read(), dtype=np.uint8)
    ascii_bytes[ascii_bytes < GPT_TINY_VOCAB].astype("<u2").tofile(tokens)
    short = tmp_path / "short.bin"
    np.zeros(8 * 32, dtype="<u2").tofile(short)  # one token short of a batch
    (tmp_path / "no_meta").mkdir()
    assert planner(["data", text, "-o", str(tmp_path / "bytes")]) == 0  # vocabulary 256
    capsys.readouterr()
    logs = tmp_path / "logs"
    for args, says in (
            (["--data", str(tokens), "--eval-every", "2"], "--eval-every needs held-out tokens"),
            (["--data", str(tokens), "--eval-data", str(short)], "fewer than one batch"),
            (["--data", str(tmp_path / "no_meta")], "has no meta.json"),
            (["--data", str(tmp_path / "bytes")], "vocabulary of 256 ids, more than the "
                                                  "model's 128")):
        line = _one_line_exit_2(capsys, ["train", pipeline_plan, *args, "--log",
                                         str(logs / "log.jsonl"), "--result-json",
                                         str(logs / "r.json")])
        assert says in line, line
        assert not logs.exists()


def _hf_tokenizer(folder, text: str, vocab_size: int) -> str:
    """A byte-level BPE tokenizer trained on ``text``, saved for AutoTokenizer."""
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([open(text).read()], trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["[UNK]", "<|endoftext|>"], limit_alphabet=90))
    path = str(folder / "tokenizer")
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]",
                            eos_token="<|endoftext|>").save_pretrained(path)
    return path


@pytest.mark.multiprocess
def test_pipeline_validation_equals_one_process(pipeline_plan, tmp_path, capsys):
    """planner data with a Hugging Face tokenizer, then 4 steps of the pp=2
    plan validating every 2 steps on the folder's val.bin: the validation
    losses reach the console, the JSON log, the result and loss.png; the last
    equals one process's loss on the same batches after the same 4 steps."""
    import torch

    from models.source import build_model
    from plan.format import load_plan
    from training.data import TokenFile
    from training.reference import train_one_process

    text = _docs_text(tmp_path)
    data = tmp_path / "data"
    assert planner(["data", text, "-o", str(data), "--tokenizer",
                    _hf_tokenizer(tmp_path, text, 120)]) == 0
    assert json.loads((data / "meta.json").read_text())["vocab_size"] <= GPT_TINY_VOCAB
    log, result = tmp_path / "run" / "log.jsonl", tmp_path / "run" / "result.json"
    capsys.readouterr()
    code = planner(["train", pipeline_plan, "--data", str(data), "--steps", "4", "--lr", "1e-2",
                    "--eval-every", "2", "--eval-batches", "2", "--log-every", "4",
                    "--log", str(log), "--result-json", str(result)])
    output = capsys.readouterr()
    assert code == 0, output.err + open(str(log) + ".ranks.log").read()[-3000:]
    assert (tmp_path / "run" / "loss.png").stat().st_size > 0
    assert any(line.startswith("step 2/4") and "val_loss" in line
               for line in output.err.splitlines()), output.err
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(r["step"], r["val_loss"] is not None) for r in records] == [(1, True), (3, True)]
    run = json.loads(result.read_text())
    assert [e["step"] for e in run["val_losses"]] == [1, 3]
    assert run["final_val_loss"] == records[-1]["val_loss"]

    ref = train_one_process(load_plan(pipeline_plan), TokenFile(data / "train.bin", batch_size=8,
                                                                 seq_len=32).batch,
                            steps=4, lr=1e-2)
    assert [e["loss"] for e in run["losses"]] == pytest.approx(ref.losses, rel=1e-5)
    model, _ = build_model("gpt-tiny", device="cpu", seed=0)
    model.load_state_dict(ref.state, strict=False)
    held_out = TokenFile(data / "val.bin", batch_size=8, seq_len=32)
    with torch.no_grad():
        expected = sum(float(model(*held_out.batch(k))) for k in range(2)) / 2
    assert run["final_val_loss"] == pytest.approx(expected, rel=1e-5)
