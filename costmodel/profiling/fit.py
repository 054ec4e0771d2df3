"""The fits of ``planner profile`` (the method is in :mod:`costmodel.profiling`).

Units: seconds, bytes, FLOPs, bytes/s, FLOP/s.

* :func:`fit_alpha_beta`: a link's latency and bandwidth from collective
  timings, through :func:`costmodel.collectives.collective_time` itself;
* :func:`fit_gemm`: a device's asymptotic GEMM rate and half-saturation
  FLOPs from GEMM timings;
* :func:`attention_fit`: the fused attention kernel's efficiency curve
  against that rate.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Sequence

from costmodel.cluster import Link
from costmodel.collectives import collective_time
from costmodel.compute import ATTENTION_BACKWARD_FLOPS
from costmodel.profiling.spec import ProfileError

__all__ = ["MAX_FIT_BANDWIDTH", "alpha_beta_terms", "attention_fit", "fit_alpha_beta", "fit_gemm"]


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


def attention_fit(samples: Any, overhead: float, peak_flops: float) -> dict[str, float] | None:
    """The fused attention kernel's efficiency curve, as the GEMM's: executed
    forward and backward FLOPs ``F`` (``costmodel.compute.ATTENTION_BACKWARD_FLOPS``)
    of each timed shape against its seconds less two kernel overheads, fitted to
    ``t = (F + H) / (E * peak_flops)``: ``{"attention_efficiency": E,
    "attention_half_saturation_flops": H}`` (``E <= 1``, ``H >= 0``; with one
    shape ``H = 0``). None without samples."""
    import numpy as np

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
