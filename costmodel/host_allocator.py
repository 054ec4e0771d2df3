"""The host allocator a CPU rank runs under, the same when ``planner profile``
measures the machine and when a plan's ranks train on it.

By default glibc maps a large block on its own (the threshold moves between
128 KiB and 32 MiB as blocks are freed) and trims its heap's top, so a step
can fault in fresh zeroed pages for the tensors the last step freed: a memory
pass no op prices. :func:`keep_freed_host_memory` makes the heap keep what a
step frees for the next, as CUDA's caching allocator does. Units: bytes.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["MALLOC_ENVIRONMENT", "glibc", "keep_freed_host_memory"]

#: glibc's ``mallopt`` parameters
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
#: the largest value ``mallopt`` takes (a C int), in bytes
_MALLOPT_MAX = (1 << 31) - 1
#: environment variables by which a user sets glibc's allocator themselves
MALLOC_ENVIRONMENT = ("GLIBC_TUNABLES", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_",
                      "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_", "MALLOC_ARENA_MAX")


def glibc() -> Any:
    """The C library, where it is glibc (``malloc_trim`` and ``mallopt``), else None."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "malloc_trim") else None


def keep_freed_host_memory() -> bool:
    """Make this process's heap keep what a step frees for the next step:
    glibc serves every block under 2 GiB from its heap and gives nothing back
    but at an explicit ``malloc_trim``
    (:func:`codegen.rank_process.release_freed_memory`). The resident set
    then stays at the heap's high mark: a step's peak, with whatever the heap
    could not reuse.

    Nothing where the C library is not glibc, or where the user set glibc's
    allocator through its environment (:data:`MALLOC_ENVIRONMENT`). Returns
    whether the allocator was set."""
    if any(name in os.environ for name in MALLOC_ENVIRONMENT):
        return False
    libc = glibc()
    if libc is None:
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, _MALLOPT_MAX)
                and libc.mallopt(_M_TRIM_THRESHOLD, _MALLOPT_MAX))
