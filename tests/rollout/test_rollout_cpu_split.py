"""The decode matmul kernels split over threads (`appo.rollout.cpu.split`): chunks cover the
output columns once, aligned; helper threads really take chunks; results are bit-identical
to one call of the kernel over all columns (what the kernels computed before the split),
in a unit test and through the engine's decode steps."""

from __future__ import annotations

import itertools
import os
import threading

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from appo.rollout.cpu import kernels, split

pytestmark = pytest.mark.skipif(kernels.numba is None, reason="numba is not installed")


@pytest.fixture
def split_everything(monkeypatch):
    """Thresholds that split even the tiny test model's matrices and attention."""
    from appo.rollout.cpu import fused

    monkeypatch.setattr(fused, "ATTENTION_SPLIT_MIN", 0)
    monkeypatch.setattr(split, "SPLIT_MIN_BYTES", 0)
    monkeypatch.setattr(split, "CHUNK_MIN_BYTES", 1)
    chunks = split.column_chunks  # a test may replace it with a spy
    chunks.cache_clear()
    yield
    chunks.cache_clear()


@pytest.mark.parametrize("columns", [1, 8, 9, 37, 576, 1003, 49152])
@pytest.mark.parametrize("threads", [1, 2, 3, 16])
def test_chunks_cover_every_column_once_in_aligned_pieces(columns, threads):
    row_bytes = 576 * 4
    chunks = split.column_chunks(columns, row_bytes, threads)
    assert chunks[0][0] == 0 and chunks[-1][1] == columns
    assert all(hi > lo for lo, hi in chunks)
    # in order, no gap or overlap
    assert all(a[1] == b[0] for a, b in itertools.pairwise(chunks))
    assert all(lo % split.ALIGN == 0 for lo, _ in chunks)
    assert len(chunks) <= max(1, threads * split.CHUNKS_PER_THREAD)
    small = columns * row_bytes < split.SPLIT_MIN_BYTES or columns <= split.ALIGN
    assert (len(chunks) == 1) == (threads == 1 or small)
    if len(chunks) > 1:
        # Chunks under CHUNK_MIN_BYTES only where there would be fewer than one per thread.
        blocks = [-(-(hi - lo) // split.ALIGN) for lo, hi in chunks]
        small_chunks = min(blocks) * split.ALIGN * row_bytes < split.CHUNK_MIN_BYTES
        assert not small_chunks or len(chunks) == min(threads, -(-columns // split.ALIGN))
        assert max(blocks) - min(blocks) <= 1  # balanced


@pytest.mark.parametrize("kind", ["row", "wide", "tile"])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 13])
def test_split_results_are_bit_identical_to_one_call_over_all_columns(rows, kind):
    # 1003 weight rows: not a multiple of the wide kernel's 8 nor of the tile kernel's 3
    # (a remainder in the last chunk); K=257 is not a multiple of the SIMD lanes. Big
    # enough to be split.
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(1003, 257, generator=gen)
    x = torch.randn(rows, 257, generator=gen)
    assert len(split.column_chunks(1003, 257 * 4, 2)) > 2
    kernel = kernels.kernel_for(kind)
    whole = np.empty((rows, 1003), np.float32)
    kernel(x.numpy(), weight.numpy(), whole, 0, 1003)  # the unsplit kernel, one call
    for threads in (1, 2, 3, 5):
        got = kernels.linear(x, weight, kind=kind, threads=threads)
        assert np.array_equal(got.numpy(), whole), threads
    # float64: the split product is F.linear up to summation order.
    w64, x64 = weight.double(), x.double()
    torch.testing.assert_close(kernels.linear(x64, w64, kind=kind, threads=3),
                               F.linear(x64, w64), rtol=0, atol=1e-12)


def _blocking_kernel(threads: int):
    """A kernel filling its columns with the thread's id, each chunk waiting until
    `threads` threads have taken one: it returns only if the helpers take chunks while
    the caller holds its own."""
    seen: set[int] = set()
    arrived = threading.Condition()

    def kernel(x, w, out, lo, hi):
        with arrived:
            seen.add(threading.get_ident())
            arrived.notify_all()
            assert arrived.wait_for(lambda: len(seen) >= threads, timeout=60)
        out[:, lo:hi] = threading.get_ident()

    return kernel, seen


@pytest.mark.parametrize("threads", [2, 3])
def test_helper_threads_take_chunks_while_the_caller_works(threads):
    kernel, seen = _blocking_kernel(threads)
    x = np.zeros((2, 4), np.float32)
    w = np.zeros((4096, 4), np.float32)
    out = np.zeros((2, 4096), np.float64)
    chunks = ((0, 8), (8, 1024), (1024, 2048), (2048, 4096))
    split._HELPERS.run(kernel, (x, w, out), chunks, threads)
    assert len(seen) == threads and threading.get_ident() in seen
    assert set(np.unique(out)) == {float(t) for t in seen}  # every column written


def test_an_error_on_a_helper_reaches_the_caller():
    caller = threading.get_ident()
    started = threading.Event()

    def kernel(x, w, out, lo, hi):
        if threading.get_ident() == caller:
            assert started.wait(timeout=60)  # the helper's chunk fails first
        else:
            started.set()
            raise ValueError(f"chunk {lo}:{hi} failed")

    with pytest.raises(ValueError, match="failed"):
        split._HELPERS.run(kernel, (None, None, None), ((0, 8), (8, 16)), 2)
    # The helpers are free again afterwards.
    out = np.zeros(16)

    def fill(x, w, o, lo, hi):
        o[lo:hi] = 1

    split._HELPERS.run(fill, (None, None, out), ((0, 8), (8, 16)), 2)
    assert out.sum() == 16


def test_concurrent_callers_each_get_their_own_exact_result():
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(2048, 96, generator=gen)
    xs = [torch.randn(4, 96, generator=gen) for _ in range(4)]
    want = [kernels.linear(x, weight, threads=1) for x in xs]
    got: dict[int, list[torch.Tensor]] = {}

    def caller(i):
        got[i] = [kernels.linear(xs[i], weight, threads=2) for _ in range(20)]

    callers = [threading.Thread(target=caller, args=(i,)) for i in range(4)]
    for t in callers:
        t.start()
    for t in callers:
        t.join(timeout=120)
    for i in range(4):
        assert all(torch.equal(g, want[i]) for g in got[i]), i


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_gets_fresh_helpers():
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(2048, 96, generator=gen)
    x = torch.randn(3, 96, generator=gen)
    want = kernels.linear(x, weight, threads=1).numpy()
    kernels.linear(x, weight, threads=2)  # the parent's helpers exist
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through the pipe
        ok = False
        try:
            ok = np.array_equal(kernels.linear(x, weight, threads=2).numpy(), want)
        finally:
            os.write(write, b"1" if ok else b"0")
            os._exit(0)
    os.close(write)
    try:
        assert os.read(read, 1) == b"1"
    finally:
        os.close(read)
        os.waitpid(pid, 0)


@pytest.mark.parametrize("name", ["numba", "numba_wide", "numba_tile", "numba_panel"])
def test_engine_decode_is_bit_identical_with_split_kernels(name, monkeypatch,
                                                           split_everything):
    from rollout_fakes import Recorder

    from appo.models import load_model
    from appo.rollout.cpu import matmuls
    from appo.rollout.hf_engine import HFEngine
    from appo.rollout.sampling import SamplingParams

    lm = load_model("tiny-test", device="cpu")
    tok = lm.tokenizer
    monkeypatch.setenv(matmuls.FORCE_ENV, name)
    chunk_counts: list[int] = []
    real_chunks = split.column_chunks

    def counted(*args):
        chunk_counts.append(len(real_chunks(*args)))
        return real_chunks(*args)

    monkeypatch.setattr(split, "column_chunks", counted)

    def run(threads: int):
        monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
        eng = HFEngine(lm.model, tok, seed=7)
        rec = Recorder(eng)
        rows = rec.fork(eng.add_row(tok.encode("split the columns")), 5) + rec.fork(
            eng.add_row(tok.encode("and a second prompt")), 3)
        outs = rec.decode(rows, [3, 9, 6, 12, 4, 10, 7, 2], SamplingParams())
        for r in rows:
            assert rec.max_error(lm.model, r) < 1e-4, r
        return [(o.token_ids, o.logps, o.entropies) for o in outs]

    one = run(1)
    assert chunk_counts and max(chunk_counts) == 1
    chunk_counts.clear()
    three = run(3)
    # The decode steps' matmuls were split over all three threads (the tiny model's
    # matrices are a few `split.ALIGN` blocks wide: a chunk or two per thread).
    assert max(chunk_counts) >= 3
    assert three == one  # same tokens, same log-probs and entropies, to the bit


def test_a_weight_changed_in_place_or_swapped_is_read_afresh():
    # kernels.linear keeps one numpy view per weight tensor; an in-place update must show
    # through it and a swapped `.data` (other memory, even another shape) must replace it.
    gen = torch.Generator().manual_seed(2)
    weight = torch.nn.Parameter(torch.randn(64, 32, generator=gen, dtype=torch.float64))
    x = torch.randn(3, 32, generator=gen, dtype=torch.float64)
    changes = (lambda: weight.data.mul_(2),
               lambda: setattr(weight, "data", torch.randn(64, 32, dtype=torch.float64)),
               lambda: setattr(weight, "data", torch.randn(40, 32, dtype=torch.float64)))
    for change in changes:
        kernels.linear(x, weight)
        with torch.no_grad():
            change()
        got = kernels.linear(x, weight)
        assert got.shape == (3, weight.shape[0])
        torch.testing.assert_close(got, F.linear(x, weight.detach()), rtol=0, atol=1e-12)
