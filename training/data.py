"""Training batches as a function of the step number.

Every batch source here is a pure function of the step index, so a job resumed at
step ``k`` sees exactly the batches an uninterrupted job would have seen:

* :class:`TokenFile`: a flat binary file of token ids (nanoGPT's ``train.bin``),
  read through a read-only ``numpy.memmap`` (never loaded whole);
* :func:`load_user_batches`: a user function ``name(step) -> batch`` named as
  ``path/to/file.py:name`` or ``package.module:name``.

:func:`write_token_file` and :func:`bytes_to_tokens` make token files; a batch
is checked against the plan's inputs by :func:`codegen.parallel_model.check_batch`.
Every :class:`DataError` message is one line: what is wrong, then what to do.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

#: The token id types a token file may hold (little-endian, as numpy writes them).
TOKEN_DTYPES = ("uint16", "uint32")
#: The target conventions: next tokens, or the tokens themselves.
TARGET_MODES = ("shifted", "same")
#: Tokens read per chunk when scanning a file for ids beyond the vocabulary.
SCAN_CHUNK_TOKENS = 4 * 1024 * 1024
#: Bytes read per chunk by :func:`bytes_to_tokens`.
TEXT_CHUNK_BYTES = 16 * 1024 * 1024


class DataError(ValueError):
    """The training data cannot feed the plan; the message says what to do."""


def _token_dtype(dtype: str) -> np.dtype:
    """The numpy dtype of a token file's ids (``uint16`` or ``uint32``)."""
    if str(dtype) not in TOKEN_DTYPES:
        raise DataError(f"token dtype '{dtype}' is not supported; give --data-dtype "
                        f"{' or '.join(TOKEN_DTYPES)}")
    return np.dtype(str(dtype))


def _check_regular_file(path: str) -> int:
    """The size of ``path`` in bytes; DataError unless it is an existing regular file."""
    if not os.path.exists(path):
        raise DataError(f"token file {path} does not exist; give the path of a token file "
                        f"(a flat array of uint16/uint32 token ids, like nanoGPT's train.bin)")
    if not os.path.isfile(path):
        raise DataError(f"token file {path} is not a regular file; give the path of a "
                        f"token file, not a directory or device")
    return os.path.getsize(path)


def _looks_like_uint32(mm: np.memmap) -> bool:
    """Whether a file read as uint16 holds uint32 ids instead.

    Little-endian uint32 ids read as uint16 put each id's high half, 0 or a few
    for any real vocabulary, at every odd position; in a true uint16 token stream
    odd and even positions look alike. Needs 256 tokens or more to judge.
    """
    head = np.asarray(mm[:SCAN_CHUNK_TOKENS]).astype(np.int64)
    low, high = head[0::2], head[1::2]
    if high.size < 128:
        return False
    return int(high.max()) < 256 and float(low.mean()) > 64.0 * float(high.mean())


def _dtype_hint(mm: np.memmap, dtype: np.dtype, vocab_size: int) -> str:
    """What to try when ids reach past the vocabulary: another dtype or tokenizer.

    A uint16 file read as uint32 joins two ids into one, far above 65,535.
    """
    if dtype == np.uint32 and int(np.asarray(mm[:SCAN_CHUNK_TOKENS]).max()) > 0xFFFF:
        return "the file looks like uint16 ids read as uint32; give --data-dtype uint16"
    return (f"check that the file was made with the model's tokenizer (vocabulary of "
            f"{vocab_size:,}) and that --data-dtype matches how it was written")


def _first_id_beyond(mm: np.memmap, vocab_size: int) -> tuple[int, int] | None:
    """``(offset, id)`` of the first token id ``>= vocab_size``, scanning in chunks."""
    for start in range(0, mm.shape[0], SCAN_CHUNK_TOKENS):
        chunk = np.asarray(mm[start:start + SCAN_CHUNK_TOKENS])
        if int(chunk.max()) >= vocab_size:
            where = int(np.argmax(chunk >= vocab_size))
            return start + where, int(chunk[where])
    return None


