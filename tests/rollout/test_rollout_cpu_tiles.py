"""The shared prefix's matmuls (`appo.rollout.cpu.tiles`): the panel layout, the
microkernel's sums against float64, and the same bits whichever rows share a call."""

from __future__ import annotations

import numpy as np
import pytest

from appo.rollout.cpu import kernels

pytestmark = pytest.mark.skipif(not kernels.available(), reason="numba kernels unavailable")


@pytest.fixture(scope="module")
def t():
    from appo.rollout.cpu import tiles

    return tiles


def _right(t, w: np.ndarray) -> np.ndarray:
    """`w` `[N, K]` (N a multiple of TILE) as `tiles_matmul`'s panels, through
    `pack_prefix`'s keys (whose panels hold P columns x d rows: N = P, K = d)."""
    keys, _ = t.pack_prefix(w[None], np.zeros((1, w.shape[0], 1), w.dtype))
    return keys[0]


def test_the_prefix_is_packed_into_zero_padded_panels(t):
    rng = np.random.default_rng(0)
    kv, p, d = 3, t.TILE + 5, 40
    pk = rng.standard_normal((kv, p, d), dtype=np.float32)
    pv = rng.standard_normal((kv, p, d), dtype=np.float32)
    keys, values = t.pack_prefix(pk, pv)
    pp, dp = 2 * t.TILE, -(-d // t.TILE) * t.TILE
    assert keys.shape == (kv, pp, d) and values.shape == (kv, dp, p)
    # keys: [KV, P' / TILE, d, TILE]; panel c // TILE, row k, lane c % TILE holds pk[c, k]
    panels = keys.reshape(kv, pp // t.TILE, d, t.TILE)
    assert np.array_equal(panels.transpose(0, 1, 3, 2).reshape(kv, pp, d)[:, :p], pk)
    assert not panels.transpose(0, 1, 3, 2).reshape(kv, pp, d)[:, p:].any()
    # values: [KV, d' / TILE, P, TILE]; panel i // TILE, row j, lane i % TILE holds pv[j, i]
    vpanels = values.reshape(kv, dp // t.TILE, p, t.TILE)
    back = vpanels.transpose(0, 2, 1, 3).reshape(kv, p, dp)
    assert np.array_equal(back[:, :, :d], pv) and not back[:, :, d:].any()
    empty_k, empty_v = t.pack_prefix(pk[:, :0], pv[:, :0])
    assert empty_k.shape == (kv, 0, d) and empty_v.shape == (kv, dp, 0)


@pytest.mark.parametrize("m_rows", [1, 2, 5, 6, 7, 12, 13, 24])
@pytest.mark.parametrize("k_len", [1, 9, 64])
def test_the_float32_product_is_the_float64_product_to_rounding(t, m_rows, k_len):
    rng = np.random.default_rng(m_rows * 100 + k_len)
    n = 2 * t.TILE
    x = rng.standard_normal((24, 70), dtype=np.float32)  # wider than k_len: rows strided
    w = rng.standard_normal((n, k_len), dtype=np.float32)
    out = np.full((24, n + 3), np.nan, np.float32)  # wider than n: output rows strided
    t.tiles_matmul(x, m_rows, k_len, _right(t, w), out, n)
    want = x[:m_rows, :k_len].astype(np.float64) @ w.T.astype(np.float64)
    scale = np.abs(x[:m_rows, :k_len]).astype(np.float64) @ np.abs(w.T).astype(np.float64)
    assert np.all(np.abs(out[:m_rows, :n] - want) <= 1e-6 * scale + 1e-30)
    assert np.isnan(out[m_rows:]).all() and np.isnan(out[:, n:]).all()  # nothing else written


def test_float64_runs_the_same_sums_in_loops(t):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((7, 50))
    w = rng.standard_normal((t.TILE, 50))
    out = np.empty((7, t.TILE))
    t.tiles_matmul(x, 7, 50, _right(t, w), out, t.TILE)
    np.testing.assert_allclose(out, x @ w.T, rtol=0, atol=1e-12)


def test_any_split_of_the_rows_gives_the_same_bits(t):
    # The attention's units call it with 2-24 rows; each output must not depend on which
    # rows were computed with it (the engine's results do not depend on the row count).
    rng = np.random.default_rng(5)
    x = rng.standard_normal((19, 64), dtype=np.float32)
    w = _right(t, rng.standard_normal((t.TILE, 64), dtype=np.float32))
    whole = np.empty((19, t.TILE), np.float32)
    t.tiles_matmul(x, 19, 64, w, whole, t.TILE)
    for size in (1, 2, 3, 4, 5, 6, 7):
        parts = np.empty_like(whole)
        for lo in range(0, 19, size):
            hi = min(19, lo + size)
            t.tiles_matmul(x[lo:hi].copy(), hi - lo, 64, w, parts[lo:hi], t.TILE)
        assert np.array_equal(parts, whole), size
