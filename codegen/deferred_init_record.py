"""The record of a deferred build: :class:`InitRecord`, its log of ATen ops on
meta tensors, and the replay that materialises any of its tensors on a real
device, bit for bit as the build on that device gives (made by
:func:`codegen.deferred_init.record_build`; the log's entries:
:mod:`codegen.deferred_init_log`).
"""

from __future__ import annotations

import bisect
import contextlib
import heapq
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from codegen.deferred_init_log import (
    TARGET_DEVICE, AliasEntry, ConstArg, DeferredInitError, LayoutArg, LogEntry, MetaRef,
    RecordedOp, Signature, op_name, signature_of, version_of,
)
from ir.torch_compat import storage_key, tree_flatten, tree_map, tree_unflatten

__all__ = ["InitRecord"]


@contextlib.contextmanager
def _generator_states() -> Iterator[Callable[[torch.Generator, torch.Tensor], None]]:
    """Yields ``set(generator, state)``; every generator it set gets back, on
    exit, the state it had before its first set."""
    saved: dict[int, tuple[torch.Generator, torch.Tensor]] = {}

    def set_state(gen: torch.Generator, state: torch.Tensor) -> None:
        if id(gen) not in saved:
            saved[id(gen)] = (gen, gen.get_state())
        gen.set_state(state)

    try:
        yield set_state
    finally:
        for gen, state in saved.values():
            gen.set_state(state)


# ----------------------------------------------------------------------- record


