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
  a collective the backend lacks is skipped and recorded.

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
"""

from __future__ import annotations

import json
import math
import os
import platform
import queue as queue_mod
import subprocess
import sys
import tempfile
import time
from typing import Any, Iterable, Mapping, Sequence

from .cluster import Cluster, DeviceSpec, Link, canonical_dtype
from .collectives import collective_time
from .presets import local_cpu_cluster
from .profile_worker import COLLECTIVE_KINDS, count_steps

__all__ = [
    "PROFILE_FORMAT_VERSION",
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

#: Version of the ``*.profile.json`` layout.
PROFILE_FORMAT_VERSION = 1

KiB, MiB = 2**10, 2**20

#: Collective sizes of a full profile: 1 KiB .. 64 MiB in powers of 4.
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


# --------------------------------------------------------------------------
# alpha-beta fit


def alpha_beta_terms(kind: str, nbytes: float, group_size: int) -> list[tuple[float, float]]:
    """The linear branches of :func:`collective_time` as ``(c_alpha, c_beta)`` pairs.

    ``collective_time(kind, nbytes, n, Link(bw=1/beta, latency=alpha))`` equals
    ``min(c_alpha * alpha + c_beta * beta for each branch)`` (``c_beta``
    already includes ``nbytes``). Raises ``ValueError`` for a kind
    ``collective_time`` does not know.
    """
    n = group_size
    if n <= 1 or nbytes <= 0:
        return [(0.0, 0.0)]
    steps = math.ceil(math.log2(n))
    b = float(nbytes)
    if kind == "all_reduce":
        return [(2.0 * (n - 1), 2.0 * (n - 1) / n * b), (2.0 * steps, 2.0 * steps * b)]
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return [(float(n - 1), (n - 1) / n * b)]
    if kind == "broadcast":
        return [(float(n - 1), b), (float(steps), steps * b)]
    if kind == "p2p":
        return [(1.0, b)]
    raise ValueError(f"unknown collective kind {kind!r}")


def _nnls2(rows: Any, y: Any, w: Any) -> tuple[float, float]:
    """Weighted least squares for 2 unknowns >= 0 (active-set by enumeration)."""
    import numpy as np

    A = rows * w[:, None]
    b = y * w
    best: tuple[float, tuple[float, float]] | None = None
    candidates: list[tuple[float, float]] = []
    sol, *_ = np.linalg.lstsq(A, b, rcond=None)
    if sol[0] >= 0 and sol[1] >= 0:
        candidates.append((float(sol[0]), float(sol[1])))
    for j in (0, 1):
        col = A[:, j]
        denom = float(col @ col)
        x = max(0.0, float(col @ b) / denom) if denom > 0 else 0.0
        candidates.append((x, 0.0) if j == 0 else (0.0, x))
    for cand in candidates:
        r = A @ np.array(cand) - b
        err = float(r @ r)
        if best is None or err < best[0]:
            best = (err, cand)
    assert best is not None
    return best[1]


def _predict(terms: Sequence[list[tuple[float, float]]], alpha: float, beta: float) -> list[float]:
    return [min(ca * alpha + cb * beta for ca, cb in branches) for branches in terms]


#: Largest bandwidth a fit reports, bytes/s: when timings do not grow with size
#: (latency-bound data) the fitted beta is 0; the link keeps this finite value.
MAX_FIT_BANDWIDTH = 1e13


def _solve_l1(rows: Any, y: Any, scale: Any, start: tuple[float, float], iters: int = 40) -> tuple[float, float]:
    """Minimise sum |rows @ x - y| / scale over x >= 0 by iteratively reweighted least squares."""
    import numpy as np

    x = np.array(start, dtype=float)
    for _ in range(iters):
        r = np.abs(rows @ x - y) / scale
        w = 1.0 / (scale * np.sqrt(np.maximum(r, 1e-6)))  # squared by the solve: |r| / r^2 -> sum |r|
        new = np.array(_nnls2(rows, y, w))
        if np.allclose(new, x, rtol=1e-9, atol=0.0):
            break
        x = new
    return float(x[0]), float(x[1])


def fit_alpha_beta(samples: Iterable[tuple[str, float, int, float]], loss: str = "l1") -> dict[str, Any]:
    """Fit one link to measured collectives.

    Args:
        samples: ``(kind, nbytes, group_size, seconds)`` with ``nbytes`` as
            :func:`collective_time` defines it per kind; kinds may be mixed.
        loss: ``"l1"`` (default) minimises the sum of absolute *relative*
            errors, i.e. aims at the median error and shrugs off the
            scheduling spikes a loaded machine adds; ``"l2"`` minimises the
            sum of squared relative errors (plain weighted least squares).

    Returns ``{"latency": alpha_s, "bandwidth": bytes_per_s, "loss",
    "median_abs_pct_error", "max_abs_pct_error", "samples", "bandwidth_bound"}``
    for the link that minimises the loss of :func:`collective_time` itself
    (min over ring/tree included). ``bandwidth_bound`` is true when the data
    showed no bandwidth term and ``bandwidth`` is ``MAX_FIT_BANDWIDTH``.

    Method: for fixed ring/tree branch choices the model is linear in
    (alpha, beta), so starting from a grid of (alpha, beta) the branches are
    assigned, a non-negative weighted least-squares solve (iterated with
    reweighting for ``l1``) updates (alpha, beta), and this repeats until the
    assignment is stable; the best objective over the starts wins.
    """
    import numpy as np

    if loss not in ("l1", "l2"):
        raise ValueError(f"loss must be 'l1' or 'l2', got {loss!r}")
    data = [(k, float(b), int(n), float(t)) for k, b, n, t in samples if int(n) > 1 and float(b) > 0]
    if len(data) < 2:
        raise ProfileError(f"an alpha-beta fit needs >= 2 collective timings with group size > 1, got {len(data)}")
    if any(t <= 0 for *_, t in data):
        raise ProfileError("collective timings must be positive seconds")
    terms = [alpha_beta_terms(k, b, n) for k, b, n, _ in data]
    y = np.array([t for *_, t in data])

    def objective(alpha: float, beta: float) -> float:
        r = (np.array(_predict(terms, alpha, beta)) - y) / y
        return float(np.sum(np.abs(r)) if loss == "l1" else np.sum(r * r))

    # Start points: grid over the plausible range of loopback .. NVLink links.
    starts = [(a, 1.0 / bw) for a in np.logspace(-7, -2, 11) for bw in np.logspace(7, 12, 11)]
    starts.sort(key=lambda p: objective(*p))
    best = (math.inf, 0.0, 0.0)
    for alpha, beta in starts[:8]:
        seen: set[tuple[int, ...]] = set()
        for _ in range(50):
            choice = tuple(int(np.argmin([ca * alpha + cb * beta for ca, cb in br])) for br in terms)
            if choice in seen:
                break
            seen.add(choice)
            rows = np.array([br[c] for br, c in zip(terms, choice)])
            alpha, beta = _nnls2(rows, y, 1.0 / y)
            if loss == "l1":
                alpha, beta = _solve_l1(rows, y, y, (alpha, beta))
        obj = objective(alpha, beta)
        if obj < best[0]:
            best = (obj, alpha, beta)
    _, alpha, beta = best
    bound = beta < 1.0 / MAX_FIT_BANDWIDTH
    beta = max(beta, 1.0 / MAX_FIT_BANDWIDTH)
    link = Link("fit", 1.0 / beta, alpha)
    pred = np.array([collective_time(k, b, n, link) for k, b, n, _ in data])  # the planner's own formula
    ape = np.abs(pred - y) / y * 100.0
    return {"latency": float(alpha), "bandwidth": float(1.0 / beta), "loss": loss,
            "median_abs_pct_error": float(np.median(ape)), "max_abs_pct_error": float(np.max(ape)),
            "samples": len(data), "bandwidth_bound": bool(bound)}


# --------------------------------------------------------------------------
# GEMM fit


def fit_gemm(samples: Iterable[tuple[float, float]], overhead: float, loss: str = "l1") -> dict[str, Any]:
    """Fit ``t = (flops + H) / peak + overhead`` to ``(flops, seconds)`` samples.

    That is :func:`costmodel.compute.op_time` of a compute-bound GEMM with
    ``efficiency = matmul_efficiency(flops, 1.0, H)`` on a device of
    ``peak_flops = peak`` and ``kernel_overhead = overhead``. ``loss`` as in
    :func:`fit_alpha_beta` (absolute or squared relative error); ``peak > 0``
    and ``H >= 0``.

    Returns ``{"peak_flops", "max_efficiency": 1.0, "half_saturation_flops",
    "median_abs_pct_error", "max_abs_pct_error", "samples"}``.
    """
    import numpy as np

    data = [(float(f), float(t)) for f, t in samples if f > 0 and t > 0]
    if len(data) < 2:
        raise ProfileError(f"a GEMM fit needs >= 2 timings, got {len(data)}")
    f = np.array([d[0] for d in data])
    y = np.array([d[1] for d in data])
    # unknowns x = (1/peak, fixed seconds); y = f * x0 + x1 with x1 = H/peak + overhead.
    # The intercept is fitted free of ``overhead`` (measured separately, and on a
    # busy machine sometimes above a small GEMM's time: pinning x1 >= overhead then
    # forces the slope to 0); H is what the intercept leaves above the overhead.
    rows = np.stack([f, np.ones_like(f)], axis=1)
    if loss not in ("l1", "l2"):
        raise ValueError(f"loss must be 'l1' or 'l2', got {loss!r}")
    inv_peak, fixed = _nnls2(rows, y, 1.0 / y)
    if loss == "l1":
        inv_peak, fixed = _solve_l1(rows, y, y, (inv_peak, fixed))
    if inv_peak <= 0:
        raise ProfileError("GEMM timings do not grow with FLOPs, so no peak FLOP/s can be fitted "
                           "(the machine was probably busy); re-run `planner profile` on an idle machine")
    peak = 1.0 / inv_peak
    half = max((fixed - overhead) * peak, 1.0)  # matmul_efficiency needs H > 0
    pred = (f + half) / peak + overhead
    ape = np.abs(pred - y) / y * 100.0
    return {"peak_flops": float(peak), "max_efficiency": 1.0, "half_saturation_flops": float(half),
            "loss": loss, "median_abs_pct_error": float(np.median(ape)), "max_abs_pct_error": float(np.max(ape)),
            "samples": len(data)}


def gemm_shapes(device: str, quick: bool) -> list[tuple[int, int, int]]:
    """The (m, k, n) GEMMs a profile fits on ``device`` (``'cpu'`` or ``'cuda'``)."""
    if device == "cuda":
        sizes = _GPU_GEMM_SIZES_QUICK if quick else _GPU_GEMM_SIZES
    else:
        sizes = _CPU_GEMM_SIZES_QUICK if quick else _CPU_GEMM_SIZES
    return [(s, s, s) for s in sizes]


# --------------------------------------------------------------------------
# running the ranks


def machine_info() -> dict[str, Any]:
    """Platform, CPU count, torch version and (when present) the GPU."""
    import torch

    info: dict[str, Any] = {
        "platform": platform.platform(), "python": platform.python_version(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(), "torch": torch.__version__,
        "memory_bytes": _physical_memory(),
        "loadavg": _loadavg(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpus"] = torch.cuda.device_count()
    return info


def _loadavg() -> list[float] | None:
    """1, 5 and 15 minute load averages: other work on the machine skews timings."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _physical_memory() -> int | None:
    try:
        return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


