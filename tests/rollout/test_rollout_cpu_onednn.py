"""`appo.rollout.cpu.onednn`: oneDNN's GEMM on weights packed once, against `F.linear`."""

from __future__ import annotations

import weakref

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from onednn_cases import greedy_under, lean_engine
from onednn_cases import random_linear as _case

from appo.rollout.cpu import hugepages, onednn
from appo.rollout.cpu.matmuls import IMPLEMENTATIONS, MatmulRule
from appo.rollout.sampling import SamplingParams

pytestmark = [pytest.mark.skipif(not onednn.available(), reason="torch built without oneDNN"),
              pytest.mark.usefixtures("onednn_dropped")]
ONEDNN_ONLY = MatmulRule(MatmulRule.parse("torch_onednn").steps, prefill="torch_onednn")


@pytest.mark.parametrize("rows", [1, 2, 4, 7, 8, 32, 33, 300])
def test_float32_equals_f_linear_up_to_summation_order(rows):
    x, w, b = _case(rows)
    for bias in (None, b):
        got = onednn.linear(x, w, bias)
        assert got.shape == (rows, 200) and got.dtype == torch.float32 and got.is_contiguous()
        # float64 reference: the two float32 results differ by summation order only.
        want = F.linear(x.double(), w.double(), None if bias is None else bias.double())
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)
    assert len(onednn._packed) == 1  # the packed copy was made once, for both calls


def test_leading_dimensions_and_non_contiguous_rows():
    x, w, b = _case(12)
    x3 = x.reshape(3, 4, 96)
    got = onednn.linear(x3, w, b)
    assert got.shape == (3, 4, 200)
    assert torch.equal(got.reshape(12, 200), onednn.linear(x, w, b))
    wide = torch.randn(12, 192)
    strided = wide[:, ::2]  # a non-contiguous view
    assert not strided.is_contiguous()
    assert torch.equal(onednn.linear(strided, w), onednn.linear(strided.contiguous(), w))


def test_same_rows_give_the_same_bits_whatever_ran_before():
    # One packed layout per weight: a row count's result does not depend on the history of
    # calls (other row counts, a repack), which keeps a seed's rollouts reproducible.
    x, w, _ = _case(8)
    first = onednn.linear(x, w)
    for rows in (1, 64, 3):
        onednn.linear(torch.randn(rows, 96), w)
    assert torch.equal(onednn.linear(x, w), first)
    onednn.drop()
    assert torch.equal(onednn.linear(x, w), first)


