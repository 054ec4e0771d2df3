"""The training layer's data, learning-rate schedule and progress log
(training/data.py, training/lr_schedule.py, training/progress_log.py)."""

from __future__ import annotations

import json
import math
import textwrap

import numpy as np
import re

import pytest
import torch

from training.data import (DataError, TokenFile, bytes_to_tokens,
                           load_user_batches, write_token_file)
from training.lr_schedule import warmup_cosine
from training.progress_log import LOG_KEYS, TrainingLog


def _token_file(tmp_path, n: int = 1000, dtype: str = "uint16", high: int = 500, seed: int = 0):
    ids = np.random.default_rng(seed).integers(0, high, size=n)
    path = tmp_path / f"tokens_{dtype}.bin"
    assert write_token_file(path, ids, dtype) == n
    return path, ids


def _expected(ids: np.ndarray, step: int, batch_size: int, seq_len: int):
    span = len(ids) - seq_len - 1
    starts = [((step * batch_size + i) * seq_len) % span for i in range(batch_size)]
    tokens = np.stack([ids[s:s + seq_len] for s in starts])
    targets = np.stack([ids[s + 1:s + seq_len + 1] for s in starts])
    return tokens, targets


def _one_line_error(match: str, fn, *args, **kwargs) -> str:
    with pytest.raises(DataError, match=match) as info:
        fn(*args, **kwargs)
    message = str(info.value)
    assert "\n" not in message and ";" in message  # what is wrong; what to do
    return message


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_windows_and_shift_match_numpy(tmp_path, dtype):
    high = 70_000 if dtype == "uint32" else 500
    path, ids = _token_file(tmp_path, n=1000, dtype=dtype, high=high)
    data = TokenFile(path, batch_size=4, seq_len=16, dtype=dtype, vocab_size=high)
    assert data.n_tokens == 1000 and data.tokens_per_batch == 64
    for step in (0, 1, 7, 15, 16, 123):  # 15, 16: wrap around the end of the file
        tokens, targets = data.batch(step)
        assert tokens.dtype == targets.dtype == torch.int64
        assert tokens.shape == targets.shape == (4, 16)
        want_tokens, want_targets = _expected(ids, step, 4, 16)
        np.testing.assert_array_equal(tokens.numpy(), want_tokens)
        np.testing.assert_array_equal(targets.numpy(), want_targets)
        assert torch.equal(tokens[:, 1:], targets[:, :-1])


def test_consecutive_steps_walk_through_the_file(tmp_path):
    path, ids = _token_file(tmp_path, n=10_000)
    data = TokenFile(path, batch_size=2, seq_len=8)
    rows = torch.cat([data.batch(step)[0] for step in range(3)]).reshape(-1)
    np.testing.assert_array_equal(rows.numpy(), ids[:48])


def test_same_step_same_batch_after_reopening(tmp_path):
    path, _ = _token_file(tmp_path)
    first = TokenFile(path, batch_size=3, seq_len=10).batch(42)
    again = TokenFile(path, batch_size=3, seq_len=10)
    again.batch(0)
    second = again.batch(42)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    assert not torch.equal(first[0], again.batch(43)[0])


def test_same_targets_equal_tokens(tmp_path):
    path, ids = _token_file(tmp_path)
    tokens, targets = TokenFile(path, batch_size=2, seq_len=12, targets="same").batch(5)
    assert torch.equal(tokens, targets)
    assert tokens.data_ptr() != targets.data_ptr()  # a model may edit its labels
    np.testing.assert_array_equal(tokens.numpy(), _expected(ids, 5, 2, 12)[0])


def test_smallest_file_single_row(tmp_path):
    path, ids = _token_file(tmp_path, n=9)
    tokens, targets = TokenFile(path, batch_size=1, seq_len=8).batch(3)
    np.testing.assert_array_equal(tokens[0].numpy(), ids[:8])
    np.testing.assert_array_equal(targets[0].numpy(), ids[1:9])


def test_too_short_file(tmp_path):
    path, _ = _token_file(tmp_path, n=1024)
    message = _one_line_error("fewer than one batch", TokenFile, path, batch_size=8, seq_len=128)
    assert "1,024 tokens" in message and "8 x 128 + 1 = 1,025" in message
    assert "--batch-size/--seq-len" in message