def _make_progress(enabled: bool, total: int, description: str) -> Any:
    if not enabled:
        return None
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    prog = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), TextColumn("{task.fields[item]}"), transient=True)
    prog.start()
    prog.add_task(description, total=total, item="starting ranks")
    return prog


def measure(spec: Mapping[str, Any], ranks: int, *, progress: bool = True,
            description: str = "profiling", timeout_s: float = 600.0) -> dict[str, Any]:
    """Run ``ranks`` processes of ``python -m costmodel.profile_worker`` and return rank 0's result.

    ``spec`` holds the measurement lists (see :mod:`costmodel.profile_worker`);
    ``device`` and ``backend`` are filled in when absent. Each rank runs with
    ``OMP_NUM_THREADS`` = ``spec["threads"]`` (default 1). The progress bar
    shows only when ``progress`` is true and stdout is a terminal. Raises
    :class:`ProfileError` when a rank fails or ``timeout_s`` passes (the ranks
    are then terminated).
    """
    import threading

    import torch

    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise ProfileError(f"ranks must be an integer >= 1, got {ranks!r}")
    spec = dict(spec)
    cuda = torch.cuda.is_available() if "device" not in spec else spec["device"] == "cuda"
    spec.setdefault("device", "cuda" if cuda else "cpu")
    spec.setdefault("backend", "nccl" if cuda else "gloo")
    if cuda and ranks > torch.cuda.device_count():
        raise ProfileError(f"{ranks} ranks need {ranks} GPUs, this machine has {torch.cuda.device_count()}")
    total = count_steps(spec)
    show = progress and sys.stdout.isatty()
    env = dict(os.environ, OMP_NUM_THREADS=str(spec.get("threads", 1)))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    with tempfile.TemporaryDirectory(prefix="planner-profile-") as tmp:
        spec["init_method"] = f"file://{os.path.join(tmp, 'store')}"
        spec["result_path"] = os.path.join(tmp, "result.json")
        spec_path = os.path.join(tmp, "spec.json")
        with open(spec_path, "w", encoding="utf-8") as f:
            json.dump(spec, f)
        steps: queue_mod.Queue[str] = queue_mod.Queue()
        procs: list[subprocess.Popen] = []
        errs = [open(os.path.join(tmp, f"rank{r}.err"), "w+", encoding="utf-8") for r in range(ranks)]
        bar = _make_progress(show, total, description)
        try:
            for r in range(ranks):
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "costmodel.profile_worker", spec_path, str(r), str(ranks)],
                    stdout=subprocess.PIPE if r == 0 else subprocess.DEVNULL, stderr=errs[r],
                    stdin=subprocess.DEVNULL, env=env, cwd=root, text=True))

            def pump(stream: Any) -> None:
                for line in stream:
                    if line.startswith("step "):
                        steps.put(line[5:].strip())

            reader = threading.Thread(target=pump, args=(procs[0].stdout,), daemon=True)
            reader.start()
            deadline = time.monotonic() + timeout_s
            while True:
                try:
                    label = steps.get(timeout=0.1)
                    if bar is not None:
                        bar.update(bar.task_ids[0], advance=1, item=label)
                    continue
                except queue_mod.Empty:
                    pass
                codes = [p.poll() for p in procs]
                failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
                if failed:
                    raise ProfileError(f"profiling rank {failed[0]} failed: {_rank_error(errs[failed[0]])}")
                if all(c == 0 for c in codes):
                    break
                if time.monotonic() > deadline:
                    raise ProfileError(f"profiling did not finish within {timeout_s:.0f} s")
            reader.join(5)
            try:
                with open(spec["result_path"], encoding="utf-8") as f:
                    return json.load(f)
            except (OSError, json.JSONDecodeError):
                raise ProfileError("profiling ranks finished without a result") from None
        finally:
            for p in procs:
                if p.poll() is None:
                    p.terminate()
            for p in procs:
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
                if p.stdout is not None:
                    p.stdout.close()
            for e in errs:
                e.close()
            if bar is not None:
                bar.stop()