def test_an_in_place_update_repacks_the_weight():
    x, w, _ = _case(4)
    before = onednn.linear(x, w)
    packed = onednn.packed(w)
    with torch.no_grad():
        w.mul_(2.0)  # what an optimizer step does: same storage, version counter bumped
    after = onednn.linear(x, w)
    assert onednn.packed(w) is not packed
    torch.testing.assert_close(after, 2.0 * before, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(after.double(), F.linear(x.double(), w.double()),
                               rtol=1e-5, atol=1e-4)


def test_inference_tensors_and_drop():
    x, w, _ = _case(5)
    with torch.inference_mode():
        wi = w.clone()  # the lean decoder's packed QKV / gate-up copies are such tensors
        got = onednn.linear(x, wi)
    torch.testing.assert_close(got, F.linear(x, w), rtol=1e-5, atol=1e-4)
    assert len(onednn._packed) == 1
    onednn.drop()
    assert not onednn._packed
    del wi  # a dead weight's entry goes with it
    onednn.linear(x, w)
    assert len(onednn._packed) == 1
    del w
    assert not onednn._packed


def test_other_dtypes_fall_back_to_f_linear():
    x, w, b = _case(3)
    got = onednn.linear(x.double(), w.double(), b.double())
    assert torch.equal(got, F.linear(x.double(), w.double(), b.double()))
    assert not onednn._packed


def test_numpy_entry_point_and_registry():
    x, w, b = _case(6)
    got = onednn.numpy_linear(x.numpy(), w, b)
    assert isinstance(got, np.ndarray) and torch.equal(torch.from_numpy(got),
                                                       onednn.linear(x, w, b))
    impl = IMPLEMENTATIONS["torch_onednn"]
    assert not impl.kernel  # needs no numba
    assert torch.equal(impl.head(x, w), onednn.linear(x, w))
    assert not ONEDNN_ONLY.kernels


def test_the_engine_prefills_and_decodes_through_onednn_where_the_rule_says():
    # A rule like the AMD AVX-512 one (oneDNN for prefill and from 4 decode rows): the
    # engine's tokens and log-probs stay those of plain torch matmuls up to float32
    # rounding, and the packed copies are made by the prefill.
    def run(rule: MatmulRule):
        eng, tok = lean_engine()
        eng._lean.rule = rule
        rows = [eng.add_row(tok.encode(f"A question, number {i}, about the sea?"))
                for i in range(5)]
        outs = eng.decode(rows, 6, SamplingParams(temperature=0.0))
        return [(o.token_ids, o.logps) for o in outs]

    plain = run(MatmulRule.parse("torch"))
    assert not onednn._packed
    got = run(MatmulRule(MatmulRule.parse("1:torch,4:torch_onednn").steps,
                         prefill="torch_onednn"))
    assert onednn._packed  # the prefill and the 5-row decode steps went through it
    for (ids_a, lp_a), (ids_b, lp_b) in zip(got, plain, strict=True):
        assert ids_a == ids_b  # greedy: the same tokens
        np.testing.assert_allclose(lp_a, lp_b, atol=1e-4)
    assert MatmulRule.parse("numba").prefill == "torch"  # overrides keep torch for prefill


def test_an_all_onednn_rule_keeps_qkv_and_gate_up_packed_only():
    # Under a rule that multiplies through oneDNN everywhere, the lean decoder's
    # concatenated QKV and gate/up exist only in oneDNN's layout (no dense copy beside the
    # packed one); the tokens and log-probs are those of the dense copies; a rule change
    # repacks them dense.
    eng, tok = lean_engine()
    lean = eng._lean

    got = greedy_under(eng, tok, ONEDNN_ONLY)
    assert all(lw.qkv.layout == torch._mkldnn and lw.gate_up.layout == torch._mkldnn
               for lw in lean._layers)
    assert all(w.layout == torch.strided for w in lean.matrices())  # dense for benchmarks
    mixed = MatmulRule(MatmulRule.parse("1:torch,2:torch_onednn").steps, prefill="torch_onednn")
    want = greedy_under(eng, tok, mixed)
    assert all(lw.qkv.layout == torch.strided for lw in lean._layers)  # repacked dense
    for (ids_a, lp_a), (ids_b, lp_b) in zip(got, want, strict=True):
        assert ids_a == ids_b
        np.testing.assert_allclose(lp_a, lp_b, atol=1e-4)


def test_dropping_the_weight_copies_frees_the_packed_qkv_and_gate_up():
    # The engine drops its weight copies before every update; nothing (the fused step's
    # cached norm views included) may keep the lean decoder's packed layers alive through
    # it: on SmolLM2 they were 0.27 GB of the demo's peak, in the update.
    import gc

    from appo.rollout.cpu import kernels

    eng, tok = lean_engine()
    eng._lean.rule = ONEDNN_ONLY
    rows = [eng.add_row(tok.encode(f"Count to {i}.")) for i in range(3)]
    first = eng.decode(rows, 4, SamplingParams(temperature=0.0))
    assert eng._lean._fused is None or not kernels.available() or eng._lean._fused._norms
    packed = [weakref.ref(w) for lw in eng._lean._layers for w in (lw.qkv, lw.gate_up)]
    assert packed and all(r().layout == torch._mkldnn for r in packed)
    eng.drop_weight_copies()
    gc.collect()
    assert all(r() is None for r in packed) and not onednn._packed
    eng.release(rows)
    rows = [eng.add_row(tok.encode(f"Count to {i}.")) for i in range(3)]  # packed again
    again = eng.decode(rows, 4, SamplingParams(temperature=0.0))
    assert [o.token_ids for o in again] == [o.token_ids for o in first]


def _recording_madvise(monkeypatch, result: int = 0) -> list[tuple[int, int, int]]:
    calls: list[tuple[int, int, int]] = []

    def madvise(addr, length, advice):
        calls.append((addr, length, advice))
        return result

    monkeypatch.setattr(hugepages, "_madvise", lambda: madvise)
    return calls


def test_huge_pages_advises_whole_2mb_pages_around_the_packed_bytes(monkeypatch):
    calls = _recording_madvise(monkeypatch)
    packed = onednn.pack(torch.randn(3000, 600))  # 7.2 MB: spans several 2 MB pages
    assert not calls  # packing alone moves nothing (`decode_step` does, later)
    start = torch.ops.mkldnn.data_ptr(packed)
    end = start + torch.ops.mkldnn._nbytes(packed)
    assert onednn.huge_pages(packed) is True  # the fake's MADV_COLLAPSE succeeded
    assert [advice for _, _, advice in calls] == [hugepages.MADV_HUGEPAGE,
                                                 hugepages.MADV_COLLAPSE]
    (lo, length, _), again = calls[0], calls[1]
    assert again[:2] == (lo, length)  # both advices over the same range
    assert lo % hugepages.HUGE_PAGE == 0 and length % hugepages.HUGE_PAGE == 0
    assert lo <= start < lo + hugepages.HUGE_PAGE
    assert end <= lo + length < end + hugepages.HUGE_PAGE
    assert not onednn.huge_pages(torch.randn(4, 4))  # a dense tensor: nothing to advise
    assert len(calls) == 2


def test_huge_pages_failures_and_the_switch(monkeypatch):
    calls = _recording_madvise(monkeypatch, result=-1)  # e.g. a kernel without MADV_COLLAPSE
    assert onednn.huge_pages(onednn.pack(torch.randn(64, 64))) is False
    assert len(calls) == 2
    monkeypatch.undo()
    monkeypatch.setenv("APPO_CPU_HUGE_PAGES", "0")
    hugepages._madvise.cache_clear()
    try:
        assert hugepages._madvise() is None
        assert onednn.huge_pages(onednn.pack(torch.randn(64, 64))) is False
    finally:
        monkeypatch.undo()
        hugepages._madvise.cache_clear()


def test_packed_copies_move_after_serving_enough_decode_steps(monkeypatch):
    # Rent or buy: the copies made since the last packing move once they have served
    # HUGE_PAGES_AFTER decode steps, each once; a new packing restarts the count.
    calls = _recording_madvise(monkeypatch)
    monkeypatch.setattr(hugepages, "HUGE_PAGES_AFTER", 3)
    monkeypatch.setattr(hugepages, "_unmoved", {})
    a, b = onednn.pack(torch.randn(64, 64)), onednn.pack(torch.randn(32, 64))
    gone = onednn.pack(torch.randn(16, 64))
    del gone  # freed before the move: skipped
    moved = lambda: {c[0] for c in calls}  # noqa: E731 - the ranges advised so far
    hugepages.decode_step()
    hugepages.decode_step()
    assert not calls
    hugepages.decode_step()
    assert len(calls) == 4  # a and b, two advices each
    for t in (a, b):
        assert torch.ops.mkldnn.data_ptr(t) & -hugepages.HUGE_PAGE in moved()
    hugepages.decode_step()
    assert len(calls) == 4  # nothing left to move
    c = onednn.pack(torch.randn(48, 64))
    hugepages.decode_step()
    hugepages.decode_step()
    assert len(calls) == 4
    hugepages.decode_step()
    assert len(calls) == 6 and torch.ops.mkldnn.data_ptr(c) & -hugepages.HUGE_PAGE in moved()


def test_every_fused_decode_step_is_counted(monkeypatch):
    steps = []
    monkeypatch.setattr(hugepages, "decode_step", lambda: steps.append(1))
    eng, tok = lean_engine()
    if eng._lean.fused(torch.zeros((2, 1), dtype=torch.long)) is None:
        pytest.skip("no fused decode step here (numba kernels unavailable)")
    rows = [eng.add_row(tok.encode(f"Question {i}?")) for i in range(2)]
    eng.decode(rows, 6, SamplingParams(temperature=0.0))
    assert len(steps) == 5  # 6 tokens: the first from the prefill's logits, 5 decode steps


def test_huge_pages_changes_no_result():
    # The real call (on Linux it moves the pages where the kernel allows; elsewhere it does
    # nothing): the packed bytes and their address stay, so every output stays bit for bit.
    x, w, b = _case(8)
    packed = onednn.pack(w)
    start = torch.ops.mkldnn.data_ptr(packed)
    before = onednn.linear(x, packed, b)
    onednn.huge_pages(packed)
    assert torch.ops.mkldnn.data_ptr(packed) == start
    assert torch.equal(onednn.linear(x, packed, b), before)
    assert torch.equal(onednn.linear(x, w, b), before)


def test_the_fused_step_calls_the_op_itself_with_the_same_bits(monkeypatch):
    # Under oneDNN's rule the fused decode step skips `numpy_linear`'s checks and calls the
    # packed linear op directly: every decode matmul goes through that op, and the tokens,
    # log-probs and entropies are those of the `numpy_linear` path to the bit.
    eng, tok = lean_engine()
    if eng._lean.fused(torch.zeros((2, 1), dtype=torch.long)) is None:
        pytest.skip("no fused decode step here (numba kernels unavailable)")
    eng._lean.rule = ONEDNN_ONLY
    real, calls = onednn.linear_op(), []

    def counting():
        def op(*args):
            calls.append(1)
            return real(*args)
        return op

    def run():
        rows = [eng.add_row(tok.encode(f"Question {i}, about rivers?")) for i in range(3)]
        outs = eng.decode(rows, 6, SamplingParams(temperature=1.0))
        eng.release(rows)
        return [(o.token_ids, o.logps, o.entropies) for o in outs]

    eng.reseed(3)
    monkeypatch.setattr(onednn, "linear_op", counting)
    direct = run()
    layers = len(eng._lean._layers)
    assert len(calls) == 5 * 4 * layers  # 5 decode steps x 4 matmuls a layer
    eng.reseed(3)
    monkeypatch.setattr(onednn, "linear_op", lambda: None)  # back to `numpy_linear`
    assert run() == direct