class TokenFile:
    """Batches of consecutive windows of a flat binary file of token ids.

    Row ``i`` of step ``k`` starts at token offset
    ``((k * batch_size + i) * seq_len) % (n_tokens - seq_len - 1)`` (the modulus is
    at least 1), so steps walk through the file in order and wrap around; the
    batch depends on ``step`` only.

    Args:
        path: the token file (``numpy.tofile`` of little-endian ids).
        batch_size: rows per batch (the plan's global batch size).
        seq_len: tokens per row.
        dtype: ``"uint16"`` or ``"uint32"``: how the ids were written.
        vocab_size: the model's vocabulary size; when given, every id in the file
            is checked to be below it (one chunked pass over the file).
        targets: ``"shifted"``: targets are the next tokens (``tokens[t + 1]``), for
            models whose forward takes ``(inputs, targets)``; ``"same"``: targets
            equal the tokens, for Hugging Face causal LMs that shift labels
            themselves.

    Raises:
        DataError: missing or non-regular file, a size that is not a multiple of
            the id size, fewer than ``batch_size * seq_len + 1`` tokens, a uint16
            file that looks like uint32 ids (every other uint16 a small high
            half, judged on the first few million tokens), or an id at or beyond
            ``vocab_size``.
    """

    def __init__(self, path: str | os.PathLike, *, batch_size: int, seq_len: int,
                 dtype: str = "uint16", vocab_size: int | None = None,
                 targets: str = "shifted") -> None:
        if batch_size < 1 or seq_len < 1:
            raise ValueError(f"batch_size and seq_len must be positive, got {batch_size} and {seq_len}")
        if targets not in TARGET_MODES:
            raise ValueError(f"targets must be one of {', '.join(TARGET_MODES)}, got '{targets}'")
        if vocab_size is not None and vocab_size < 1:
            raise ValueError(f"vocab_size must be positive, got {vocab_size}")
        self.path = os.fspath(path)
        self.batch_size = int(batch_size)
        self.seq_len = int(seq_len)
        self.targets = targets
        self.dtype = _token_dtype(dtype)
        self.n_tokens = self._check_size(_check_regular_file(self.path))
        self._mm = np.memmap(self.path, dtype=self.dtype, mode="r", shape=(self.n_tokens,))
        if self.dtype == np.uint16 and _looks_like_uint32(self._mm):
            raise DataError(f"token file {self.path} looks like uint32 ids read as uint16 (every "
                            f"other uint16 is a small high half); give --data-dtype uint32")
        if vocab_size is not None:
            self._check_vocab(int(vocab_size))
        self._span = max(self.n_tokens - self.seq_len - 1, 1)

    def _check_size(self, size_bytes: int) -> int:
        """The number of tokens in a file of ``size_bytes`` bytes; DataError if too few."""
        item = self.dtype.itemsize
        if size_bytes % item:
            other = "uint16" if self.dtype == np.uint32 else "uint32"
            raise DataError(f"token file {self.path} is {size_bytes:,} bytes, not a multiple of "
                            f"{item} ({self.dtype.name} ids); give --data-dtype {other} if it "
                            f"was written so, or rewrite the file (it may be truncated)")
        n_tokens = size_bytes // item
        need = self.batch_size * self.seq_len + 1
        if n_tokens < need:
            raise DataError(f"token file {self.path} holds {n_tokens:,} tokens, fewer than one "
                            f"batch of {self.batch_size} x {self.seq_len} + 1 = {need:,}; give a "
                            f"longer file or a smaller --batch-size/--seq-len at planning")
        return n_tokens

    def _check_vocab(self, vocab_size: int) -> None:
        """DataError naming the first id at or beyond ``vocab_size``, if any."""
        found = _first_id_beyond(self._mm, vocab_size)
        if found is not None:
            offset, value = found
            raise DataError(f"token file {self.path} holds id {value:,} at token offset "
                            f"{offset:,}, not below the model's vocabulary size {vocab_size:,}; "
                            f"{_dtype_hint(self._mm, self.dtype, vocab_size)}")

    @property
    def tokens_per_batch(self) -> int:
        """Tokens one batch feeds the model (``batch_size * seq_len``)."""
        return self.batch_size * self.seq_len

    def offsets(self, step: int) -> np.ndarray:
        """The start offset (in tokens) of each row of ``step``'s batch, int64 [batch_size]."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        rows = np.arange(self.batch_size, dtype=np.int64)
        first = (int(step) * self.batch_size) % self._span  # keeps the products small
        return ((first + rows) * self.seq_len) % self._span

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(tokens, targets)`` of ``step``, both int64 ``[batch_size, seq_len]``."""
        index = self.offsets(step)[:, None] + np.arange(self.seq_len + 1, dtype=np.int64)
        window = torch.from_numpy(self._mm[index].astype(np.int64))
        tokens = window[:, :-1].contiguous()
        if self.targets == "same":
            return tokens, tokens.clone()
        return tokens, window[:, 1:].contiguous()

    def __repr__(self) -> str:
        return (f"TokenFile({self.path!r}, {self.n_tokens:,} {self.dtype.name} tokens, "
                f"batch {self.batch_size} x {self.seq_len}, targets={self.targets})")