def test_empty_file_is_too_short(tmp_path):
    path = tmp_path / "empty.bin"
    path.write_bytes(b"")
    _one_line_error("holds 0 tokens", TokenFile, path, batch_size=1, seq_len=4)


def test_ids_beyond_vocab_name_offset_and_value(tmp_path, monkeypatch):
    import training.data as data_mod

    monkeypatch.setattr(data_mod, "SCAN_CHUNK_TOKENS", 64)  # offending id in a later chunk
    ids = np.arange(1000) % 100
    ids[700] = 150
    ids[900] = 999
    path = tmp_path / "tok.bin"
    write_token_file(path, ids)
    message = _one_line_error("beyond|not below", TokenFile, path, batch_size=2, seq_len=8,
                              vocab_size=100)
    assert "id 150 at token offset 700" in message and "100" in message
    assert "tokenizer" in message
    TokenFile(path, batch_size=2, seq_len=8, vocab_size=1000)  # large enough: fine


@pytest.mark.parametrize("high", [50_257, 128_256])  # GPT-2 and Llama-3 vocabularies
def test_uint32_read_as_uint16_is_refused(tmp_path, high):
    path, _ = _token_file(tmp_path, n=1000, dtype="uint32", high=high)
    message = _one_line_error("looks like uint32", TokenFile, path, batch_size=2, seq_len=8,
                              dtype="uint16")
    assert "--data-dtype uint32" in message
    TokenFile(path, batch_size=2, seq_len=8, dtype="uint32", vocab_size=high)


def test_byte_text_as_uint16_is_not_mistaken_for_uint32(tmp_path):
    path, _ = _token_file(tmp_path, n=1000, dtype="uint16", high=256)
    TokenFile(path, batch_size=2, seq_len=8, vocab_size=256)
    zeros = tmp_path / "zeros.bin"
    write_token_file(zeros, np.zeros(1000, dtype=np.int64))
    TokenFile(zeros, batch_size=2, seq_len=8)


def test_uint16_read_as_uint32_suggests_dtype(tmp_path):
    path, _ = _token_file(tmp_path, n=1000, dtype="uint16", high=50_000)
    message = _one_line_error("not below", TokenFile, path, batch_size=2, seq_len=8,
                              dtype="uint32", vocab_size=50_257)
    assert "--data-dtype uint16" in message


def test_size_not_a_multiple_of_item_size(tmp_path):
    path = tmp_path / "odd.bin"
    path.write_bytes(b"\x01\x00" * 100 + b"\x02")
    message = _one_line_error("not a multiple of 2", TokenFile, path, batch_size=2, seq_len=8)
    assert "201 bytes" in message
    path.write_bytes(b"\x01\x00" * 101)
    _one_line_error("not a multiple of 4", TokenFile, path, batch_size=2, seq_len=8, dtype="uint32")


def test_missing_file_and_directory(tmp_path):
    _one_line_error("does not exist", TokenFile, tmp_path / "nope.bin", batch_size=2, seq_len=8)
    _one_line_error("not a regular file", TokenFile, tmp_path, batch_size=2, seq_len=8)


def test_bad_arguments(tmp_path):
    path, _ = _token_file(tmp_path)
    _one_line_error("dtype 'int8'", TokenFile, path, batch_size=2, seq_len=8, dtype="int8")
    with pytest.raises(ValueError, match="targets"):
        TokenFile(path, batch_size=2, seq_len=8, targets="next")
    with pytest.raises(ValueError, match="positive"):
        TokenFile(path, batch_size=0, seq_len=8)
    with pytest.raises(ValueError, match="step"):
        TokenFile(path, batch_size=2, seq_len=8).batch(-1)
    with pytest.raises(ValueError, match="does not fit uint16"):
        write_token_file(tmp_path / "big.bin", [1, 70_000], "uint16")


def test_bytes_to_tokens(tmp_path):
    text = "hello, world\nünïcode bytes\n" * 20
    src = tmp_path / "text.txt"
    src.write_text(text, encoding="utf-8")
    raw = text.encode("utf-8")
    assert bytes_to_tokens(src, tmp_path / "text.bin") == len(raw)
    data = TokenFile(tmp_path / "text.bin", batch_size=2, seq_len=16, vocab_size=256)
    tokens, targets = data.batch(0)
    assert bytes(tokens[0].tolist()) == raw[:16] and bytes(targets[1].tolist()) == raw[17:33]


