"""Small statistics helpers for the benchmarks (numpy only: scipy is not a dependency).

    >>> spearman([1, 2, 3], [10, 20, 30])
    1.0
    >>> mape([110, 90], [100, 100])
    10.0
"""

from __future__ import annotations

import statistics
from typing import Sequence

import numpy as np

__all__ = ["rankdata", "spearman", "mape", "median_after_warmup", "paired_ratio"]


def rankdata(values: Sequence[float]) -> np.ndarray:
    """Ranks 1..n of ``values``; tied values get the mean of the ranks they span
    (scipy.stats.rankdata's ``"average"`` method)."""
    x = np.asarray(values, dtype=float)
    if x.ndim != 1:
        raise ValueError(f"rankdata takes a 1-D sequence, got shape {x.shape}")
    order = np.argsort(x, kind="mergesort")
    ranks = np.empty(len(x), dtype=float)
    sorted_x = x[order]
    i = 0
    while i < len(x):
        j = i
        while j + 1 < len(x) and sorted_x[j + 1] == sorted_x[i]:
            j += 1
        ranks[order[i:j + 1]] = (i + j) / 2.0 + 1.0  # mean of ranks i+1 .. j+1
        i = j + 1
    return ranks


def spearman(a: Sequence[float], b: Sequence[float]) -> float | None:
    """Spearman rank correlation of two equally long sequences: the Pearson
    correlation of their (tie-averaged) ranks.

    Returns None when it is undefined: fewer than 2 pairs, or one side constant.
    """
    if len(a) != len(b):
        raise ValueError(f"spearman needs sequences of equal length, got {len(a)} and {len(b)}")
    if len(a) < 2:
        return None
    ra, rb = rankdata(a), rankdata(b)
    ra -= ra.mean()
    rb -= rb.mean()
    den = float(np.sqrt((ra * ra).sum() * (rb * rb).sum()))
    if den == 0.0:
        return None
    return float((ra * rb).sum() / den)


def mape(predicted: Sequence[float], measured: Sequence[float]) -> float | None:
    """Mean absolute percentage error of ``predicted`` against ``measured``, in
    percent: ``100 * mean(|p - m| / |m|)``. None for empty input.

    Raises:
        ValueError: lengths differ, or a measured value is zero.
    """
    if len(predicted) != len(measured):
        raise ValueError(f"mape needs sequences of equal length, got {len(predicted)} and {len(measured)}")
    if not len(measured):
        return None
    p = np.asarray(predicted, dtype=float)
    m = np.asarray(measured, dtype=float)
    if np.any(m == 0):
        raise ValueError("mape is undefined when a measured value is 0")
    return float(np.mean(np.abs(p - m) / np.abs(m)) * 100.0)


def median_after_warmup(times: Sequence[float], warmup: int = 1) -> float:
    """Median of ``times`` without the first ``warmup`` entries (kept when nothing else is left)."""
    if not len(times):
        raise ValueError("no times")
    rest = list(times[warmup:]) or list(times)
    return float(statistics.median(rest))


def paired_ratio(a: Sequence[float], b: Sequence[float], *, level: float = 0.9,
                 resamples: int = 2000) -> dict[str, float | list[float]]:
    """The ratio of ``a`` to ``b`` measured in pairs (each pair at the same
    time, so that the machine's drift falls on both): ``{"ratios",
    "geomean", "low", "high"}``, the geometric mean of the pairs' ratios and
    a ``level`` bootstrap interval of it (``resamples`` resamples of the
    pairs, seeded: the same pairs give the same interval)."""
    if len(a) != len(b) or not len(a):
        raise ValueError(f"paired_ratio needs equally many pairs, at least one; got {len(a)} and {len(b)}")
    logs = np.log(np.asarray(a, dtype=float) / np.asarray(b, dtype=float))
    rng = np.random.default_rng(0)
    means = logs[rng.integers(0, len(logs), size=(resamples, len(logs)))].mean(axis=1)
    tail = (1.0 - level) / 2.0
    return {"ratios": [float(x) for x in np.exp(logs)], "geomean": float(np.exp(logs.mean())),
            "low": float(np.exp(np.quantile(means, tail))),
            "high": float(np.exp(np.quantile(means, 1.0 - tail)))}
