"""The statistics helpers of the measured benchmarks (benchmarks/stats.py), on hand-checkable cases."""

import math
import os
import sys

import pytest

# benchmarks/ is a top-level folder of the repository, not an installed package.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.stats import mape, median_after_warmup, paired_ratio, rankdata, spearman  # noqa: E402


def test_ranks_are_one_based_and_ties_share_the_mean_rank():
    assert rankdata([30, 10, 20]).tolist() == [3.0, 1.0, 2.0]
    # 10 is first; the two 20s take ranks 2 and 3 -> 2.5 each; 40 is 4th
    assert rankdata([20, 10, 40, 20]).tolist() == [2.5, 1.0, 4.0, 2.5]
    assert rankdata([5, 5, 5]).tolist() == [2.0, 2.0, 2.0]


def test_spearman_of_monotone_sequences_is_plus_or_minus_one():
    assert spearman([1, 2, 3, 4], [10, 100, 1000, 10000]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)


def test_spearman_matches_the_textbook_formula_without_ties():
    # ranks a = 1 2 3 4 5, b = 2 1 4 3 5: d^2 = 1+1+1+1+0 = 4
    # rho = 1 - 6 * 4 / (5 * (25 - 1)) = 1 - 24/120 = 0.8
    assert spearman([1, 2, 3, 4, 5], [0.2, 0.1, 0.4, 0.3, 0.5]) == pytest.approx(0.8)


def test_spearman_with_ties_is_pearson_of_average_ranks():
    # ranks a = 1 2 3, b = 1.5 1.5 3: centred a = -1 0 1, b = -0.5 -0.5 1
    # r = (0.5 + 0 + 1) / sqrt(2 * 1.5) = 1.5 / sqrt(3)
    assert spearman([1, 2, 3], [7, 7, 9]) == pytest.approx(1.5 / math.sqrt(3))


def test_spearman_is_undefined_for_constant_or_too_short_input():
    assert spearman([1, 2, 3], [5, 5, 5]) is None
    assert spearman([1], [2]) is None
    with pytest.raises(ValueError):
        spearman([1, 2], [1])


def test_mape_is_the_mean_of_relative_errors_in_percent():
    assert mape([110, 90], [100, 100]) == pytest.approx(10.0)
    # |1-2|/2 = 50 %, |3-3|/3 = 0 %, |8-4|/4 = 100 %  -> mean 50 %
    assert mape([1, 3, 8], [2, 3, 4]) == pytest.approx(50.0)
    assert mape([], []) is None
    with pytest.raises(ValueError):
        mape([1], [0])
    with pytest.raises(ValueError):
        mape([1, 2], [1])


def test_median_after_warmup_drops_the_first_step():
    assert median_after_warmup([9.0, 1.0, 3.0, 2.0]) == 2.0
    assert median_after_warmup([9.0, 1.0, 3.0]) == 2.0
    assert median_after_warmup([9.0]) == 9.0


def test_paired_ratio_is_the_geometric_mean_of_the_pairs_with_a_seeded_interval():
    """Two plans launched in turns: the verdict is the geometric mean of the
    pairs' ratios, inside its bootstrap interval, the same for the same
    pairs; a drift of the machine that scales both of a pair cancels."""
    drift = [1.0, 1.3, 0.8, 1.1, 0.9, 1.2]
    auto = [0.2 * d * r for d, r in zip(drift, [1.02, 0.98, 1.01, 0.99, 1.03, 0.97])]
    other = [0.2 * d for d in drift]
    p = paired_ratio(auto, other)
    assert p["geomean"] == pytest.approx(math.prod(p["ratios"]) ** (1 / 6))
    assert p["ratios"][0] == pytest.approx(1.02)
    assert p["low"] <= p["geomean"] <= p["high"] and p["low"] < 1 < p["high"]
    assert paired_ratio(auto, other) == p
    with pytest.raises(ValueError):
        paired_ratio([1.0], [1.0, 2.0])
