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


def test_pack_puts_a_panels_columns_k_major_in_it(panels):
    width = panels.PANEL  # 16 columns (AVX2) or 32 (AVX-512)
    _, w = _case(1, 3 * width, 5)
    packed = panels.pack(w.numpy()).reshape(3, 5, width)
    for p in range(3):
        for k in range(5):
            assert np.array_equal(packed[p, k], w.numpy()[p * width : (p + 1) * width, k])


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 6, 7, 8, 12, 13, 16, 31, 32])
@pytest.mark.parametrize("k", [1, 7, 29, 300])
def test_panel_kernel_equals_float64(panels, rows, k):
    # Row counts cover every microkernel (1-6 rows on AVX2, 1-8 on AVX-512) and the
    # balanced blocks (AVX2: 7 = 4 + 3, 13 = 5 + 4 + 4; AVX-512: 13 = 7 + 6, 31 = 8 + 8 +
    # 8 + 7...); K need not be a multiple of anything.
    x, w = _case(rows, 64, k, seed=rows * 1000 + k)
    got = kernels.linear_numpy(x.numpy(), w, None, "panel", threads=1)
    ref = (x.double() @ w.double().T).numpy()
    # One float32 multiply-add chain per output: rounding grows with K.
    np.testing.assert_allclose(got, ref, rtol=0, atol=2e-6 * k + 1e-6)


def test_an_output_is_the_same_bits_in_any_row_block_or_column_range(panels):
    width = panels.PANEL
    n = 6 * width
    x, w = _case(13, n, 57, seed=3)
    wp = panels.pack(w.numpy())
    kernel = kernels.kernel_for("panel")
    xs = x.numpy()
    whole = np.empty((13, n), np.float32)
    kernel(xs, wp, whole, 0, n)
    for m in range(13):  # alone, each row runs in a 1-row block instead of its block of 4-7
        one = np.empty((1, n), np.float32)
        kernel(np.ascontiguousarray(xs[m : m + 1]), wp, one, 0, n)
        assert np.array_equal(one[0], whole[m])
    parts = np.full((13, n), np.nan, np.float32)
    for lo, hi in ((0, width), (width, 4 * width), (4 * width, n)):
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
    x, w = _case(4, panels.PANEL, 8, seed=9)
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
    assert not panels.fits(w) and panels.fits(torch.zeros(3 * panels.PANEL, 3))
    got = kernels.linear_numpy(x.numpy(), w, None, "panel", threads=1)
    tile = kernels.linear_numpy(x.numpy(), w, None, "tile", threads=1)
    assert np.array_equal(got, tile)


def test_strided_input_rows_are_read_as_their_values(panels):
    x, w = _case(6, 2 * panels.PANEL, 40, seed=5)
    strided = x.numpy().repeat(2, axis=1)[:, ::2]  # same values, every other float
    assert not strided.flags.c_contiguous
    got = kernels.linear_numpy(strided, w, None, "panel", threads=1)
    assert np.array_equal(got, kernels.linear_numpy(x.numpy(), w, None, "panel", threads=1))


def test_a_tensor_packed_as_panels_is_its_own_packed_copy(panels):
    x, w = _case(5, 3 * panels.PANEL, 21, seed=6)
    t = panels.pack_tensor(w)
    assert panels.is_packed(t) and not panels.is_packed(w)
    assert np.array_equal(t.numpy(), panels.pack(w.numpy()))
    assert panels.packed(t).ctypes.data == t.data_ptr()  # no second copy
    assert torch.equal(panels.dense(t), w) and panels.dense(w) is w
    got = kernels.linear_numpy(x.numpy(), t, None, "panel", threads=1)
    assert np.array_equal(got, kernels.linear_numpy(x.numpy(), w, None, "panel", threads=1))


def test_the_amd_avx512_rule_runs_the_panel_kernel_everywhere():
    from appo.rollout.cpu.matmuls import RULES

    rule = RULES["amd-avx512"]  # read on a Zen 5 (benchmarks/RESULTS.md)
    assert {rule.name_for(r) for r in (1, 3, 8, 32, 256)} == {"numba_panel"}
    assert rule.prefill == "numba_panel" and rule.kernels


def test_an_all_panel_rule_keeps_qkv_and_gate_up_as_panels_only(panels):
    # Under a rule that multiplies through the panel kernel everywhere, the lean decoder's
    # concatenated QKV and gate/up exist only as panels (no dense copy beside them); the
    # tokens are those of a rule that prefills with torch, log-probs to float32 rounding;
    # a rule change repacks them dense; `matrices` gives the dense matrices.
    from onednn_cases import greedy_under, lean_engine

    from appo.rollout.cpu.matmuls import MatmulRule

    eng, tok = lean_engine()
    lean = eng._lean

    all_panels = MatmulRule(MatmulRule.parse("numba_panel").steps, prefill="numba_panel")
    got = greedy_under(eng, tok, all_panels)
    assert all(panels.is_packed(lw.qkv) and panels.is_packed(lw.gate_up)
               for lw in lean._layers)
    layer = eng.model.model.layers[0]
    want_qkv = torch.cat([layer.self_attn.q_proj.weight, layer.self_attn.k_proj.weight,
                          layer.self_attn.v_proj.weight])
    assert torch.equal(lean.matrices()[0], want_qkv)
    want = greedy_under(eng, tok, MatmulRule.parse("numba_panel"))  # prefill: torch
    assert not any(panels.is_packed(lw.qkv) for lw in lean._layers)  # repacked dense
    for (ids_a, lp_a), (ids_b, lp_b) in zip(got, want, strict=True):
        assert ids_a == ids_b
        np.testing.assert_allclose(lp_a, lp_b, atol=1e-4)


def test_panel_copies_move_onto_huge_pages_after_serving_enough_decode_steps(panels,
                                                                            monkeypatch):
    # The panel kernel's packed copies go through the same rent-or-buy move as oneDNN's
    # (`hugepages`): registered when packed, advised once HUGE_PAGES_AFTER steps have passed.
    from appo.rollout.cpu import hugepages

    calls = []
    monkeypatch.setattr(hugepages, "_madvise", lambda: lambda *a: calls.append(a) or 0)
    monkeypatch.setattr(hugepages, "HUGE_PAGES_AFTER", 2)
    monkeypatch.setattr(hugepages, "_unmoved", {})
    _, w = _case(1, 4 * panels.PANEL, 300, seed=11)
    kept = panels.pack(w.numpy())
    hugepages.decode_step()
    assert not calls
    hugepages.decode_step()
    start = kept.ctypes.data
    assert [c[2] for c in calls] == [hugepages.MADV_HUGEPAGE, hugepages.MADV_COLLAPSE]
    assert calls[0][0] <= start < calls[0][0] + hugepages.HUGE_PAGE
    assert calls[0][0] + calls[0][1] >= start + kept.nbytes
