"""Intervals for the comparison report: pure functions over plain arrays.

- `t_interval`: a 95% confidence interval for a mean over seeds, mean +- t_{0.975, n-1} * s /
  sqrt(n) with the sample standard deviation s (ddof 1): each seed's final accuracy is one
  observation; its ends are clipped to the range the quantity can take.
- `paired_bootstrap`: the difference of two variants on the same (seed, question) cells; the
  resampling is two-level (seeds with replacement, then questions with replacement, the same
  draw for both variants, which is what keeps the pairing), and the interval is the 2.5 and
  97.5 percentiles of the resampled mean differences (other percentiles for another level).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

# t_{0.975, df} for df = 1..30 (standard tables); beyond, the Cornish-Fisher expansion of
# the t quantile around the normal one (error < 1e-4 for df > 30).
_T975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
         2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
         2.060, 2.056, 2.052, 2.048, 2.045, 2.042]
_Z975 = 1.959964


def t_quantile_975(df: int) -> float:
    if df < 1:
        raise ValueError(f"need df >= 1, got {df}")
    if df <= len(_T975):
        return _T975[df - 1]
    z = _Z975
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


@dataclass(frozen=True)
class Interval:
    mean: float
    low: float  # nan when it cannot be computed (one seed)
    high: float
    n: int

    @property
    def half_width(self) -> float:
        return (self.high - self.low) / 2

    def excludes_zero(self) -> bool:
        return self.low > 0 or self.high < 0  # false for nan bounds


def t_interval(values: list[float] | np.ndarray,
               bounds: tuple[float, float] = (-math.inf, math.inf)) -> Interval:
    """95% t-interval of the mean of `values` (one value per seed), its ends clipped to
    `bounds`, the range the quantity can take (an accuracy's [0, 1]): with 3 seeds the
    t quantile is 4.30 and an unclipped interval of a low accuracy reaches below 0."""
    x = np.asarray(values, dtype=float)
    n = len(x)
    if n == 0:
        return Interval(math.nan, math.nan, math.nan, 0)
    mean = float(x.mean())
    if n == 1:
        return Interval(mean, math.nan, math.nan, 1)
    half = t_quantile_975(n - 1) * float(x.std(ddof=1)) / math.sqrt(n)
    lo, hi = bounds
    return Interval(mean, max(mean - half, lo), min(mean + half, hi), n)


def paired_bootstrap(a: np.ndarray, b: np.ndarray, resamples: int = 2000,
                     seed: int = 0, level: float = 0.95) -> Interval:
    """Mean of `a - b` with a percentile bootstrap interval at `level` (95% by default; the
    report asks for a wider one to hold several intervals to a family-wise level).

    `a`, `b`: `[S, Q]` scores of two variants on the same seeds (rows) and questions
    (columns). One resample draws S seed rows and Q question columns with replacement
    (indices `[R, S]` then `[R, Q]` from `np.random.default_rng(seed)`) and takes the mean of
    the differences on that grid.
    """
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if a.shape != b.shape or a.ndim != 2 or a.size == 0:
        raise ValueError(f"need two equal non-empty [S, Q] arrays, got {a.shape}, {b.shape}")
    d = a - b
    s, q = d.shape
    rng = np.random.default_rng(seed)
    rows = rng.integers(0, s, size=(resamples, s))
    cols = rng.integers(0, q, size=(resamples, q))
    grid = np.take_along_axis(d[rows], cols[:, None, :].repeat(s, axis=1), axis=2)  # [R, S, Q]
    means = grid.mean(axis=(1, 2))
    if not 0 < level < 1:
        raise ValueError(f"need 0 < level < 1, got {level}")
    tail = 100 * (1 - level) / 2
    low, high = np.percentile(means, [tail, 100 - tail])
    return Interval(float(d.mean()), float(low), float(high), s * q)
