"""Token folders from text: ``planner data`` writes them, ``planner train --data DIR`` reads them.

A data folder holds three files:

* ``train.bin`` and ``val.bin``: flat little-endian token ids, as
  :class:`training.data.TokenFile` reads them (nanoGPT's format);
* ``meta.json``: ``dtype`` (``uint16``, or ``uint32`` for vocabularies over
  65,536), ``vocab_size`` (token ids are below it), ``tokenizer`` (``"bytes"``
  or the tokenizer folder's absolute path), ``tokenizer_class``, ``tokens``
  (``{"train": N, "val": M}``, in tokens), ``val_fraction``, ``eos_token_id``
  and ``sources`` (the text files, in order). It is written last: a folder
  without it is never read.

The text files are tokenized in the order given and joined (with the
tokenizer's end-of-text token after each file, where it has one); the last
``val_fraction`` of the tokens is ``val.bin``, the rest ``train.bin``. Without
a tokenizer every byte is a token (vocabulary 256); with one, it is a Hugging
Face tokenizer loaded by ``transformers.AutoTokenizer`` from a local folder,
never from the network.

:func:`data_source` reads the flags of ``planner train`` that name data
(``--data``, ``--eval-data``, ``--eval-every``). Every refusal is a
:class:`training.data.DataError` of one line, raised before anything is written.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import numpy as np

from training.data import TEXT_CHUNK_BYTES, DataError

__all__ = ["BYTES", "DataFolder", "DataSource", "data_source", "load_tokenizer",
           "read_data_folder", "write_data_folder"]

META, TRAIN, VAL = "meta.json", "train.bin", "val.bin"
#: The ``tokenizer`` of a folder whose tokens are the text's bytes.
BYTES = "bytes"
BYTES_VOCAB = 256
#: The format of meta.json this module writes.
FORMAT_VERSION = 1


@dataclass(frozen=True)
class DataFolder:
    """A folder ``planner data`` wrote (its meta.json's fields)."""

    path: str
    dtype: str  # "uint16" or "uint32"
    vocab_size: int  # every token id is below it
    tokenizer: str  # "bytes" or the tokenizer folder's absolute path
    tokens: dict[str, int]  # {"train": N, "val": M}, in tokens

    @property
    def train(self) -> str:
        return os.path.join(self.path, TRAIN)

    @property
    def val(self) -> str:
        return os.path.join(self.path, VAL)


def read_data_folder(path: str | os.PathLike) -> DataFolder:
    """The data folder at ``path``; DataError (one line) without a readable meta.json."""
    path = os.fspath(path)
    meta_path = os.path.join(path, META)
    if not os.path.isfile(meta_path):
        raise DataError(f"data folder {path} has no {META}; make it with `planner data TEXT_FILES "
                        f"-o {path}`, or give --data a token file")
    try:
        with open(meta_path) as f:
            meta = json.load(f)
        folder = DataFolder(path, str(meta["dtype"]), int(meta["vocab_size"]),
                            str(meta["tokenizer"]),
                            {k: int(v) for k, v in meta["tokens"].items()})
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise DataError(f"{meta_path} is not a `planner data` meta.json ({type(err).__name__}: "
                        f"{str(err).splitlines()[0] if str(err) else ''}); make the folder "
                        f"again with `planner data`") from None
    if folder.dtype not in ("uint16", "uint32"):
        raise DataError(f"{meta_path} gives dtype '{folder.dtype}'; make the folder again with "
                        f"`planner data`")
    return folder


# ------------------------------------------------------------ planner train's flags
@dataclass(frozen=True)
class DataSource:
    """Where ``planner train``'s batches come from (:func:`data_source`)."""

    train: str | None  # a token file, FILE.py:FUNCTION, or None (the plan's example batch)
    dtype: str  # token id type of ``train``
    vocab_size: int | None  # the data folders' vocabulary (None for token files)
    held_out: str | None  # the validation token file, or None (no validation)
    held_out_dtype: str  # its token id type
    held_out_flag: str  # how the user named ``held_out``, for messages


def data_source(data: str | None, data_dtype: str, eval_data: str | None,
                eval_every: int | None) -> DataSource:
    """Resolve ``--data``, ``--data-dtype``, ``--eval-data`` and ``--eval-every``.

    ``--data DIR`` (a folder) reads DIR/train.bin with meta.json's dtype and
    vocabulary. ``--eval-data`` is a token file (of the training data's dtype)
    or a data folder (its val.bin). ``--eval-every`` without ``--eval-data``
    validates on DIR/val.bin of ``--data DIR``, and is refused otherwise.
    """
    train, dtype, vocab = data, data_dtype, None
    folder = None
    if data is not None and os.path.isdir(data):
        folder = read_data_folder(data)
        train, dtype, vocab = folder.train, folder.dtype, folder.vocab_size
    held_out, held_dtype, flag = None, dtype, "--eval-data"
    if eval_data is not None:
        held_out, flag = eval_data, f"--eval-data {eval_data}"
        if os.path.isdir(eval_data):
            given = read_data_folder(eval_data)
            held_out, held_dtype = given.val, given.dtype
            vocab = max(vocab or 0, given.vocab_size)
    elif eval_every is not None:
        if folder is None:
            raise DataError("--eval-every needs held-out tokens: give --eval-data FILE, or "
                            "--data DIR made by `planner data` (its val.bin is used)")
        held_out, flag = folder.val, f"val.bin of --data {data}"
    return DataSource(train, dtype, vocab, held_out, held_dtype, flag)


# ------------------------------------------------------------ tokenizers
@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """transformers' warnings off (a long text is no model input here), offline."""
    from transformers.utils import logging

    level = logging.get_verbosity()
    offline = os.environ.get("HF_HUB_OFFLINE")
    logging.set_verbosity_error()
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        yield
    finally:
        logging.set_verbosity(level)
        if offline is None:
            os.environ.pop("HF_HUB_OFFLINE", None)
        else:
            os.environ["HF_HUB_OFFLINE"] = offline


#: Files of which a tokenizer folder holds at least one.
_TOKENIZER_FILES = {"tokenizer.json", "tokenizer_config.json", "vocab.json", "vocab.txt",
                    "tokenizer.model", "spiece.model", "sentencepiece.bpe.model"}


def load_tokenizer(folder: str | os.PathLike) -> Any:
    """A Hugging Face tokenizer from a local folder (``save_pretrained``'s
    files); DataError, one line, when it cannot be loaded."""
    folder = os.fspath(folder)
    if not os.path.isdir(folder):
        raise DataError(f"--tokenizer {folder} is not a folder; give a local folder a Hugging "
                        f"Face tokenizer was saved to (tokenizer.json, tokenizer_config.json)")
    if not set(os.listdir(folder)) & _TOKENIZER_FILES:
        raise DataError(f"--tokenizer {folder} holds no tokenizer files (tokenizer.json, "
                        f"tokenizer_config.json, vocab.json, tokenizer.model, ...); give a "
                        f"folder a Hugging Face tokenizer was saved to")
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise DataError("--tokenizer needs transformers: pip install -e '.[hf]'") from None
    try:
        with _quiet_transformers():
            return AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except Exception as err:  # noqa: BLE001 - transformers raises many kinds
        text = str(err).strip().splitlines()
        raise DataError(f"cannot load a tokenizer from {folder}: {type(err).__name__}: "
                        f"{text[0] if text else ''}; give a folder a Hugging Face tokenizer "
                        f"was saved to") from None


def _vocab_of(tokenizer: Any) -> int:
    """Token ids a tokenizer gives are below this (added tokens included)."""
    return BYTES_VOCAB if tokenizer is None else int(len(tokenizer))


def _text_chunks(path: str) -> Iterator[str]:
    """``path`` as UTF-8 text, in whole lines of about :data:`TEXT_CHUNK_BYTES`."""
    lines: list[str] = []
    size = 0
    try:
        with open(path, encoding="utf-8", newline="") as f:
            for line in f:
                lines.append(line)
                size += len(line)
                if size >= TEXT_CHUNK_BYTES:
                    yield "".join(lines)
                    lines, size = [], 0
    except UnicodeDecodeError as err:
        raise DataError(f"{path} is not UTF-8 text ({err.reason} at byte {err.start:,} of a "
                        f"chunk); give text files, or leave out --tokenizer to read bytes") from None
    if lines:
        yield "".join(lines)


def _token_chunks(path: str, tokenizer: Any) -> Iterator[np.ndarray]:
    """The token ids of one text file, chunk by chunk (int64 arrays)."""
    if tokenizer is None:
        with open(path, "rb") as f:
            while chunk := f.read(TEXT_CHUNK_BYTES):
                yield np.frombuffer(chunk, dtype=np.uint8).astype(np.int64)
        return
    with _quiet_transformers():
        for text in _text_chunks(path):
            yield np.asarray(tokenizer.encode(text, add_special_tokens=False), dtype=np.int64)
    if tokenizer.eos_token_id is not None:
        yield np.asarray([tokenizer.eos_token_id], dtype=np.int64)


# ------------------------------------------------------------ planner data
def _check_request(texts: Sequence[str], out: str, val_fraction: float) -> None:
    """Refuse, before anything is written: missing texts, a bad fraction, an
    output that is a file or a folder holding other files."""
    if not texts:
        raise DataError("give at least one text file")
    for path in texts:
        if not os.path.isfile(path):
            raise DataError(f"text file {path} does not exist or is not a file")
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"--val-fraction must be in [0, 1), got {val_fraction}")
    if os.path.exists(out) and not os.path.isdir(out):
        raise DataError(f"-o {out} is a file; give a folder (new, empty or an earlier "
                        f"`planner data` output)")
    if os.path.isdir(out):
        others = sorted(set(os.listdir(out)) - {META, TRAIN, VAL})
        if others:
            raise DataError(f"-o {out} holds other files ({others[0]}, ...); give a new or empty "
                            f"folder, or an earlier `planner data` output")