def test_user_batches_from_file(tmp_path):
    src = tmp_path / "my_batches.py"
    src.write_text(textwrap.dedent("""
        import torch

        def batches(step):
            g = torch.Generator().manual_seed(step)
            x = torch.randint(0, 10, (2, 4), generator=g)
            return x, x + 1

        def single(step):
            return torch.full((3,), step)

        def broken(step):
            return "not a batch"

        NOT_CALLABLE = 3
    """))
    fn = load_user_batches(f"{src}:batches")
    x, y = fn(5)
    assert torch.equal(y, x + 1) and torch.equal(fn(5)[0], x)
    (one,) = load_user_batches(f"{src}:single")(7)
    assert torch.equal(one, torch.full((3,), 7))
    _one_line_error("returned str", load_user_batches(f"{src}:broken"), 0)
    _one_line_error("not a callable", load_user_batches, f"{src}:NOT_CALLABLE")
    _one_line_error("not a callable", load_user_batches, f"{src}:missing")


def test_user_batches_errors(tmp_path):
    _one_line_error("does not exist", load_user_batches, f"{tmp_path}/absent.py:batches")
    _one_line_error("not PATH.py:FUNCTION", load_user_batches, "no_colon_here")
    _one_line_error("cannot import", load_user_batches, "no_such_package_xyz.mod:batches")
    bad = tmp_path / "bad_batches.py"
    bad.write_text("raise RuntimeError('boom')\n")
    message = _one_line_error("importing", load_user_batches, f"{bad}:batches")
    assert "boom" in message


def test_user_batches_from_module():
    fn = load_user_batches("numpy:ones")  # any importable callable; returns an array
    with pytest.raises(DataError, match="returned ndarray"):
        fn(2)


def test_check_batch():
    """A batch of another count, shape or dtype than the plan's inputs is one line."""
    from codegen.parallel_model import BatchShapeError, InputSpec, check_batch

    batch = (torch.zeros(2, 8, dtype=torch.long), torch.ones(2, 8, dtype=torch.long))
    specs = [InputSpec.of(t) for t in batch]
    check_batch(batch, specs)
    for bad, words in (((batch[0], torch.zeros(2, 9)), "batch input 1 is [2, 9] torch.float32"),
                       ((batch[0].int(), batch[1]), "batch input 0 is [2, 8] torch.int32"),
                       ((batch[0],), "takes 2 inputs"),
                       (([1, 2], batch[1]), "batch input 0 is a list")):
        with pytest.raises(BatchShapeError, match=re.escape(words)) as err:
            check_batch(bad, specs)
        assert "\n" not in str(err.value)


def _optimizer(lr: float = 1.0):
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)


def _lrs(scheduler, steps: int) -> list[float]:
    lrs = []
    for _ in range(steps):
        lrs.append(scheduler.get_last_lr()[0])
        scheduler.optimizer.step()
        scheduler.step()
    return lrs


def test_warmup_cosine_values():
    lr, warmup, total, floor = 3e-4, 10, 110, 0.1
    lrs = _lrs(warmup_cosine(_optimizer(lr), warmup_steps=warmup, total_steps=total,
                             min_lr_ratio=floor), 130)
    assert lrs[0] == pytest.approx(lr / warmup)
    assert lrs[4] == pytest.approx(lr * 5 / warmup)
    assert lrs[warmup - 1] == pytest.approx(lr)
    assert lrs[warmup] == pytest.approx(lr)
    mid = warmup + (total - warmup) // 2
    assert lrs[mid] == pytest.approx(lr * (floor + (1 - floor) / 2))
    quarter = warmup + (total - warmup) // 4
    assert lrs[quarter] == pytest.approx(lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi / 4))))
    assert lrs[total] == pytest.approx(lr * floor)
    assert lrs[total - 1] > lr * floor
    assert all(v == pytest.approx(lr * floor) for v in lrs[total:])
    assert all(a >= b for a, b in zip(lrs[warmup:], lrs[warmup + 1:]))


def test_warmup_zero_starts_at_full_lr():
    lrs = _lrs(warmup_cosine(_optimizer(2.0), warmup_steps=0, total_steps=4, min_lr_ratio=0.0), 6)
    assert lrs == pytest.approx([2.0, 2.0 * (1 + math.cos(math.pi / 4)) / 2, 1.0,
                                 2.0 * (1 + math.cos(3 * math.pi / 4)) / 2, 0.0, 0.0])


