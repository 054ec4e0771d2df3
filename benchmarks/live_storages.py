"""Every tensor storage a process holds, counted as its ops make them.

:class:`LiveStorages` is the memory benchmarks' count of what the planner's own
runtime holds (``benchmarks/memory_fidelity.py``, ``tests/test_executor_memory.py``):
every storage made while it is active, alive until its Python object dies.
:func:`one_rank_group` gives the executor a one-rank process group to run in.
"""

from __future__ import annotations

import contextlib
import gc
import weakref
from typing import Any, Iterator

import torch

from ir.torch_compat import dispatch_mode_type, local_tensor, tree_leaves

__all__ = ["LiveStorages", "one_rank_group"]


class LiveStorages(dispatch_mode_type()):
    """Bytes of the tensor storages made while it is active and still alive,
    and their peak: what a process holds, counted as MemTracker counts a
    storage (``nbytes``: numel x itemsize, no allocator rounding), but every
    storage made under it, not only those registered with it, so that a copy
    nobody asked for (a second weight, a cache) counts too.

    Every op's outputs are seen (autograd's backward ops too: the mode is
    propagated to the engine); a storage counts from the first op that
    returns it until its Python object dies (a weak reference). Meta tensors
    do not count; fake ones count only when made by ``fake_mode`` (the
    measured model's; the capture's own fake tensors are no memory).
    ``track_resizes``: storages resized in place (FSDP2's) are read again at
    every op (slower: for the multi-rank table)."""

    def __init__(self, fake_mode: Any = None, *, track_resizes: bool = False) -> None:
        super().__init__()
        self.fake_mode = fake_mode
        #: read every live storage's size again at each op (FSDP2: see _resized)
        self.track_resizes = track_resizes
        self._live: dict[int, tuple[Any, int]] = {}
        self.current = 0
        self.peak = 0

    def reset_peak(self) -> int:
        """Start a new peak from what is live now (bytes)."""
        gc.collect()
        self.peak = self.current
        return self.current

    def _storage(self, t: torch.Tensor) -> Any:
        from torch.distributed.tensor import DTensor

        if isinstance(t, DTensor):
            t = local_tensor(t)
        if t.is_meta:
            return None
        made_by = getattr(t, "fake_mode", None)  # a FakeTensor's mode
        if made_by is not None:
            if self.fake_mode is None or made_by is not self.fake_mode:
                return None
        elif type(t) not in (torch.Tensor, torch.nn.Parameter):
            return None  # the capture's functional wrappers and the like
        return t.untyped_storage()

    def _add(self, t: torch.Tensor) -> None:
        st = self._storage(t)
        if st is None:
            return
        key, nbytes = id(st), int(st.nbytes())
        if key in self._live:  # seen before (a view, an in-place op): maybe resized
            ref, old = self._live[key]
            self._live[key] = (ref, nbytes)
            self.current += nbytes - old
            return

        def freed(_: Any, key: int = key) -> None:
            entry = self._live.pop(key, None)
            if entry is not None:
                self.current -= entry[1]

        self._live[key] = (weakref.ref(st, freed), nbytes)
        self.current += nbytes

    def _resized(self) -> None:
        """Read again the size of every live storage: FSDP2 frees a gathered
        parameter by resizing its storage to 0 (and gathers into it again),
        outside any op this mode sees."""
        current = 0
        for key, (ref, old) in list(self._live.items()):
            st = ref()
            if st is None:
                continue
            nbytes = int(st.nbytes())
            if nbytes != old:
                self._live[key] = (ref, nbytes)
            current += nbytes
        self.current = current

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self.track_resizes:
            self._resized()
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._add(t)
        self.peak = max(self.peak, self.current)
        return out


@contextlib.contextmanager
def one_rank_group() -> Iterator[None]:
    """A one-rank gloo process group for the executor (planning refuses one,
    so it lives only while the executor is measured)."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