def _rank_error(err_file: Any) -> str:
    err_file.flush()
    err_file.seek(0)
    return _last_line(err_file.read() or "no output")


def _last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1].strip() if lines else text


# --------------------------------------------------------------------------
# the profile


def profile_path(out_path: str | os.PathLike) -> str:
    """The profile JSON next to cluster JSON ``out_path``: ``x.json`` -> ``x.profile.json``."""
    out = os.fspath(out_path)
    stem = out[:-5] if out.endswith(".json") else out
    return stem + ".profile.json"


def load_profile(path: str | os.PathLike) -> dict[str, Any]:
    """Read a ``*.profile.json`` (or the cluster JSON it sits next to)."""
    path = os.fspath(path)
    if not path.endswith(".profile.json") and os.path.isfile(profile_path(path)):
        path = profile_path(path)
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict) or data.get("format") != "planner-profile":
        raise ProfileError(f"'{path}' is not a planner profile (no \"format\": \"planner-profile\")")
    if data.get("version") != PROFILE_FORMAT_VERSION:
        raise ProfileError(f"'{path}' is profile version {data.get('version')}, this code reads {PROFILE_FORMAT_VERSION}")
    return data


def _build_spec(device: str, ranks: int, quick: bool) -> dict[str, Any]:
    gpu = device == "cuda"
    dtype = "bfloat16" if gpu else "float32"
    gemms = [[m, k, n, dtype] for m, k, n in gemm_shapes(device, quick)]
    if gpu:
        gemms.append([4096, 4096, 4096, "float32"])  # the fp32 rate (tf32 off)
    return {
        "device": device,
        "backend": "nccl" if gpu else "gloo",
        "threads": 1,
        "reps": 3 if quick else 5,
        "compute_min_rep_s": 0.005 if quick else 0.02,
        "collective_min_rep_s": 0.005 if quick else 0.02,
        "overhead": True,
        "dispatch": ranks > 1,
        # host time per op: a training step of this zoo model, too small for the GPU to matter
        **({"host": "gpt-tiny"} if gpu else {}),
        "memory_bytes": [(1024 if gpu else 64) * MiB] if not quick else [(256 if gpu else 16) * MiB],
        "gemms": gemms,
        # causal fused attention, forward and backward: [batch, heads, seq, head dim, dtype]
        "attention": ([[4, 16, s, 64, dtype] for s in (1024, 2048, 4096)] if gpu
                      else [[2, 4, s, 32, dtype] for s in (128, 256)]),
        "collectives": list(COLLECTIVE_KINDS) if ranks > 1 else [],
        "sizes": list(QUICK_COLLECTIVE_SIZES if quick else COLLECTIVE_SIZES),
        "group_sizes": [ranks] if quick else group_sizes(ranks),
    }


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