def _write_tokens(texts: Sequence[str], tokenizer: Any, dtype: str, path: str) -> int:
    """Every text's tokens, in order, into the flat token file ``path``; the count."""
    count = 0
    with open(path, "wb") as dst:
        for text in texts:
            for ids in _token_chunks(text, tokenizer):
                ids.astype(dtype).tofile(dst)
                count += int(ids.size)
    return count


def _split_tail(path: str, val_path: str, n_tokens: int, n_val: int, dtype: str) -> None:
    """Move the last ``n_val`` tokens of the token file ``path`` into ``val_path``."""
    item = np.dtype(dtype).itemsize
    if n_val:
        tail = np.memmap(path, dtype=dtype, mode="r", offset=(n_tokens - n_val) * item,
                         shape=(n_val,))
        np.asarray(tail).tofile(val_path)
        del tail
    else:
        open(val_path, "wb").close()
    os.truncate(path, (n_tokens - n_val) * item)


def write_data_folder(texts: Sequence[str | os.PathLike], out: str | os.PathLike, *,
                      tokenizer: str | os.PathLike | None = None,
                      val_fraction: float = 0.1) -> DataFolder:
    """Tokenize ``texts`` into the data folder ``out`` (module docstring).

    Args:
        texts: text files, joined in this order.
        out: the folder: new, empty, or an earlier output (its files are replaced).
        tokenizer: a local Hugging Face tokenizer folder; None: bytes (vocabulary 256).
        val_fraction: the fraction of the tokens (the last ones) written to val.bin.

    Raises:
        DataError: a missing text file, a fraction outside [0, 1), an ``out``
            holding other files, a tokenizer that cannot be loaded, text that is
            not UTF-8 (with a tokenizer), or no tokens at all. Nothing is left
            written.
    """
    texts, out = [os.fspath(t) for t in texts], os.fspath(out)
    _check_request(texts, out, val_fraction)
    tok = load_tokenizer(tokenizer) if tokenizer is not None else None
    vocab = _vocab_of(tok)
    dtype = "uint16" if vocab <= 1 << 16 else "uint32"
    created = not os.path.isdir(out)
    os.makedirs(out, exist_ok=True)
    tmp_train, tmp_val = os.path.join(out, ".train.bin.tmp"), os.path.join(out, ".val.bin.tmp")
    try:
        n_tokens = _write_tokens(texts, tok, dtype, tmp_train)
        if n_tokens == 0:
            raise DataError(f"the text files hold no tokens ({', '.join(texts)})")
        n_val = int(n_tokens * val_fraction)
        _split_tail(tmp_train, tmp_val, n_tokens, n_val, dtype)
    except BaseException:
        for path in (tmp_train, tmp_val):
            with contextlib.suppress(OSError):
                os.remove(path)
        if created:
            with contextlib.suppress(OSError):
                os.rmdir(out)
        raise
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(out, META))  # an earlier output is incomplete until the end
    os.replace(tmp_train, os.path.join(out, TRAIN))
    os.replace(tmp_val, os.path.join(out, VAL))
    name = BYTES if tok is None else os.path.abspath(os.fspath(tokenizer))
    meta = {"format": FORMAT_VERSION, "dtype": dtype, "vocab_size": vocab, "tokenizer": name,
            "tokenizer_class": None if tok is None else type(tok).__name__,
            "eos_token_id": None if tok is None else tok.eos_token_id,
            "tokens": {"train": n_tokens - n_val, "val": n_val},
            "val_fraction": val_fraction, "sources": [os.path.abspath(t) for t in texts]}
    with open(os.path.join(out, META), "w") as f:
        json.dump(meta, f, indent=1)
    return DataFolder(out, dtype, vocab, name, dict(meta["tokens"]))
