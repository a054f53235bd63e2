"""The packed-panel decode matmul (`appo.rollout.cpu.panels`): `x @ W^T` against float64,
the packing, each output's sum independent of its row block, panel range and thread count
(bit for bit), and the packed copies following in-place weight updates."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from appo.rollout.cpu import kernels

pytestmark = pytest.mark.skipif(not kernels.available(), reason="numba kernels unavailable")


@pytest.fixture(scope="module")
def panels():
    from appo.rollout.cpu import panels

    return panels


def _case(rows: int, n: int, k: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen)


def test_pack_puts_sixteen_columns_k_major_in_each_panel(panels):
    _, w = _case(1, 48, 5)
    packed = panels.pack(w.numpy()).reshape(3, 5, 16)
    for p in range(3):
        for k in range(5):
            assert np.array_equal(packed[p, k], w.numpy()[p * 16 : p * 16 + 16, k])


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 6, 7, 8, 12, 13, 16, 31, 32])
@pytest.mark.parametrize("k", [1, 7, 29, 300])
def test_panel_kernel_equals_float64(panels, rows, k):
    # Row counts cover every microkernel (1-6 rows) and the balanced blocks (7 = 4 + 3,
    # 13 = 5 + 4 + 4, 31 = 6 x 4 + 7...); K need not be a multiple of anything.
    x, w = _case(rows, 64, k, seed=rows * 1000 + k)
    got = kernels.linear_numpy(x.numpy(), w, None, "panel", threads=1)
    ref = (x.double() @ w.double().T).numpy()
    # One float32 multiply-add chain per output: rounding grows with K.
    np.testing.assert_allclose(got, ref, rtol=0, atol=2e-6 * k + 1e-6)


def test_an_output_is_the_same_bits_in_any_row_block_or_column_range(panels):
    x, w = _case(13, 96, 57, seed=3)
    wp = panels.pack(w.numpy())
    kernel = kernels.kernel_for("panel")
    xs = x.numpy()
    whole = np.empty((13, 96), np.float32)
    kernel(xs, wp, whole, 0, 96)
    for m in range(13):  # alone, each row runs in a 1-row block instead of a 5 or 4
        one = np.empty((1, 96), np.float32)
        kernel(np.ascontiguousarray(xs[m : m + 1]), wp, one, 0, 96)
        assert np.array_equal(one[0], whole[m])
    parts = np.full((13, 96), np.nan, np.float32)
    for lo, hi in ((0, 16), (16, 64), (64, 96)):
        kernel(xs, wp, parts, lo, hi)
    assert np.array_equal(parts, whole)


@pytest.mark.parametrize("threads", [2, 3])
def test_split_over_threads_is_bit_identical(panels, threads):
    from appo.rollout.cpu import team

    # Large enough to be split (split.SPLIT_MIN_BYTES) into chunks of split.ALIGN columns.
    x, w = _case(9, 1536, 576, seed=threads)
    one = kernels.linear_numpy(x.numpy(), w, None, "panel", threads=1)
    for run in (None, team.run):  # split's queue, then the spinning team
        many = kernels.linear_numpy(x.numpy(), w, None, "panel", threads=threads, run=run)
        assert np.array_equal(one, many)


def test_the_packed_copy_follows_in_place_updates_and_is_dropped(panels):
    x, w = _case(4, 32, 8, seed=9)
    first = panels.packed(w)
    assert panels.packed(w) is first  # made once while the weight is unchanged
    with torch.no_grad():
        w.mul_(2.0)  # an optimizer step's kind of change: same storage, new version
    got = kernels.linear_numpy(x.numpy(), w, None, "panel", threads=1)
    np.testing.assert_allclose(got, (x.double() @ w.double().T).numpy(), atol=1e-4)
    assert panels.packed(w) is not first
    panels.drop()
    assert not panels._packed


def test_widths_the_panels_do_not_fit_take_the_tile_kernel(panels):
    x, w = _case(5, 37, 29, seed=4)  # 37 columns: not a whole number of panels
    assert not panels.fits(w) and panels.fits(torch.zeros(48, 3))
    got = kernels.linear_numpy(x.numpy(), w, None, "panel", threads=1)
    tile = kernels.linear_numpy(x.numpy(), w, None, "tile", threads=1)
    assert np.array_equal(got, tile)


def test_strided_input_rows_are_read_as_their_values(panels):
    x, w = _case(6, 32, 40, seed=5)
    strided = x.numpy().repeat(2, axis=1)[:, ::2]  # same values, every other float
    assert not strided.flags.c_contiguous
    got = kernels.linear_numpy(strided, w, None, "panel", threads=1)
    assert np.array_equal(got, kernels.linear_numpy(x.numpy(), w, None, "panel", threads=1))