def profile_local(ranks: int = 4, out_path: str | os.PathLike = "local-cpu.json", *, quick: bool = False,
                  progress: bool = True) -> Cluster:
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

    Returns the :class:`Cluster` written (``local-cpu:<ranks>`` on CPU,
    ``local-gpu:<ranks>`` on GPU). Raises :class:`ProfileError`.
    """
    import torch

    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise ProfileError(f"ranks must be an integer >= 1, got {ranks!r}")
    t0 = time.perf_counter()
    load_before = _loadavg()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    spec = _build_spec(device, ranks, quick)
    raw = measure(spec, ranks, progress=progress, description=f"profiling {ranks} {device} ranks")
    cluster, profile = build_profile(raw, spec, ranks, quick=quick, wall_s=time.perf_counter() - t0)
    profile["machine"]["loadavg_before"] = load_before
    write_profile(cluster, profile, out_path)
    return cluster


def attention_fit(samples: Any, overhead: float, peak_flops: float) -> dict[str, float] | None:
    """The fused attention kernel's efficiency curve, as the GEMM's: executed
    forward and backward FLOPs ``F`` (``costmodel.compute.ATTENTION_BACKWARD_FLOPS``)
    of each timed shape against its seconds less two kernel overheads, fitted to
    ``t = (F + H) / (E * peak_flops)``: ``{"attention_efficiency": E,
    "attention_half_saturation_flops": H}`` (``E <= 1``, ``H >= 0``; with one
    shape ``H = 0``). None without samples."""
    import numpy as np

    from costmodel.compute import ATTENTION_BACKWARD_FLOPS

    data = [(a["flops"] * (1 + ATTENTION_BACKWARD_FLOPS), max(a["seconds"] - 2 * overhead, 1e-12))
            for a in samples if a.get("seconds")]
    if not data:
        return None
    f = np.array([d[0] for d in data])
    t = np.array([d[1] for d in data])
    if len(data) >= 2:
        slope, fixed = _nnls2(np.stack([f, np.ones_like(f)], axis=1), t, 1.0 / t)
    else:
        slope, fixed = float(t[0] / f[0]), 0.0
    if slope <= 0:  # the kernel's time does not grow with its work: a rate of the largest
        slope, fixed = float(t[-1] / f[-1]), 0.0
    efficiency = min(1.0, 1.0 / (slope * peak_flops))
    return {"attention_efficiency": efficiency,
            "attention_half_saturation_flops": max(0.0, fixed / slope)}


def host_overhead(raw: Mapping[str, Any]) -> float | None:
    """Host seconds eager PyTorch spends on one op and pass (module calls,
    dispatch, autograd bookkeeping, the launch), from the ``host``
    measurement: a training step of a zoo model too small for the device to
    matter, over the op passes the cost model charges in it
    (``costmodel.compute.host_passes``); None when it was not measured."""
    h = raw.get("host")
    if not h or "seconds" not in h or not h.get("passes"):
        return None
    return h["seconds"] / h["passes"]


def dispatch_overhead(raw: Mapping[str, Any]) -> float | None:
    """Seconds DTensor adds per op and pass (forward or backward), from the
    ``dispatch`` measurement; None when it was not measured."""
    d = raw.get("dispatch")
    if not d or "seconds" not in d.get("plain", {}) or "seconds" not in d.get("dtensor", {}):
        return None
    return max(0.0, (d["dtensor"]["seconds"] - d["plain"]["seconds"]) / (2 * d["ops"]))


def build_profile(raw: Mapping[str, Any], spec: Mapping[str, Any], ranks: int, *, quick: bool = False,
                  wall_s: float = 0.0) -> tuple[Cluster, dict[str, Any]]:
    """Fit measurements and build ``(cluster, profile dict)``; no I/O, no processes.

    ``raw`` is :func:`measure`'s result for ``spec`` (keys ``overhead``,
    ``memory``, ``gemms``, ``collectives``, ``unsupported``).
    """
    device = spec["device"]
    overhead = float(raw["overhead"]["seconds"])
    mem = max(raw["memory"], key=lambda r: r["bytes"])
    mem_bw = mem["bytes"] / mem["seconds"]
    main_dtype = "bfloat16" if device == "cuda" else "float32"
    fit_samples = [(g["flops"], g["seconds"]) for g in raw["gemms"] if g["dtype"] == main_dtype]
    gemm = fit_gemm(fit_samples, overhead)
    gemm["dtype"] = main_dtype
    peak = {main_dtype: gemm["peak_flops"]}
    for g in raw["gemms"]:
        if g["dtype"] != main_dtype:  # single extra sizes: achieved rate, overhead removed
            peak[canonical_dtype(g["dtype"])] = g["flops"] / max(g["seconds"] - overhead, 1e-12)

    attention = attention_fit(raw.get("attention", ()), overhead, peak[main_dtype]) or {}
    coll = raw["collectives"]
    per_kind: dict[str, Any] = {}
    for kind in COLLECTIVE_KINDS:
        s = [(c["kind"], c["nbytes"], c["group_size"], c["seconds"]) for c in coll if c["kind"] == kind]
        if len(s) >= 2:
            per_kind[kind] = fit_alpha_beta(s)
    link_fit = fit_alpha_beta((c["kind"], c["nbytes"], c["group_size"], c["seconds"]) for c in coll) \
        if len(coll) >= 2 else None

    memory_per_rank = _device_memory(device, ranks)
    if device == "cpu":
        values: dict[str, Any] = {
            "peak_flops": peak, "memory_bandwidth": mem_bw, "kernel_overhead": overhead,
            "flop_efficiency": 1.0, "memory_efficiency": 1.0,
            "half_saturation_flops": gemm["half_saturation_flops"],
            **attention,
        }
        if memory_per_rank:
            values["memory"] = memory_per_rank
        dispatch = dispatch_overhead(raw)
        if dispatch is not None:
            values["dispatch_overhead"] = dispatch
        if link_fit is not None:
            values["link_bandwidth"] = link_fit["bandwidth"]
            values["link_latency"] = link_fit["latency"]
        if per_kind:
            values["collective_links"] = {k: {"latency": f["latency"], "bandwidth": f["bandwidth"]}
                                          for k, f in per_kind.items()}
        cluster = local_cpu_cluster(ranks, profile=values)
    else:
        import torch

        dev = DeviceSpec(name=torch.cuda.get_device_name(0), peak_flops=peak, memory=memory_per_rank or 1,
                         memory_bandwidth=mem_bw, kernel_overhead=overhead, flop_efficiency=1.0,
                         memory_efficiency=1.0,
                         half_saturation_flops=gemm["half_saturation_flops"],
                         attention_efficiency=attention.get("attention_efficiency", 0.0),
                         attention_half_saturation_flops=attention.get(
                             "attention_half_saturation_flops", 0.0),
                         host_overhead=host_overhead(raw) or 0.0)
        # With one GPU no collective runs: keep an NVLink-like placeholder (noted below).
        link = Link("nvlink", link_fit["bandwidth"], link_fit["latency"]) if link_fit else Link("nvlink", 150e9, 2e-6)
        cluster = Cluster(f"local-gpu:{ranks}", 1, ranks, dev, link, link, "nccl")

    notes = [
        f"all {ranks} ranks measured at once, each with {spec.get('threads', 1)} thread(s): per-rank figures "
        f"include the sharing of {os.cpu_count()} CPU cores (and any other load on the machine)"
        if device == "cpu" else f"{ranks} GPU rank(s), {main_dtype} GEMMs, NCCL collectives",
        "peak_flops is the fitted asymptotic achieved rate, so flop_efficiency = 1.0; small-GEMM "
        "inefficiency is device.half_saturation_flops (costmodel.compute.matmul_efficiency)",
        "the cluster link is fits.link (one alpha-beta fitted to every collective and group size) "
        "with fits.collectives (one per collective) as its per-collective exceptions",
    ]
    if link_fit is None:
        notes.append("no collective measured (1 rank): the link keeps its default")
    for kind, why in raw["unsupported"].items():
        notes.append(f"{kind} not supported by {spec['backend']}: {why}")

    profile = {
        "format": "planner-profile",
        "version": PROFILE_FORMAT_VERSION,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine_info(),
        "ranks": ranks,
        "device": device,
        "backend": spec["backend"],
        "quick": quick,
        "wall_s": wall_s,
        "cluster": cluster.to_dict(),
        "fits": {
            "kernel_overhead": overhead,
            "dispatch_overhead": dispatch_overhead(raw),
            "memory_bandwidth": mem_bw,
            "gemm": gemm,
            "link": link_fit,
            "collectives": per_kind,
        },
        "unsupported": dict(raw["unsupported"]),
        "notes": notes,
        "spec": {k: v for k, v in spec.items() if k not in ("init_method", "result_path")},
        "measurements": {k: raw[k] for k in ("overhead", "memory", "gemms", "collectives")},
    }
    return cluster, profile


def write_profile(cluster: Cluster, profile: dict[str, Any], out_path: str | os.PathLike) -> None:
    """Write the cluster JSON to ``out_path`` and the profile next to it (:func:`profile_path`)."""
    out_path = os.fspath(out_path)
    profile["cluster_path"] = out_path
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    with open(out_path, "w", encoding="utf-8") as f:
        f.write(cluster.to_json() + "\n")
    with open(profile_path(out_path), "w", encoding="utf-8") as f:
        json.dump(profile, f, indent=2)
        f.write("\n")


def _device_memory(device: str, ranks: int) -> int | None:
    if device == "cuda":
        import torch

        return int(torch.cuda.get_device_properties(0).total_memory)
    phys = _physical_memory()
    return phys // ranks if phys else None


def summary_rows(profile: Mapping[str, Any]) -> list[tuple[str, str, str]]:
    """``(what, value, detail)`` rows summarising a profile dict (for the CLI table)."""
    fits = profile["fits"]
    gemm = fits["gemm"]
    rows = [
        (f"GEMM {gemm['dtype']} peak", f"{gemm['peak_flops'] / 1e9:.1f} GFLOP/s",
         f"per rank; half-saturation {gemm['half_saturation_flops']:.3g} FLOPs, "
         f"fit median err {gemm['median_abs_pct_error']:.1f}%"),
        ("memory bandwidth", f"{fits['memory_bandwidth'] / 1e9:.2f} GB/s", "per rank, copy (read + write)"),
        ("kernel overhead", f"{fits['kernel_overhead'] * 1e6:.2f} us", "per eager op"),
        *([("dispatch overhead", f"{fits['dispatch_overhead'] * 1e6:.1f} us",
            "DTensor, per op and pass")] if fits.get("dispatch_overhead") is not None else []),
    ]
    def link_text(fit: Mapping[str, Any]) -> str:
        bw = "latency-bound" if fit.get("bandwidth_bound") else f"{fit['bandwidth'] / 1e9:.2f} GB/s"
        return f"{fit['latency'] * 1e6:.1f} us, {bw}"

    link = fits.get("link")
    if link:
        rows.append(("link (cluster)", link_text(link),
                     f"latency, bandwidth; all collectives, fit median err {link['median_abs_pct_error']:.1f}%"))
    for kind, fit in fits.get("collectives", {}).items():
        rows.append((kind, link_text(fit), f"fit median err {fit['median_abs_pct_error']:.1f}%"))
    for kind in profile.get("unsupported", {}):
        rows.append((kind, "skipped", f"not supported by {profile['backend']}"))
    return rows