def test_warmup_cosine_validates():
    for kwargs, match in [({"warmup_steps": 5, "total_steps": 0}, "total_steps"),
                          ({"warmup_steps": -1, "total_steps": 10}, "warmup_steps"),
                          ({"warmup_steps": 11, "total_steps": 10}, "warmup_steps"),
                          ({"warmup_steps": 1, "total_steps": 10, "min_lr_ratio": 1.5}, "min_lr_ratio")]:
        with pytest.raises(ValueError, match=match):
            warmup_cosine(_optimizer(), **kwargs)


def test_warmup_cosine_state_dict_round_trip():
    full = warmup_cosine(_optimizer(1.0), warmup_steps=5, total_steps=50)
    _lrs(full, 23)
    state = full.state_dict()
    # the resumed job builds its schedule anew (even with other arguments) and loads the state
    resumed = warmup_cosine(_optimizer(1.0), warmup_steps=1, total_steps=7, min_lr_ratio=0.5)
    resumed.load_state_dict(state)
    assert resumed.last_epoch == 23
    assert _lrs(resumed, 30) == pytest.approx(_lrs(full, 30))


def test_training_log_json_lines_and_mfu(tmp_path, capsys):
    path = tmp_path / "logs" / "train.jsonl"
    kwargs = dict(log_every=10, total_steps=25, tokens_per_step=4096,
                  flops_per_step=2e12, peak_flops=1e14, console=False)
    with TrainingLog(path, start_step=0, **kwargs) as log:
        for step in range(12):
            log.log(step, torch.tensor(3.5 - step / 10), 3e-4, 0.5,
                    grad_norm=1.25 if step == 9 else None)
    with TrainingLog(path, start_step=12, **kwargs) as log:  # resumed: appends
        logged = [log.log(step, float("nan") if step == 24 else 2.0, 1e-4, 0.25)
                  for step in range(12, 25)]
    assert [r is not None for r in logged] == [s in (19, 24) for s in range(12, 25)]
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in records] == [9, 19, 24]
    assert all(tuple(r) == LOG_KEYS for r in records)
    first = records[0]
    assert first["loss"] == pytest.approx(2.6) and first["lr"] == 3e-4
    assert first["step_s"] == 0.5 and first["tokens_per_s"] == pytest.approx(8192)
    assert first["mfu"] == pytest.approx(2e12 / 0.5 / 1e14)  # 4 %
    assert first["grad_norm"] == 1.25 and records[1]["grad_norm"] is None
    assert records[1]["mfu"] == pytest.approx(0.08)
    assert records[2]["loss"] is None  # NaN: strict JSON
    assert capsys.readouterr().err == ""  # console=False prints nothing


def test_training_log_plain_console_line(tmp_path, capsys):
    with TrainingLog(None, log_every=5, total_steps=200, tokens_per_step=617,
                     console=True) as log:
        assert log.log(3, 3.0, 3e-4, 0.5) is None
        record = log.log(9, 3.21449, 3e-4, 0.5)
    assert record["mfu"] is None  # FLOPs unknown
    err = capsys.readouterr().err.splitlines()
    assert err == ["step 10/200  loss 3.2145  lr 3.0e-04  1,234 tok/s"]
    with TrainingLog(None, log_every=100, total_steps=3, tokens_per_step=1, flops_per_step=5e9,
                     peak_flops=1e12, console=True) as log:
        log.log(2, 1.0, 1e-3, 1.0)  # the last step is always logged
    assert capsys.readouterr().err.strip().endswith("MFU 0.5%")


def test_training_log_progress_bar_on_a_terminal(tmp_path, monkeypatch, capsys):
    import sys

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    path = tmp_path / "train.jsonl"
    with TrainingLog(path, log_every=2, total_steps=6, start_step=2, tokens_per_step=8,
                     console=True) as log:
        assert log._progress is not None
        for step in range(2, 6):
            log.log(step, 1.0 / (step + 1), 1e-3, 0.01)
        task = log._progress.tasks[0]
        assert task.completed == 6 and "loss 0.1667" in task.fields["status"]
    assert log._progress is None
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [3, 5]
