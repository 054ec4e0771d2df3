"""What ``planner profile`` measures: the spec its ranks run, and its error.

Units: bytes, seconds. The spec is the dict :mod:`costmodel.profiling.worker`
reads (see its docstring for each key); :func:`measurement_spec` builds the
one ``planner profile`` uses on this machine.
"""

from __future__ import annotations

from typing import Any

from costmodel.profiling.worker import COLLECTIVE_KINDS, REDISTRIBUTIONS

__all__ = [
    "COLLECTIVE_SIZES",
    "QUICK_COLLECTIVE_SIZES",
    "ProfileError",
    "gemm_shapes",
    "group_sizes",
    "measurement_spec",
    "require_rank_count",
]

KiB, MiB = 2**10, 2**20

#: Collective sizes of a full profile, bytes: 1 KiB .. 64 MiB in powers of 4.
COLLECTIVE_SIZES = tuple(KiB * 4**i for i in range(9))
#: ``--quick``: 1 KiB .. 4 MiB.
QUICK_COLLECTIVE_SIZES = tuple(KiB * 4**i for i in range(7))

#: Square GEMM sizes fitted on CPU (fp32) and GPU (bf16); the fidelity
#: benchmark checks the model on other shapes.
_CPU_GEMM_SIZES = (32, 64, 128, 256, 512, 1024)
_CPU_GEMM_SIZES_QUICK = (64, 256, 512)
_GPU_GEMM_SIZES = (256, 512, 1024, 2048, 4096, 8192)
_GPU_GEMM_SIZES_QUICK = (512, 2048, 4096)


class ProfileError(RuntimeError):
    """Profiling could not run or finish (a rank failed, timed out, bad arguments)."""


def require_rank_count(ranks: Any) -> None:
    """Raise :class:`ProfileError` unless ``ranks`` is an integer >= 1."""
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise ProfileError(f"ranks must be an integer >= 1, got {ranks!r}")


def gemm_shapes(device: str, quick: bool) -> list[tuple[int, int, int]]:
    """The (m, k, n) GEMMs a profile fits on ``device`` (``'cpu'`` or ``'cuda'``)."""
    if device == "cuda":
        sizes = _GPU_GEMM_SIZES_QUICK if quick else _GPU_GEMM_SIZES
    else:
        sizes = _CPU_GEMM_SIZES_QUICK if quick else _CPU_GEMM_SIZES
    return [(s, s, s) for s in sizes]


def group_sizes(ranks: int) -> list[int]:
    """Group sizes a full profile measures: the world, and each power of 2 >= 2 dividing it.

    A group smaller than the world runs as ``ranks / size`` disjoint groups at
    once, as the groups of one axis of a mesh over all ranks do (``2x2`` on
    ``local-cpu:4``: two pairs), so the fitted link describes every mesh axis.
    """
    sizes = {ranks} if ranks >= 2 else set()
    g = 2
    while g < ranks:
        if ranks % g == 0:
            sizes.add(g)
        g *= 2
    return sorted(sizes, reverse=True)


def measurement_spec(device: str, ranks: int, quick: bool) -> dict[str, Any]:
    """The spec ``planner profile`` runs on ``ranks`` ranks of ``device``
    (``'cpu'``: fp32 GEMMs, gloo; ``'cuda'``: bf16 GEMMs plus one fp32, NCCL);
    ``quick`` takes fewer sizes and repetitions."""
    gpu = device == "cuda"
    dtype = "bfloat16" if gpu else "float32"
    gemms = [[m, k, n, dtype] for m, k, n in gemm_shapes(device, quick)]
    if gpu:
        gemms.append([4096, 4096, 4096, "float32"])  # the fp32 rate (tf32 off)
    # GEMMs with a row not aligned to 16 bytes (a vocabulary of 50257): the output
    # row, then the contracted one, each one element short of 8192
    unaligned = [[8192, 1024, 8191, dtype], [8192, 8191, 1024, dtype]] if gpu else []
    return {
        "device": device,
        "backend": "nccl" if gpu else "gloo",
        "threads": 1,
        "reps": 3 if quick else 5,
        "compute_min_rep_s": 0.005 if quick else 0.02,
        "collective_min_rep_s": 0.005 if quick else 0.02,
        "overhead": True,
        "dispatch": ranks > 1,
        "fsdp_unit": ranks > 1,
        "pipeline": ranks > 1,
        "split_backward": ranks > 1,
        # a compiled region's host cost per call: regions of 1 and 32 parameters
        "compiled_call": [1, 32],
        # host time per op: a training step of this zoo model, too small for the GPU to matter
        **({"host": "gpt-tiny"} if gpu else {}),
        # a layer's memory-bound kernels against the copy's bandwidth, [rows, width, dtype]
        # (costmodel.profiling.memory_probe); CPU ranks keep the copy's rate
        **({"memory_chain": [4096 if quick else 8192, 4096, dtype]} if gpu else {}),
        # on CPU ranks, the same chain compiled: its fused kernels' elements per second
        **({"fused_chain": [1024 if quick else 2048, 1024, dtype]} if not gpu else {}),
        "memory_bytes": [(1024 if gpu else 64) * MiB] if not quick else [(256 if gpu else 16) * MiB],
        "gemms": gemms,
        "unaligned_gemms": unaligned,
        # causal fused attention, forward and backward: [batch, heads, seq, head dim, dtype]
        "attention": ([[4, 16, s, 64, dtype] for s in (1024, 2048, 4096)] if gpu
                      else [[2, 4, s, 32, dtype] for s in (128, 256)]),
        "collectives": list(COLLECTIVE_KINDS) if ranks > 1 else [],
        # the same kinds as DTensor's redistribute issues them, over all ranks
        "redistribute": list(REDISTRIBUTIONS) if ranks > 1 else [],
        # on CPU ranks each follows a burst of compute, as between a step's reshards
        # (GEMMs of this size: a few ms); GPUs queue compute and collectives on streams
        **({"redistribute_burst": 384} if not gpu else {}),
        "sizes": list(QUICK_COLLECTIVE_SIZES if quick else COLLECTIVE_SIZES),
        "group_sizes": [ranks] if quick else group_sizes(ranks),
    }
