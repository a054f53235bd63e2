"""appo.compare.stats: t-interval and paired bootstrap against hand-computed values."""

from __future__ import annotations

import math

import numpy as np
import pytest

from appo.compare.stats import paired_bootstrap, t_interval, t_quantile_975


def test_t_interval_three_seeds_by_hand():
    # values 0.50, 0.60, 0.70: mean 0.60; deviations -0.1, 0, 0.1 -> s^2 = 0.02 / 2 = 0.01,
    # s = 0.1; half width = t_{0.975,2} * s / sqrt(3) = 4.303 * 0.1 / 1.7320508 = 0.248434.
    iv = t_interval([0.5, 0.6, 0.7])
    assert iv.mean == pytest.approx(0.6)
    assert iv.low == pytest.approx(0.6 - 0.248434, abs=1e-6)
    assert iv.high == pytest.approx(0.6 + 0.248434, abs=1e-6)
    assert iv.n == 3 and iv.excludes_zero()
    # values -1, 0, 1, 2, 3 (df 4, t = 2.776): mean 1, s^2 = 10 / 4 = 2.5, s = 1.5811388;
    # s / sqrt(5) = sqrt(2.5 / 5) = 0.7071068; half width = 2.776 * 0.7071068 = 1.962928:
    # [-0.962928, 2.962928] holds 0.
    iv = t_interval([-1, 0, 1, 2, 3])
    assert (iv.low, iv.high) == (pytest.approx(1 - 1.962928, abs=1e-5),
                                 pytest.approx(1 + 1.962928, abs=1e-5))
    assert not iv.excludes_zero()


def test_t_interval_is_clipped_to_the_range_of_the_quantity():
    # values 0, 0, 0.3: mean 0.1, s^2 = (0.01 + 0.01 + 0.04) / 2 = 0.03, s = 0.173205;
    # half width = 4.303 * 0.173205 / 1.7320508 = 0.4303: [-0.3303, 0.5303], an accuracy
    # below 0 (issue 42: `17.6 [-22.2, 57.5]` in the study's report) -> [0, 0.5303].
    iv = t_interval([0.0, 0.0, 0.3], (0.0, 1.0))
    assert iv.mean == pytest.approx(0.1)
    assert (iv.low, iv.high) == (0.0, pytest.approx(0.1 + 0.4303, abs=1e-6))
    # values 1, 1, 0.7: mean 0.9, the same half width: [0.4697, 1.3303] -> [0.4697, 1].
    iv = t_interval([1.0, 1.0, 0.7], (0.0, 1.0))
    assert (iv.low, iv.high) == (pytest.approx(0.9 - 0.4303, abs=1e-6), 1.0)
    assert t_interval([0.0, 0.0, 0.3]).low == pytest.approx(0.1 - 0.4303, abs=1e-6)  # unbounded


def test_t_interval_one_seed_has_no_bounds_and_equal_values_zero_width():
    one = t_interval([0.4])
    assert one.mean == 0.4 and math.isnan(one.low) and not one.excludes_zero()
    same = t_interval([0.25, 0.25, 0.25])
    assert same.low == same.high == 0.25


def test_t_quantile_table_and_expansion():
    assert t_quantile_975(2) == 4.303
    # df 60: tables give 2.000; df 120: 1.980
    assert t_quantile_975(60) == pytest.approx(2.000, abs=1e-3)
    assert t_quantile_975(120) == pytest.approx(1.980, abs=1e-3)


def _naive_bootstrap(a, b, resamples, seed, tails=(2.5, 97.5)):
    """The same resampling as a plain loop over resamples, seeds and questions."""
    d = np.asarray(a, float) - np.asarray(b, float)
    s, q = d.shape
    rng = np.random.default_rng(seed)
    rows = rng.integers(0, s, size=(resamples, s))
    cols = rng.integers(0, q, size=(resamples, q))
    means = []
    for r in range(resamples):
        total = 0.0
        for i in rows[r]:
            for j in cols[r]:
                total += d[i, j]
        means.append(total / (s * q))
    return np.percentile(means, list(tails))


def test_paired_bootstrap_equals_naive_loop():
    gen = np.random.default_rng(5)
    a = (gen.random((3, 7)) < 0.6).astype(float)
    b = (gen.random((3, 7)) < 0.4).astype(float)
    iv = paired_bootstrap(a, b, resamples=300, seed=11)
    low, high = _naive_bootstrap(a, b, 300, 11)
    assert iv.mean == pytest.approx((a - b).mean())
    assert (iv.low, iv.high) == (pytest.approx(low), pytest.approx(high))


def test_paired_bootstrap_level_widens_to_the_matching_percentiles():
    gen = np.random.default_rng(8)
    a = (gen.random((3, 9)) < 0.6).astype(float)
    b = (gen.random((3, 9)) < 0.4).astype(float)
    # level 0.99: the 0.5 and 99.5 percentiles of the same resampled means.
    wide = paired_bootstrap(a, b, resamples=400, seed=2, level=0.99)
    assert (wide.low, wide.high) == tuple(pytest.approx(x)
                                          for x in _naive_bootstrap(a, b, 400, 2, (0.5, 99.5)))
    usual = paired_bootstrap(a, b, resamples=400, seed=2)
    assert wide.low <= usual.low and wide.high >= usual.high and wide.mean == usual.mean
    with pytest.raises(ValueError):
        paired_bootstrap(a, b, level=1.0)


def test_paired_bootstrap_hand_checked_cases():
    # A constant difference of 0.25 in every (seed, question) cell: every resample's mean
    # is 0.25, so the interval is [0.25, 0.25] and excludes 0.
    a = np.full((3, 4), 0.75)
    b = np.full((3, 4), 0.5)
    iv = paired_bootstrap(a, b, resamples=200, seed=0)
    assert (iv.mean, iv.low, iv.high) == (pytest.approx(0.25),) * 3 and iv.excludes_zero()
    # One seed, two questions with differences 0 and 1: a resample's mean is 0, 0.5 or 1
    # with probability 1/4, 1/2, 1/4, so with many resamples the 2.5% percentile is 0 and
    # the 97.5% one is 1: the interval [0, 1] includes 0.
    iv = paired_bootstrap(np.array([[1.0, 1.0]]), np.array([[1.0, 0.0]]), resamples=4000,
                          seed=3)
    assert (iv.mean, iv.low, iv.high) == (0.5, 0.0, 1.0) and not iv.excludes_zero()
    # Identical scores: every paired difference is 0, whatever the resample.
    same = paired_bootstrap(a, a, resamples=50, seed=1)
    assert (same.low, same.high) == (0.0, 0.0)


def test_paired_bootstrap_refuses_mismatched_shapes():
    with pytest.raises(ValueError):
        paired_bootstrap(np.zeros((2, 3)), np.zeros((3, 2)))
