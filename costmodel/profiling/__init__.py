"""``planner profile``: measure this machine and write a cluster JSON.

Units everywhere: seconds, bytes, FLOPs, bytes/s, FLOP/s.

    cluster = profile_local(4, "local-cpu.json")   # about a minute on 2 cores
    assert load_cluster("local-cpu.json") == cluster     # planner plan --cluster local-cpu.json

What is measured (all ranks at once, each rank single-threaded with
``OMP_NUM_THREADS=1``, exactly as ``local-cpu:N`` plans run; on a machine with
CUDA the same code uses one GPU per rank, bf16 GEMMs and NCCL):

* GEMM time over a range of sizes (fp32 on CPU, bf16 on GPU);
* memory bandwidth from a large ``copy_`` (bytes moved = read + write);
* the fixed cost of one eager op (a tiny ``add``), the ``kernel_overhead``;
* all_reduce, all_gather, reduce_scatter, broadcast and all_to_all (gloo on
  CPU, NCCL on GPU) for sizes from 1 KiB to 64 MiB in powers of 4, over all
  ``ranks`` ranks and over the smaller power-of-2 groups a mesh axis can have
  (4 ranks: also two pairs at once, as on a 2x2 mesh; see :func:`group_sizes`);
  a collective the backend lacks is skipped and recorded;
* the distributed runtime's host costs (more than one rank): DTensor's
  dispatch, an FSDP2 unit's collective calls and a pipeline schedule's work
  per action (:mod:`costmodel.profiling.runtime_costs`); ``probes`` add the
  planner's own runtime per op (:mod:`codegen.runtime_probe`).

What is fitted:

* **links**: ``alpha`` (``Link.latency``) and ``1/beta`` (``Link.bandwidth``)
  minimising the absolute *relative* error (iteratively reweighted least
  squares; robust to scheduling spikes), using exactly the formulas of
  :func:`costmodel.collectives.collective_time` (including its min over ring
  and tree for all_reduce and broadcast), so the fitted link plugs straight
  into it. One link fitted to all collectives together goes into the cluster
  (a :class:`Cluster` has one link per level); a link per collective is kept
  in the profile JSON for reference.
* **GEMMs**: ``t = flops / (peak * matmul_efficiency(flops, 1.0, H)) + overhead``
  = ``(flops + H) / peak + overhead``, i.e. the asymptotic FLOP/s ``peak``
  (stored as ``peak_flops`` with ``flop_efficiency = 1.0``: an achieved figure)
  and the half-saturation FLOPs ``H`` of :func:`costmodel.compute.matmul_efficiency`
  (kept in the profile JSON: ``DeviceSpec`` has no field for it).

Files: the cluster JSON at ``out_path`` (``Cluster.to_dict()``, loadable by
``load_cluster``) and, next to it, ``<stem>.profile.json`` with the cluster, the
fits and every raw measurement (see :func:`profile_path`).

This package is the face of the profiler: :func:`profile_local` ties the
steps together, and the names below are importable from here. Each lives in
the module of its step:

* :mod:`costmodel.profiling.spec`: what is measured (sizes, shapes, groups) and
  :class:`ProfileError`;
* :mod:`costmodel.profiling.run`: :func:`measure`, running the ranks of
  :mod:`costmodel.profiling.worker` (one process per rank), or of another rank
  program of its protocol;
* :mod:`costmodel.profiling.runtime_costs` and
  :mod:`costmodel.profiling.compiled_call`: the runtime's host costs and a
  compiled region's call, measured and fitted;
* :mod:`costmodel.profiling.fit`: the alpha-beta, GEMM and attention fits;
* :mod:`costmodel.profiling.build`: raw measurements to a cluster and a profile dict;
* :mod:`costmodel.profiling.file`: the profile JSON's path, reading, writing and summary;
* :mod:`costmodel.profiling.machine`: the machine's platform, memory and load.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Sequence

from costmodel.cluster import Cluster
from costmodel.profiling.build import build_profile
from costmodel.profiling.file import PROFILE_FORMAT_VERSION, load_profile, profile_path, summary_rows, write_profile
from costmodel.profiling.fit import alpha_beta_terms, fit_alpha_beta, fit_gemm
from costmodel.profiling.machine import load_average, machine_info
from costmodel.profiling.run import measure
from costmodel.profiling.spec import (
    COLLECTIVE_SIZES,
    QUICK_COLLECTIVE_SIZES,
    ProfileError,
    gemm_shapes,
    group_sizes,
    measurement_spec,
    require_rank_count,
)

__all__ = [
    "PROFILE_FORMAT_VERSION",
    "Probe",
    "ProfileError",
    "COLLECTIVE_SIZES",
    "QUICK_COLLECTIVE_SIZES",
    "alpha_beta_terms",
    "build_profile",
    "fit_alpha_beta",
    "fit_gemm",
    "gemm_shapes",
    "group_sizes",
    "load_profile",
    "machine_info",
    "measure",
    "profile_local",
    "profile_path",
    "summary_rows",
    "write_profile",
]


#: A measurement run beside the profile's own: ``(ranks, device, backend, quick,
#: progress) -> raw sections`` merged into its raw measurements (the runtime's
#: cost per op, :mod:`codegen.runtime_probe`, which this package cannot import).
Probe = Callable[[int, str, str, bool, bool], dict[str, Any]]


def profile_local(ranks: int = 4, out_path: str | os.PathLike = "local-cpu.json", *, quick: bool = False,
                  progress: bool = True, probes: Sequence[Probe] = ()) -> Cluster:
    """Measure this machine with ``ranks`` ranks and write its cluster JSON.

    Args:
        ranks: processes (CPU ranks, or GPUs when CUDA is available), >= 1.
            With 1 rank no collective is measured and the link keeps the
            preset default.
        out_path: where the cluster JSON goes; the profile JSON (fits and
            raw measurements) goes to :func:`profile_path` ``(out_path)``.
        quick: fewer sizes and repetitions (collectives up to 4 MiB, the
            world group only): seconds instead of about a minute; for tests.
        progress: show a ``rich`` progress bar (only when stdout is a terminal).
        probes: further measurements on the same ranks, their sections merged
            into the raw measurements (``planner profile`` adds the runtime's
            own cost per op: :func:`codegen.runtime_probe.profile_with_runtime`).

    Returns the :class:`Cluster` written (``local-cpu:<ranks>`` on CPU,
    ``local-gpu:<ranks>`` on GPU). Raises :class:`ProfileError`.
    """
    import torch

    require_rank_count(ranks)
    t0 = time.perf_counter()
    load_before = load_average()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    spec = measurement_spec(device, ranks, quick)
    raw = measure(spec, ranks, progress=progress, description=f"profiling {ranks} {device} ranks")
    for probe in probes:
        raw.update(probe(ranks, spec["device"], spec["backend"], quick, progress))
    cluster, profile = build_profile(raw, spec, ranks, quick=quick, wall_s=time.perf_counter() - t0)
    profile["machine"]["loadavg_before"] = load_before
    write_profile(cluster, profile, out_path)
    return cluster
