"""This rank's process: its device and default process group, and its memory.

:func:`runtime_device` says where a plan's rank trains (gloo on the CPU, NCCL on
a GPU); :func:`ensure_process_group` starts the default process group from
torchrun's environment (:func:`codegen.parallel_model.parallelize` calls it);
:func:`resident_bytes`, :func:`peak_memory` and :func:`release_freed_memory`
measure and return this process's memory (how a CPU rank's allocator reuses
it: :mod:`costmodel.host_allocator`).
"""

from __future__ import annotations

import atexit
import os
from typing import Any

import torch
import torch.distributed as dist

from codegen.capture import PlanMismatchError
from costmodel.host_allocator import glibc

__all__ = ["ensure_process_group", "peak_memory", "release_freed_memory", "resident_bytes",
           "runtime_device"]


def runtime_device(cluster: dict[str, Any], local_rank: int) -> tuple[str, torch.device]:
    """The process-group backend and the device this rank trains on, as the
    plan's ``cluster`` says: a gloo cluster (CPU ranks) runs on the CPU even where
    CUDA is present; an NCCL one on GPU ``local_rank``, or on the CPU with gloo
    where this machine has no CUDA (the launcher says so before it starts).

    Raises:
        ValueError: an NCCL plan on a machine with fewer CUDA devices than the
            ranks started on it.
    """
    if cluster.get("backend") == "gloo" or not torch.cuda.is_available():
        return "gloo", torch.device("cpu")
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise ValueError(
            f"the plan is for {cluster.get('name', 'a GPU cluster')} (one GPU a rank), but this "
            f"machine has {count} CUDA device(s) for local rank {local_rank}; start at most "
            f"{count} rank(s) per node, or plan for a CPU cluster (local-cpu:N)")
    return "nccl", torch.device("cuda", local_rank)


def ensure_process_group(plan: Any) -> torch.device:
    """This rank's device; the default process group, started from torchrun's
    environment where none is yet. Refuses a world of another size than the plan's."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    backend, device = runtime_device(plan.cluster, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            raise RuntimeError(f"parallelize needs torchrun's environment: start the script with "
                               f"torchrun --nproc_per_node {plan.world_size}")
        dist.init_process_group(backend, **_restart_store())
        atexit.register(_close_process_group)
    if dist.get_world_size() != plan.world_size:
        raise PlanMismatchError(f"the plan is for {plan.world_size} devices (mesh "
                                f"{list(plan.mesh_shape)}) but {dist.get_world_size()} ranks run")
    return device


def _close_process_group() -> None:
    """At interpreter exit, close the process group :func:`parallelize` started.

    Left to interpreter finalization, gloo's worker threads can still hold
    work whose tensors need the GIL of an interpreter being torn down, and the
    rank aborts (SIGABRT) after its last step. No barrier first: a rank leaving
    on an error must not wait for peers blocked in a collective with it."""
    if dist.is_initialized():
        dist.destroy_process_group()


def _restart_store() -> dict[str, Any]:
    """``init_process_group`` arguments for ranks torchrun restarted after a
    failure: its agent's store under a prefix of their own attempt, since the
    store still holds the addresses the failed attempt's ranks published (gloo
    would connect to those dead ranks). Nothing for a first attempt."""
    from datetime import timedelta

    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if attempt == 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=timedelta(minutes=10))
    return {"store": dist.PrefixStore(f"attempt_{attempt}", store),
            "rank": int(os.environ["RANK"]), "world_size": int(os.environ["WORLD_SIZE"])}


def release_freed_memory(device: torch.device) -> None:
    """Give memory that was freed back to the system: on CPU ranks glibc's
    heap (``malloc_trim``), on CUDA the caching allocator's unused blocks."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        return
    libc = glibc()
    if libc is not None:
        libc.malloc_trim(0)


def resident_bytes() -> int:
    """This process's resident memory now, in bytes (Linux ``/proc/self/statm``)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_memory(device: torch.device) -> tuple[int, str]:
    """This process's peak memory on ``device``, in bytes, and what it is: CUDA's
    peak allocation, or on CPU ranks the process's peak resident set
    (``ru_maxrss``, KiB on Linux)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device)), "cuda_max_allocated"
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024, "cpu_peak_rss"