@dataclass(eq=False)
class InitRecord:
    """The ATen ops a build ran on meta tensors, replayable on ``device``.

    Made by :func:`codegen.deferred_init.record_build`; read with
    :meth:`materialize` and :meth:`materialize_tree`. ``last_replayed_ops`` is
    how many log entries the last materialisation replayed (ops and alias
    records), ``last_peak_bytes`` the most bytes of real storage it held
    between two ops.
    """

    device: torch.device
    generator: torch.Generator
    last_replayed_ops: int = 0
    last_peak_bytes: int = 0
    _entries: list[LogEntry] = field(default_factory=list, repr=False)
    _by_storage: dict[int, list[int]] = field(default_factory=dict, repr=False)
    _tensors: list[torch.Tensor] = field(default_factory=list, repr=False)
    _signatures: list[Signature] = field(default_factory=list, repr=False)
    _vid: dict[int, int] = field(default_factory=dict, repr=False)
    _latest: dict[int, int] = field(default_factory=dict, repr=False)
    _by_signature: dict[Signature, int] = field(default_factory=dict, repr=False)
    # every storage a value had, kept alive so that no storage key is reused
    _storages: dict[int, torch.UntypedStorage] = field(default_factory=dict, repr=False)

    def __len__(self) -> int:
        """Log entries recorded (ATen ops and alias records)."""
        return len(self._entries)

    # ------------------------------------------------------------ public reads

    def materialize(self, t: torch.Tensor) -> torch.Tensor:
        """The final value of meta tensor ``t`` (a parameter, buffer or input the
        recorded build made; a ``Parameter`` is read through the tensor it
        wraps) as a new real tensor on the record's device: same shape and
        dtype, the device build's strides, no autograd history. Equal bit for
        bit to what the build on the device gives. The device's generator
        ends in the state it had.

        Raises:
            DeferredInitError: ``t`` is no meta tensor of this record, or a
                constant it depends on changed after the build used it.
        """
        if not isinstance(t, torch.Tensor) or not t.is_meta:
            raise DeferredInitError(f"materialize takes a meta tensor, got "
                                    f"{type(t).__name__} on {getattr(t, 'device', '-')}")
        return self._replay([self._target(t)], len(self._entries))[0]

    def materialize_tree(self, tree: Any) -> Any:
        """``tree`` (a pytree: tuple, list, dict) with every meta tensor replaced
        by :meth:`materialize` of it, one at a time (tensors sharing storage
        come back as separate copies); other leaves unchanged."""
        return tree_map(lambda x: self.materialize(x)
                        if isinstance(x, torch.Tensor) and x.is_meta else x, tree)

    # ------------------------------------------------------------- recording

    def _new_value(self, t: torch.Tensor, sig: Signature) -> int:
        vid = len(self._tensors)
        self._tensors.append(t)
        self._signatures.append(sig)
        self._vid[id(t)] = vid
        self._note(vid, sig)
        return vid

    def _note(self, vid: int, sig: Signature) -> None:
        if sig[0] not in self._storages:
            self._storages[sig[0]] = self._tensors[vid].untyped_storage()
        self._signatures[vid] = sig
        self._latest[sig[0]] = vid
        self._by_signature[sig] = vid

    def _append(self, entry: LogEntry, touches: frozenset[int]) -> None:
        index = len(self._entries)
        self._entries.append(entry)
        for key in touches:
            self._by_storage.setdefault(key, []).append(index)

    def _known(self, t: torch.Tensor, sig: Signature) -> int | None:
        vid = self._vid.get(id(t))
        return vid if vid is not None and self._signatures[vid] == sig else None

    def _source(self, sig: Signature) -> tuple[int | None, bool]:
        """A value id holding ``sig``'s storage now, and whether it has the same layout."""
        vid = self._by_signature.get(sig)
        if vid is not None and self._signatures[vid] == sig:
            return vid, True
        vid = self._latest.get(sig[0])
        if vid is not None and self._signatures[vid][0] == sig[0]:
            return vid, False
        return None, False

    def _alias_of(self, sig: Signature, vid: int) -> AliasEntry:
        source, exact = self._source(sig)
        return AliasEntry(vid, source, exact, *sig)

    def _input_value(self, t: torch.Tensor) -> int:
        """The value id of meta tensor ``t`` as an op reads it now; a tensor not
        seen before (or whose storage or layout changed without an op) is
        recorded as an alias of its storage first."""
        sig = signature_of(t)
        vid = self._known(t, sig)
        if vid is not None:
            return vid
        alias = self._alias_of(sig, len(self._tensors))
        self._new_value(t, sig)
        self._append(alias, frozenset({sig[0]}))
        return alias.vid

    def _output_value(self, t: torch.Tensor) -> int:
        """The value id of meta tensor ``t`` an op returned or wrote."""
        sig = signature_of(t)
        vid = self._vid.get(id(t))
        if vid is None:
            return self._new_value(t, sig)
        self._note(vid, sig)
        return vid

    def _target(self, t: torch.Tensor) -> int | AliasEntry:
        """``t`` at the end of the log: its value id, or an alias to evaluate."""
        sig = signature_of(t)
        vid = self._known(t, sig)
        if vid is not None:
            return vid
        alias = self._alias_of(sig, -1)
        if alias.source is None:
            raise DeferredInitError(f"a meta tensor {tuple(t.shape)} {t.dtype} that the "
                                    f"recorded build did not make cannot be materialized")
        return alias

    # ---------------------------------------------------------------- replay

    def _storage_of(self, target: int | AliasEntry) -> int:
        return self._signatures[target][0] if isinstance(target, int) else target.storage

    def _needed(self, targets: list[int | AliasEntry], end: int) -> list[int]:
        """Indices (ascending) of the entries before ``end`` that the targets'
        values depend on: walking back from ``end``, every entry that creates
        or writes a live storage, whose inputs' storages then become live."""
        live: set[int] = set()
        heap: list[int] = []

        def make_live(key: int, before: int) -> None:
            if key in live:  # entries are visited latest first: the first bound is the widest
                return
            live.add(key)
            indices = self._by_storage.get(key, [])
            for i in indices[:bisect.bisect_left(indices, before)]:
                heapq.heappush(heap, -i)

        for target in targets:
            make_live(self._storage_of(target), end)
        needed: list[int] = []
        while heap:
            i = -heapq.heappop(heap)
            if needed and needed[-1] == i:
                continue
            needed.append(i)
            entry = self._entries[i]
            for key in self._reads(entry):
                make_live(key, i)
        return needed[::-1]

    @staticmethod
    def _reads(entry: LogEntry) -> frozenset[int]:
        return entry.reads if isinstance(entry, RecordedOp) else frozenset({entry.storage})

    def _replay(self, targets: list[int | AliasEntry], end: int) -> list[torch.Tensor]:
        """The real values of ``targets`` (value ids, or aliases read after
        the log) as of log entry ``end``: the needed entries run on the device,
        each value dropped after its last reader; generators restored after."""
        needed = self._needed(targets, end)
        keep = {t for t in targets if isinstance(t, int)} | {
            t.source for t in targets if isinstance(t, AliasEntry)}
        last_read: dict[int, int] = {}
        for i in needed:
            for vid in self._entries[i].inputs:
                last_read[vid] = i
        env: dict[int, torch.Tensor] = {}
        peak = 0
        with torch.no_grad(), _generator_states() as set_state:
            for i in needed:
                self._run_entry(self._entries[i], env, set_state)
                self._drop(self._entries[i], i, env, keep, last_read)
                peak = max(peak, _held_bytes(env))
            values = [env[t] if isinstance(t, int) else self._alias_value(t, env)
                      for t in targets]
        self.last_replayed_ops, self.last_peak_bytes = len(needed), peak
        return values

    def _drop(self, entry: LogEntry, i: int, env: dict[int, torch.Tensor], keep: set[int],
              last_read: dict[int, int]) -> None:
        outputs = entry.outputs if isinstance(entry, RecordedOp) else (entry.vid,)
        for vid in (*entry.inputs, *outputs):
            if vid is not None and vid not in keep and last_read.get(vid, -1) <= i:
                env.pop(vid, None)

    def _run_entry(self, entry: LogEntry, env: dict[int, torch.Tensor],
                   set_state: Callable[[torch.Generator, torch.Tensor], None]) -> None:
        if isinstance(entry, AliasEntry):
            env[entry.vid] = self._alias_value(entry, env)
            return
        args, kwargs = tree_unflatten([self._real_leaf(x, entry.func, env)
                                       for x in entry.leaves], entry.spec)
        if entry.rng is not None:
            gen, state = entry.rng
            set_state(self.generator if gen is None else gen, state)
        out, _ = tree_flatten(entry.func(*args, **kwargs))
        for vid, value in zip(entry.outputs, out):
            if vid is not None:
                env[vid] = value

    def _real_leaf(self, leaf: Any, func: Any, env: dict[int, torch.Tensor]) -> Any:
        """Recorded argument ``leaf`` of ``func`` as the replay passes it: a
        value of ``env``, a stand-in of a layout, a constant (refused if
        changed since), the device."""
        if isinstance(leaf, MetaRef):
            return env[leaf.vid]
        if isinstance(leaf, LayoutArg):
            return torch.empty_strided(leaf.shape, leaf.stride, dtype=leaf.dtype,
                                       device=self.device)
        if isinstance(leaf, ConstArg):
            if leaf.version is not None and version_of(leaf.tensor) != leaf.version:
                raise DeferredInitError(
                    f"{op_name(func)}: a constant tensor {tuple(leaf.tensor.shape)} the "
                    f"build used was changed in place after; copy it before the build uses it")
            return leaf.tensor
        return self.device if leaf is TARGET_DEVICE else leaf

    def _alias_value(self, alias: AliasEntry, env: dict[int, torch.Tensor]) -> torch.Tensor:
        if alias.source is None:
            raise DeferredInitError(f"a meta tensor {alias.shape} {alias.dtype} shares a "
                                    f"storage no recorded op made; it cannot be materialized")
        source = env[alias.source]
        if alias.exact:
            return source.detach()
        view = torch.empty((0,), dtype=alias.dtype, device=source.device)
        return view.set_(source.untyped_storage(), alias.offset, alias.shape, alias.stride)


def _held_bytes(env: dict[int, torch.Tensor]) -> int:
    """Bytes of the distinct storages the tensors of ``env`` view."""
    storages = {storage_key(t): t.untyped_storage().nbytes() for t in env.values()}
    return sum(storages.values())
