"""The own-column microkernels of the CPU decode attention (`appo.rollout.cpu.vec`): scores
`LANES` keys at a time and probabilities x values in registers, against float64 sums; each
result the same bits wherever it is computed."""

from __future__ import annotations

import numpy as np
import pytest

from appo.rollout.cpu import kernels

pytestmark = pytest.mark.skipif(not kernels.available(), reason="numba kernels unavailable")


@pytest.fixture(scope="module")
def v():
    import numba

    from appo.rollout.cpu import vec

    @numba.njit
    def scores(q, keys, out):  # out[c] = keys[c] . q for c < LANES, one `qk` call
        vec.qk(q.ctypes.data, keys.ctypes.data, out.ctypes.data, q.shape[0])

    @numba.njit
    def weighted(p, values, acc, groups, n, pf):  # acc[:groups] += p[:groups, :n] @ values
        vec.pv_acc(p.ctypes.data, p.shape[1], values.ctypes.data, values.shape[1],
                   acc.ctypes.data, acc.shape[1], groups, n, pf.ctypes.data)

    @numba.njit
    def exp1(x, out):
        for i in range(x.shape[0]):
            out[i] = vec.exp_nonpositive(x[i])

    vec.scores, vec.weighted, vec.exp1 = scores, weighted, exp1
    return vec


@pytest.mark.parametrize("blocks", [1, 2, 5])  # d = LANES x blocks
def test_qk_scores_lanes_keys_against_float64(v, blocks):
    rng = np.random.default_rng(blocks)
    d = v.LANES * blocks
    q = rng.standard_normal(d, dtype=np.float32)
    keys = rng.standard_normal((v.LANES, d), dtype=np.float32)
    out = np.full(v.LANES, np.nan, np.float32)
    v.scores(q, keys, out)
    want = keys.astype(np.float64) @ q.astype(np.float64)
    bound = np.abs(keys.astype(np.float64)) @ np.abs(q.astype(np.float64))
    assert np.all(np.abs(out - want) <= 4 * d * np.finfo(np.float32).eps * bound)
    # Each key's score is its own: the same key among other keys gives the same bits.
    other = rng.standard_normal((v.LANES, d), dtype=np.float32)
    other[3] = keys[0]
    again = np.empty_like(out)
    v.scores(q, other, again)
    assert again[3] == out[0]


@pytest.mark.parametrize("groups", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("blocks", [1, 4, 5, 8])  # d = LANES x blocks: whole and part tiles
def test_pv_accumulates_probabilities_times_values(v, groups, blocks):
    rng = np.random.default_rng(10 * groups + blocks)
    d, n = v.LANES * blocks, 37
    p = rng.random((groups, 64), dtype=np.float32)
    values = rng.standard_normal((n, d), dtype=np.float32)
    acc0 = rng.standard_normal((groups, d), dtype=np.float32)
    acc = acc0.copy()
    v.weighted(p, values, acc, groups, n, values)
    want = acc0.astype(np.float64) + p[:, :n].astype(np.float64) @ values.astype(np.float64)
    bound = np.abs(acc0) + np.abs(p[:, :n]).astype(np.float64) @ np.abs(values)
    assert np.all(np.abs(acc - want) <= 4 * n * np.finfo(np.float32).eps * bound)
    # No columns: the output is left as it was.
    kept = acc0.copy()
    v.weighted(p, values, kept, groups, 0, values)
    assert np.array_equal(kept, acc0)


def test_pv_of_a_head_does_not_depend_on_the_heads_beside_it(v):
    # A head's output is one chain over the columns whatever tile it shares (1 of 3 heads
    # or alone), so splits of the heads give the same bits.
    rng = np.random.default_rng(3)
    d, n = 4 * v.LANES, 50
    p = rng.random((3, 64), dtype=np.float32)
    values = rng.standard_normal((n, d), dtype=np.float32)
    together = np.zeros((3, d), np.float32)
    v.weighted(p, values, together, 3, n, values)
    for g in range(3):
        alone = np.zeros((1, d), np.float32)
        v.weighted(np.ascontiguousarray(p[g : g + 1]), values, alone, 1, n, values)
        assert np.array_equal(alone[0], together[g])


def test_the_scalar_exp_is_the_vector_exp(v):
    x = np.array([0.0, -1e-30, -0.5, -3.25, -20.0, -86.9, -87.0, -100.0, -np.inf], np.float32)
    one = np.empty_like(x)
    v.exp1(x, one)
    many = x.copy()
    v._exp_nonpositive(many, len(many))
    assert np.array_equal(one, many)
    ok = x > -87
    assert np.allclose(one[ok], np.exp(x[ok].astype(np.float64)), rtol=4e-7, atol=0)
    assert np.all(one[~ok] < 2e-38) and np.all(one >= 0)


@pytest.mark.parametrize("lanes", [8, 16])
def test_both_vector_widths_compute_the_same_sums(v, lanes):
    # AVX2 machines take 8 lanes, AVX-512 ones 16; both kernels are built here (LLVM splits
    # or keeps the vectors for this CPU), so the 8-lane reduction tree is checked on any
    # machine.
    import numba

    qk, pv = v._qk(lanes), v._pv(2, 4, lanes)

    @numba.njit
    def run(q, keys, out, p, values, acc, n):
        qk(q.ctypes.data, keys.ctypes.data, out.ctypes.data, q.shape[0])
        pv(p.ctypes.data, p.shape[1], values.ctypes.data, values.shape[1], acc.ctypes.data,
           acc.shape[1], n, values.ctypes.data)

    rng = np.random.default_rng(lanes)
    d, n = 4 * lanes, 21
    q = rng.standard_normal(d, dtype=np.float32)
    keys = rng.standard_normal((lanes, d), dtype=np.float32)
    p = rng.random((2, n), dtype=np.float32)
    values = rng.standard_normal((n, d), dtype=np.float32)
    out, acc = np.empty(lanes, np.float32), np.zeros((2, d), np.float32)
    run(q, keys, out, p, values, acc, n)
    eps = np.finfo(np.float32).eps
    want = keys.astype(np.float64) @ q.astype(np.float64)
    assert np.all(np.abs(out - want) <= 4 * d * eps * (np.abs(keys) @ np.abs(q)))
    want = p.astype(np.float64) @ values.astype(np.float64)
    assert np.all(np.abs(acc - want) <= 4 * n * eps * (np.abs(p) @ np.abs(values)))


@pytest.mark.parametrize("n", [0, 32, 64, 2048])
def test_lane_sums_add_each_column_in_order(n):
    import numba

    from appo.rollout.cpu import vec

    @numba.njit
    def sums(a, b, out):
        vec.lane_sums(a.ctypes.data, b.ctypes.data, a.shape[0], out.ctypes.data)

    rng = np.random.default_rng(n)
    a, b = rng.standard_normal(n), rng.standard_normal(n) * 1e6
    start = rng.standard_normal(2 * vec.SUM_WIDTH)
    out = start.copy()
    sums(a, b, out)
    want = start.copy()  # the naive loop: column c's elements added one by one, in order
    for i in range(n):
        c = i % vec.SUM_WIDTH
        want[c] += a[i]
        want[vec.SUM_WIDTH + c] += b[i]
    assert out.tobytes() == want.tobytes()