def _as_batch_tuple(result: Any, spec: str, step: int) -> tuple:
    """A user function's result as a tuple of tensors; DataError otherwise."""
    if isinstance(result, torch.Tensor):
        return (result,)
    if isinstance(result, (tuple, list)) and result:
        return tuple(result)
    raise DataError(f"batch function {spec} returned {type(result).__name__} for step {step}; "
                    f"make it return a tensor or a tuple of tensors (the model's inputs)")


def load_user_batches(spec: str) -> Callable[[int], tuple]:
    """The batch function named by ``spec``, returning a tuple for every step.

    Args:
        spec: ``path/to/file.py:name`` or ``package.module:name``, naming a function
            ``name(step: int)`` that returns the batch of that step (a tuple of
            tensors, or one tensor, which is wrapped in a 1-tuple).

    Raises:
        DataError: a malformed spec, a missing file, an import that fails, or a
            name that is not callable (one line each).
    """
    from models.source import ModelSourceError, _load_factory

    target, _, attr = spec.rpartition(":")
    if not target or not attr:
        raise DataError(f"batch spec '{spec}' is not PATH.py:FUNCTION or package.module:FUNCTION; "
                        f"name a function step -> batch")
    if target.endswith(".py") and not os.path.isfile(target):
        raise DataError(f"batch file {target} does not exist; give PATH.py:FUNCTION with an "
                        f"existing file")
    try:
        fn = _load_factory(spec)
    except ModelSourceError as err:
        message = str(err).replace("callable factory", "callable batch function")
        raise DataError(f"batch spec {spec}: {message}; name a function step -> batch") from None

    def batch(step: int) -> tuple:
        return _as_batch_tuple(fn(step), spec, step)

    batch.__name__ = getattr(fn, "__name__", attr)
    batch.__doc__ = getattr(fn, "__doc__", None)
    return batch


def write_token_file(path: str | os.PathLike, tokens: Any, dtype: str = "uint16") -> int:
    """Write ``tokens`` (array-like of ids) as a flat ``dtype`` token file; return the count.

    Raises:
        ValueError: an id that does not fit ``dtype`` (negative or too large).
    """
    np_dtype = _token_dtype(dtype)
    ids = np.asarray(tokens).reshape(-1)
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) > np.iinfo(np_dtype).max):
        raise ValueError(f"token ids span {int(ids.min())}..{int(ids.max())}, which does not fit "
                         f"{np_dtype.name}; use uint32 for vocabularies over 65,536")
    ids.astype(np_dtype).tofile(os.fspath(path))
    return int(ids.size)


def bytes_to_tokens(text_path: str | os.PathLike, out_path: str | os.PathLike) -> int:
    """Encode any file's bytes as token ids 0..255 (uint16) into a token file.

    The simplest real-text tokenizer (vocabulary 256). Reads and writes in chunks
    of :data:`TEXT_CHUNK_BYTES`; returns the number of tokens written.
    """
    count = 0
    with open(text_path, "rb") as src, open(out_path, "wb") as dst:
        while chunk := src.read(TEXT_CHUNK_BYTES):
            np.frombuffer(chunk, dtype=np.uint8).astype(np.uint16).tofile(dst)
            count += len(chunk)
    return count
