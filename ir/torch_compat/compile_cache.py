"""Compile-cache keys that stay the same from one launch to the next.

Inductor's FX-graph cache and AOTAutograd's cache key a graph by pickling its
example inputs. A lowered DTensor program takes its ``DeviceMesh`` as an
input, which dynamo passes as a fake script object; the caches' pickler
(``FxGraphCachePickler._reduce_fake_script_object``) pickles the real mesh
with it, through ``DeviceMesh.__getstate__``: the mesh's ``__dict__``. That
holds ``_hash``, the mesh's ``hash()`` cached on first use (DTensor's sharding
caches hash every mesh): ``hash`` of a tuple holding strings (``"cpu"``),
which Python salts per process (``PYTHONHASHSEED``). So every launch keyed
the same graph differently and missed both caches: torch 2.13 still does.

:func:`stable_mesh_cache_keys` leaves ``_hash`` out of the mesh's pickled
state. Nothing is lost: ``DeviceMesh.__hash__`` computes it again when absent,
and a salted hash carried into another process was wrong there anyway.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["compile_cache_counts", "stable_mesh_cache_keys"]

_PATCHED = "_planner_drops_salted_hash"


def stable_mesh_cache_keys() -> bool:
    """Pickle ``DeviceMesh`` without its per-process ``_hash`` (idempotent);
    whether the mesh pickles so now (False: no torch.distributed)."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.device_mesh import DeviceMesh

    original = DeviceMesh.__getstate__
    if getattr(original, _PATCHED, False):
        return True

    def __getstate__(self: Any) -> dict:
        state = original(self)
        state.pop("_hash", None)  # salted per process; __hash__ recomputes it
        return state

    setattr(__getstate__, _PATCHED, True)
    DeviceMesh.__getstate__ = __getstate__
    return True


def compile_cache_counts() -> dict[str, int]:
    """This process's compile-cache lookups so far: inductor's FX-graph cache
    (``fx_hit``, ``fx_miss``) and AOTAutograd's cache (``aot_hit``,
    ``aot_miss``; one entry holds a region's forward and backward graphs). A
    miss counts a graph compiled afresh: not found, or not cacheable (bypassed)."""
    from torch._dynamo.utils import counters

    def count(section: str, *keys: str) -> int:
        return sum(int(counters[section].get(key, 0)) for key in keys)

    return {"fx_hit": count("inductor", "fxgraph_cache_hit"),
            "fx_miss": count("inductor", "fxgraph_cache_miss", "fxgraph_cache_bypass"),
            "aot_hit": count("aot_autograd", "autograd_cache_hit"),
            "aot_miss": count("aot_autograd", "autograd_cache_miss", "autograd_cache_bypass")}
