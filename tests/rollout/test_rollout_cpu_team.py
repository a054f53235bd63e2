"""The spinning helpers (`appo.rollout.cpu.team`): results bit-identical to one kernel call
over all columns (matmuls of every kind, attention with and without a shared prefix), the
helpers really run chunks, thousands of back-to-back jobs of changing shapes stay exact
(a late helper never runs a stale job), helpers that fell asleep wake for later jobs, the
same jobs as parallel regions of torch's OpenMP pool (`appo.rollout.cpu.omp`) run on its
threads and stay exact, the engine decodes the same tokens with the team on or off and on
either pool, and the cached job code is dropped when the kernels' files change."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from appo.rollout.cpu import kernels

pytestmark = pytest.mark.skipif(not kernels.available(), reason="numba not installed")


def _team_module(monkeypatch, pool: str):
    from appo.rollout.cpu import split, team

    if pool == "omp" and not team.OMP:
        pytest.skip("torch's libgomp not found: no OpenMP pool path here")
    # Split even small matrices, so every shape below goes through the team.
    monkeypatch.setattr(split, "SPLIT_MIN_BYTES", 0)
    monkeypatch.setattr(split, "CHUNK_MIN_BYTES", 1)
    split.column_chunks.cache_clear()
    monkeypatch.delenv("APPO_CPU_TEAM", raising=False)
    monkeypatch.setattr(team._TEAM, "omp", pool == "omp")
    return team


@pytest.fixture(params=["helpers", "omp"])
def team(monkeypatch, request):
    """The team's jobs on its own spinning helpers, then on torch's OpenMP pool."""
    from appo.rollout.cpu import split

    yield _team_module(monkeypatch, request.param)
    split.column_chunks.cache_clear()


@pytest.fixture
def helpers(monkeypatch):
    """The team with its own spinning helpers (what they alone do: sleep, wake, stall)."""
    from appo.rollout.cpu import split

    yield _team_module(monkeypatch, "helpers")
    split.column_chunks.cache_clear()


def _taken(team) -> int:
    return int(team._TEAM.ctl[team.TAKEN:].sum())


@pytest.mark.parametrize("kind", ["row", "wide", "tile"])
@pytest.mark.parametrize("rows", [1, 3, 8, 13])
def test_matmuls_through_the_team_equal_one_call_bit_for_bit(team, kind, rows):
    rng = np.random.default_rng(rows)
    w = rng.standard_normal((1003, 257), dtype=np.float32)
    x = rng.standard_normal((rows, 257), dtype=np.float32)
    whole = np.empty((rows, 1003), np.float32)
    kernel = kernels.kernel_for(kind)
    kernel(x, w, whole, 0, 1003)
    for threads in (2, 3):
        assert len(team.split.column_chunks(1003, 257 * 4, threads)) > 1
        out = np.full((rows, 1003), np.nan, np.float32)
        team.run(kernel, x, w, out, threads)
        assert np.array_equal(out, whole), threads


def test_the_helpers_run_chunks(helpers):
    team = helpers
    rng = np.random.default_rng(0)
    w = rng.standard_normal((4096, 256), dtype=np.float32)
    x = rng.standard_normal((8, 256), dtype=np.float32)
    out = np.empty((8, 4096), np.float32)
    kernel = kernels.kernel_for("row")
    before = _taken(team)
    deadline = time.monotonic() + 60  # a loaded machine may not schedule the helper at once
    while _taken(team) == before and time.monotonic() < deadline:
        team.run(kernel, x, w, out, 2)
    assert _taken(team) > before


@pytest.mark.parametrize("stall", [0, 3000])
def test_thousands_of_jobs_of_changing_shapes_stay_exact(helpers, monkeypatch, stall):
    team = helpers
    # Each job follows the last at once. With `stall` (~0.1 ms of pause rounds) a helper
    # is late to the job it saw and slow to come back after each chunk, and the caller is
    # slow to write a job's fields after claiming the chunk counter for it: a helper often
    # looks for work while the next job is half published. A take in that window would run
    # a chunk on the previous job's fields (the new output keeps NaNs) or lose one.
    team._TEAM.ctl[team.STALL] = stall
    try:
        _many_jobs(team)
    finally:
        team._TEAM.ctl[team.STALL] = 0


def _many_jobs(team, jobs: int = 1200, helpers_must_help: bool = True):
    rng = np.random.default_rng(1)
    cases = []
    for i in range(12):
        n, k, m = int(rng.integers(30, 700)), int(rng.integers(4, 70)), int(rng.integers(1, 9))
        w = rng.standard_normal((n, k), dtype=np.float32)
        x = rng.standard_normal((m, k), dtype=np.float32)
        kind = ("row", "wide", "tile")[i % 3]
        want = np.empty((m, n), np.float32)
        kernels.kernel_for(kind)(x, w, want, 0, n)
        cases.append((kernels.kernel_for(kind), x, w, want))
    before = _taken(team)
    deadline = time.monotonic() + 60
    j = 0
    # At least `jobs`, and on until a helper took part (a loaded machine may keep it off
    # a core for a while).
    while j < jobs or (helpers_must_help and _taken(team) == before):
        assert time.monotonic() < deadline
        kernel, x, w, want = cases[j % len(cases)]
        out = np.full_like(want, np.nan)
        team.run(kernel, x, w, out, 2 + j % 2)
        assert np.array_equal(out, want), j
        j += 1


def test_sleeping_helpers_wake_for_later_jobs(helpers, monkeypatch):
    team = helpers
    monkeypatch.setattr(team, "SPIN", 50)  # helpers give up spinning almost at once
    rng = np.random.default_rng(2)
    w = rng.standard_normal((2048, 128), dtype=np.float32)
    x = rng.standard_normal((4, 128), dtype=np.float32)
    want = np.empty((4, 2048), np.float32)
    kernel = kernels.kernel_for("tile")
    kernel(x, w, want, 0, 2048)
    team.run(kernel, x, w, np.empty_like(want), 2)  # starts the helper
    for _ in range(10):
        deadline = time.monotonic() + 60
        while not team._TEAM.sleeping[0]:  # it stops spinning and sleeps ...
            assert time.monotonic() < deadline
            time.sleep(0.001)
        before = _taken(team)
        while _taken(team) == before:  # ... and a later job wakes it to help
            assert time.monotonic() < deadline
            out = np.empty_like(want)
            team.run(kernel, x, w, out, 2)
            assert np.array_equal(out, want)


def test_omp_regions_run_on_torchs_threads_and_stay_exact(monkeypatch):
    # Every job a parallel region of torch's pool: each of its threads enters the body
    # (`ENTERED` counts them), and back-to-back jobs of changing shapes stay exact.
    team = _team_module(monkeypatch, "omp")
    rng = np.random.default_rng(3)
    w = rng.standard_normal((4096, 256), dtype=np.float32)
    x = rng.standard_normal((8, 256), dtype=np.float32)
    want = np.empty((8, 4096), np.float32)
    kernels.kernel_for("wide")(x, w, want, 0, 4096)
    for threads in (2, 3):
        before = int(team._TEAM.ctl[team.ENTERED])
        out = np.full_like(want, np.nan)
        team.run(kernels.kernel_for("wide"), x, w, out, threads)
        assert np.array_equal(out, want)
        assert int(team._TEAM.ctl[team.ENTERED]) - before == threads
    before = int(team._TEAM.ctl[team.ENTERED])
    _many_jobs(team, jobs=600, helpers_must_help=False)
    assert int(team._TEAM.ctl[team.ENTERED]) - before >= 2 * 600


def _attention_case(rows: int, prefix: int, seed: int):
    from appo.rollout.cpu import attention

    rng = np.random.default_rng(seed)
    heads, kv_heads, d, cap = 6, 2, 16, 40
    q = rng.standard_normal((rows, heads, d), dtype=np.float32)
    buf = rng.standard_normal((2, 2, rows, kv_heads, cap, d), dtype=np.float32)
    first = rng.integers(0, 10, rows).astype(np.int64)
    pk = rng.standard_normal((kv_heads, prefix, d), dtype=np.float32)
    pv = rng.standard_normal((kv_heads, prefix, d), dtype=np.float32)
    return (q, buf, 1, first, 30, *attention.pack_prefix(pk, pv), 0.25), \
        attention.units(rows, kv_heads)


@pytest.mark.parametrize("rows,prefix", [(8, 0), (19, 0), (19, 37), (5, 12)])
def test_attention_through_the_team_equals_one_call_bit_for_bit(team, rows, prefix):
    from appo.rollout.cpu import attention

    args, n_units = _attention_case(rows, prefix, rows + prefix)
    whole = np.empty_like(args[0])
    attention.attend_units(*args, whole, 0, n_units)
    units = tuple((u, u + 1) for u in range(n_units))
    for threads in (2, 3):
        out = np.full_like(whole, np.nan)
        team.attend((*args, out), units, threads)
        assert np.array_equal(out, whole), threads


def test_other_dtypes_layouts_and_thread_counts_take_the_queue_path(team, monkeypatch):
    calls = []
    monkeypatch.setattr(team.split, "run", lambda *a: calls.append(a))
    w = np.zeros((512, 64))  # float64: not a team job
    team.run(kernels.kernel_for("row"), np.zeros((2, 64)), w, np.zeros((2, 512)), 2)
    w32 = np.zeros((64, 512), np.float32).T  # not C-contiguous
    team.run(kernels.kernel_for("row"), np.zeros((2, 64), np.float32), w32,
             np.zeros((2, 512), np.float32), 2)
    jobs = int(team._TEAM.ctl[team.SEQ])
    # More threads than the team serves: the queue's sleeping helpers.
    team.run(kernels.kernel_for("row"), np.zeros((2, 64), np.float32),
             np.zeros((512, 64), np.float32), np.zeros((2, 512), np.float32),
             team.MAX_THREADS + 1)
    assert len(calls) == 3 and int(team._TEAM.ctl[team.SEQ]) == jobs


def test_the_engine_decodes_the_same_with_the_team_on_or_off(helpers, monkeypatch):
    team = helpers
    from appo.models import load_model
    from appo.rollout.cpu import fused
    from appo.rollout.hf_engine import HFEngine
    from appo.rollout.sampling import SamplingParams

    monkeypatch.setattr(fused, "ATTENTION_SPLIT_MIN", 0)
    lm = load_model("tiny-test", device="cpu")
    tok = lm.tokenizer

    def decode(on: bool, omp: bool = False):
        monkeypatch.setenv("APPO_CPU_TEAM", "1" if on else "0")
        monkeypatch.setattr(team._TEAM, "omp", omp)
        eng = HFEngine(lm.model, tok, seed=5, eos_ids=frozenset(), cpu_kernel=True)
        rows = eng.fork(eng.add_row(tok.encode("Shared words " * 12 + "go")), 3)
        rows += [eng.add_row(tok.encode(f"row {i}")) for i in range(5)]
        outs = eng.decode(rows, 12, SamplingParams(temperature=0.8))
        return [(o.token_ids, o.logps) for o in outs]

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        # Jobs published (whether a helper got to them in time depends on the machine's
        # load: `test_the_helpers_run_chunks` waits for that).
        jobs = int(team._TEAM.ctl[team.SEQ])
        with_team = decode(True)
        assert int(team._TEAM.ctl[team.SEQ]) > jobs
        jobs = int(team._TEAM.ctl[team.SEQ])
        assert decode(False) == with_team
        assert int(team._TEAM.ctl[team.SEQ]) == jobs  # the queue path, not the team
        if team.OMP:  # the same jobs as regions of torch's OpenMP pool: the same tokens
            entered = int(team._TEAM.ctl[team.ENTERED])
            assert decode(True, omp=True) == with_team
            assert int(team._TEAM.ctl[team.ENTERED]) > entered
    finally:
        torch.set_num_threads(threads)


def test_cached_job_code_is_dropped_when_the_kernels_change(helpers, tmp_path):
    team = helpers
    flushed = []
    job = SimpleNamespace(_cache=SimpleNamespace(_cache_path=str(tmp_path),
                                                 flush=lambda: flushed.append(1)))
    source = tmp_path / "kernels.py"
    source.write_text("v1")
    assert team.drop_stale_cache((job, job), (source,))  # no stamp yet
    assert len(flushed) == 2
    assert not team.drop_stale_cache((job, job), (source,))  # unchanged
    source.write_text("v2")
    assert team.drop_stale_cache((job, job), (source,))
    assert len(flushed) == 4 and (Path(tmp_path) / "team.depends").exists()


@pytest.mark.parametrize("penalty,temperature,top_k,top_p", [(1.0, 1.0, 0, 1.0),
                                                             (1.3, 0.7, 20, 0.9),
                                                             (1.0, 0.0, 0, 1.0)])
def test_sampling_through_the_team_equals_the_queue_path_bit_for_bit(team, penalty,
                                                                     temperature, top_k,
                                                                     top_p):
    from appo.rollout.cpu import split
    from appo.rollout.cpu.sampling import sample_numpy
    from appo.rollout.sampling import SamplingParams

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(9, 3001, generator=gen) * 3
    seen = torch.rand(9, 3001, generator=gen) < 0.05
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p,
                            repetition_penalty=penalty)
    want = sample_numpy(logits, params, torch.Generator().manual_seed(1), seen, threads=2,
                        run=split.run_chunks)
    seq = int(team._TEAM.ctl[team.SEQ])
    for threads in (2, 3):
        got = sample_numpy(logits, params, torch.Generator().manual_seed(1), seen,
                           threads=threads, run=team.sample_runner)
        for a, b in zip(got, want, strict=True):
            assert np.array_equal(a, b)
    assert int(team._TEAM.ctl[team.SEQ]) == seq + 2  # both went through the team


@pytest.mark.parametrize("rows", [8, 19])
def test_attention_with_rope_through_the_team_equals_one_call_bit_for_bit(team, rows):
    from appo.rollout.cpu import attention

    args, n_units = _attention_case(rows, 7, rows)
    q, buf = args[0], args[1]
    rng = np.random.default_rng(rows + 1)
    heads, kv_heads, d = q.shape[1], buf.shape[3], q.shape[2]
    qkv = rng.standard_normal((rows, (heads + 2 * kv_heads) * d), dtype=np.float32)
    cos = rng.standard_normal((rows, d), dtype=np.float32)
    sin = rng.standard_normal((rows, d), dtype=np.float32)
    rope = (qkv, cos, sin, np.empty(0, np.float32), np.empty(0, np.float32), 1e-6)
    want_q, want_buf, want = np.empty_like(q), buf.copy(), np.empty_like(q)
    attention.rope_attend_units(*rope, want_q, want_buf, *args[2:], want, 0, n_units)
    units = tuple((u, u + 1) for u in range(n_units))
    for threads in (2, 3):
        got_q, got_buf, out = np.full_like(q, np.nan), buf.copy(), np.full_like(q, np.nan)
        team.attend((got_q, got_buf, *args[2:], out), units, threads, rope)
        assert np.array_equal(got_q, want_q) and np.array_equal(got_buf, want_buf)
        assert np.array_equal(out, want), threads
