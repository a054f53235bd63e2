"""Spinning helper threads for a decode step's split kernels: the hand-off in nanoseconds.

`appo.rollout.cpu.split` hands a matmul's chunks to sleeping helper threads through a queue
and an event. Each hand-off wakes a thread through the kernel (and, in a virtual machine,
the hypervisor): tens of microseconds per round trip, paid by the ~150 split kernels of
every decode step of SmolLM2 (4 matmuls and one attention per layer), a sizeable part of
an 8-row step (`benchmarks/RESULTS.md`, "split hand-off"). Here the helpers wait by
spinning on a shared counter (an atomic load and a `pause`) inside a numba function that
holds no GIL, and run the chunks there too, so a hand-off touches neither the kernel nor
Python: the caller writes the job (kind, array addresses and shapes) into a shared int64
array, publishes it by bumping a sequence number, takes chunks itself and spins until
every chunk is done. A helper that sees no job for `SPIN` idle rounds (when no rollout
runs; a decode step's gaps are shorter) returns to Python and sleeps on an event until the
next job's caller wakes it; that job is done without it.

Jobs: the numba matmul kernels (`appo.rollout.cpu.kernels`, `x @ w^T` on C-contiguous
float32 arrays) and the fused step's attention (`attention.attend_units`, float32; with
the step's rotary + cache write, `rope_attend_units`), at
most `MAX_THREADS` threads. Any other kernel, layout, dtype or thread count takes `split`'s
path. Chunks are the same as `split`'s and
each runs the same compiled kernel on arrays of the same type and layout, so results are
bit-identical to one call over all columns, whatever thread takes which chunk.

Protocol (int64 `ctl`; the counters on their own cache lines): the caller first tags the
chunk counter `NEXT` with the new sequence number (an atomic exchange), then writes the
job's fields, resets `DONE` and publishes `SEQ` (release). A helper that saw sequence `t`
reads the fields, then takes chunks by compare-and-swap on `NEXT`, only while its tag is
`t` (the caller has not moved on) and chunks are left: a late helper neither runs a stale
job nor uses up a chunk of the next. `DONE` counts finished chunks (release); the caller returns once it
reaches the chunk count (acquire), after which the job's arrays are the caller's again.

Where this process has torch's libgomp (`appo.rollout.cpu.omp`), the same jobs run as
parallel regions of torch's OpenMP pool instead of on the team's helper: oneDNN's GEMMs and
torch's ops use that pool, and its workers spinning beside a helper of ours left two cores
to three busy threads. The chunks and their code are the same, so are the results.

`APPO_CPU_TEAM=0` turns it off (the queue hand-off of `split`), `APPO_CPU_OMP=0` keeps the
team's helper instead of the OpenMP pool; rollouts are the same either way.
"""

from __future__ import annotations

import os
import threading

import numba
import numpy as np
from numba import types

from appo.rollout.cpu import (
    atomics,
    attention,
    kernels,
    omp,
    panels,
    sampling,
    split,
    tiles,
    vec,
)
from appo.rollout.cpu.atomics import (
    bool_at,
    compare_exchange,
    exchange,
    f32_at,
    f64_at,
    fetch_add,
    gomp_parallel,
    i64_at,
    load,
    pause,
    sched_yield,
    store,
)
from appo.rollout.cpu.cache import flush_stale

# torch's GOMP_parallel (or a one-thread stand-in) linked into the jobs below: registered
# before any of them is compiled or loaded from numba's cache.
OMP = omp.register()
SEQ, NEXT, DONE = 0, 8, 16  # one 64-byte line each
KIND, CHUNKS, BOUNDS, HELPERS, LAYER, LAST, STALL = 24, 25, 26, 27, 28, 29, 30
FCTL = 31  # the address of `fctl`, for the OpenMP body (it gets `ctl` alone)
ENTERED = 20  # OpenMP threads that entered a job's region, all jobs (tests read it)
FIELDS = 32  # addresses and shapes from here
TAKEN = 64  # + helper number: chunks that helper has run (one writer each)
MAX_HELPERS = 64
# More threads than this take `split`'s sleeping helpers: spinning helpers were measured
# at 2 threads only, and on a machine with more visible cores than it may use (a CPU
# quota) many spinning threads would crowd out the work.
MAX_THREADS = 4
# Job kinds: the matmul kernels by `kernels.BUILDERS` name, then attention.
KINDS = {"row": 0, "wide": 1, "tile": 2, "panel": 3}
ATTENTION, SAMPLING = len(KINDS), len(KINDS) + 1
# Idle rounds (an atomic load and a pause each, a `sched_yield` every YIELD_EVERY) before
# a helper sleeps: ~2 ms on a 2-core Zen 3 VM (RESULTS.md), longer than a decode step's
# gaps between kernels.
SPIN = 40_000
# Idle rounds between two `sched_yield` calls (any other thread wanting the core gets it).
YIELD_EVERY = 64
# The same for a caller waiting for its helpers' last chunks (rarer: each yield is a
# system call, ~1.5 us, that delays seeing the job done).
WAIT_YIELD_EVERY = 1024


def enabled() -> bool:
    return os.environ.get("APPO_CPU_TEAM", "1") != "0"


_ROW, _WIDE, _TILE, _PANEL = (kernels.kernel_for(kind) for kind in KINDS)
jit = numba.njit(nogil=True, cache=True)


@jit
def _chunk(ctl, fctl, kind, lo, hi):  # pragma: no cover - numba
    # One chunk of the published job, its arrays rebuilt from the fields.
    f = FIELDS
    if kind == ATTENTION:
        q = numba.carray(f32_at(ctl[f]), (ctl[f + 1], ctl[f + 2], ctl[f + 3]))
        out = numba.carray(f32_at(ctl[f + 4]), (ctl[f + 1], ctl[f + 2], ctl[f + 3]))
        buf = numba.carray(f32_at(ctl[f + 5]), (ctl[f + 6], ctl[f + 7], ctl[f + 8],
                                                 ctl[f + 9], ctl[f + 10], ctl[f + 11]))
        first = numba.carray(i64_at(ctl[f + 12]), (ctl[f + 1],))
        pk = numba.carray(f32_at(ctl[f + 13]), (ctl[f + 14], ctl[f + 15], ctl[f + 16]))
        pvt = numba.carray(f32_at(ctl[f + 17]), (ctl[f + 14], ctl[f + 27], ctl[f + 28]))
        if ctl[f + 18] == 0:
            attention.attend_units(q, buf, ctl[LAYER], first, ctl[LAST], pk, pvt, fctl[0],
                                   out, lo, hi)
            return
        rows = ctl[f + 1]  # with the step's rotary + cache write (`rope_attend`)
        attention.rope_attend_units(
            numba.carray(f32_at(ctl[f + 19]), (rows, ctl[f + 20])),
            numba.carray(f32_at(ctl[f + 21]), (rows, ctl[f + 3])),
            numba.carray(f32_at(ctl[f + 22]), (rows, ctl[f + 3])),
            numba.carray(f32_at(ctl[f + 23]), (ctl[f + 24],)),
            numba.carray(f32_at(ctl[f + 25]), (ctl[f + 26],)), fctl[4], q, buf, ctl[LAYER],
            first, ctl[LAST], pk, pvt, fctl[0], out, lo, hi)
        return
    if kind == SAMPLING:
        rows, vocab = ctl[f + 1], ctl[f + 2]
        sampling.sample_rows(
            numba.carray(f32_at(ctl[f]), (rows, vocab)),
            numba.carray(bool_at(ctl[f + 3]), (ctl[f + 4], ctl[f + 5])),
            fctl[1], fctl[2], ctl[f + 6], fctl[3], numba.carray(f64_at(ctl[f + 7]), (rows,)),
            numba.carray(f32_at(ctl[f + 8]), (ctl[f + 9], vocab)),
            numba.carray(f32_at(ctl[f + 10]), (rows, ctl[f + 11])),
            numba.carray(f64_at(ctl[f + 12]), (ctl[f + 13], ctl[f + 14])),
            numba.carray(i64_at(ctl[f + 15]), (rows,)), numba.carray(f32_at(ctl[f + 16]), (rows,)),
            numba.carray(f32_at(ctl[f + 17]), (rows,)), numba.carray(f32_at(ctl[f + 18]), (rows,)),
            lo, hi)
        return
    x = numba.carray(f32_at(ctl[f]), (ctl[f + 1], ctl[f + 2]))
    w = numba.carray(f32_at(ctl[f + 3]), (ctl[f + 4], ctl[f + 2]))
    out = numba.carray(f32_at(ctl[f + 5]), (ctl[f + 1], ctl[f + 4]))
    if kind == 0:
        _ROW(x, w, out, lo, hi)
    elif kind == 1:
        _WIDE(x, w, out, lo, hi)
    elif kind == 2:
        _TILE(x, w, out, lo, hi)
    else:  # `w` holds packed panels (`appo.rollout.cpu.panels`)
        _PANEL(x, w, out, lo, hi)


@jit
def _stall(ctl):  # pragma: no cover - numba
    # `ctl[STALL]` pause rounds: 0 outside the tests, which widen the races with it.
    for _ in range(ctl[STALL]):
        pause()


@jit
def _take_chunks(ctl, fctl, tag, me):  # pragma: no cover - numba
    # Chunks of job `tag` until none is left (or the job is no longer `tag`); `me`: the
    # helper's number, -1 for the caller.
    while True:
        # A compare-and-swap, not a fetch-add: a take that fails (another job, or none
        # left) must leave the counter as it was, or the current job would lose a chunk.
        taken = load(ctl, NEXT)
        i = taken & 0xFFFFFFFF
        if (taken >> 32) != tag or i >= ctl[CHUNKS]:
            return
        if not compare_exchange(ctl, NEXT, taken, taken + 1):
            continue
        # Taken while the counter still carried `tag`: the job is `tag`, and it cannot
        # finish (nor its fields change) before this chunk is done.
        bounds = numba.carray(i64_at(ctl[BOUNDS]), (ctl[CHUNKS] + 1,))
        _chunk(ctl, fctl, ctl[KIND], bounds[i], bounds[i + 1])
        if me >= 0:
            ctl[TAKEN + me] += 1
        fetch_add(ctl, DONE, 1)
        if me >= 0:
            _stall(ctl)  # tests only: a helper slow to come back for the next chunk


@jit
def _serve(ctl, fctl, me, seen, spin):  # pragma: no cover - numba
    # A helper's loop: returns the last sequence seen after `spin` idle rounds.
    idle = 0
    while True:
        tag = load(ctl, SEQ)
        if tag == seen:
            idle += 1
            if idle >= spin:
                return seen
            if idle % YIELD_EVERY == 0:
                sched_yield()
            pause()
            continue
        seen, idle = tag, 0
        _stall(ctl)  # tests only: a helper late to the job it saw
        if me < ctl[HELPERS]:
            _take_chunks(ctl, fctl, tag, me)


@jit
def _publish(ctl, kind, bounds, helpers):  # pragma: no cover - numba
    tag = ctl[SEQ] + 1
    exchange(ctl, NEXT, tag << 32)  # takes of the previous job fail from here on
    _stall(ctl)  # tests only: a caller slow to write the fields
    ctl[KIND], ctl[CHUNKS], ctl[BOUNDS] = kind, bounds.size - 1, bounds.ctypes.data
    ctl[HELPERS] = helpers
    return tag


@jit
def _lead(ctl, fctl, tag, count):  # pragma: no cover - numba
    # The caller's part: publish, take chunks, wait for the helpers' last ones.
    store(ctl, DONE, 0)
    store(ctl, SEQ, tag)
    _take_chunks(ctl, fctl, tag, -1)
    waited = 0
    while load(ctl, DONE) < count:
        waited += 1
        if waited % WAIT_YIELD_EVERY == 0:  # a helper preempted mid-chunk may need this core
            sched_yield()
        pause()


def _omp_body_py(data):  # pragma: no cover - numba (compiled below, `_omp_cfunc`)
    # Each OpenMP thread of the region (the caller included) takes chunks of the job.
    ctl = numba.carray(data, (TAKEN + MAX_HELPERS,), np.int64)
    fetch_add(ctl, ENTERED, 1)
    _take_chunks(ctl, numba.carray(f64_at(ctl[FCTL]), (1,)), load(ctl, SEQ), -1)


@jit
def _go(ctl, fctl, tag, count, omp_threads, body):  # pragma: no cover - numba
    # `omp_threads` > 0: the job as a parallel region of torch's OpenMP pool (`body` is
    # `_omp_body`'s address); it returns when every chunk is done. Else the team's helpers.
    if omp_threads > 0:
        ctl[FCTL] = fctl.ctypes.data
        store(ctl, DONE, 0)
        store(ctl, SEQ, tag)
        gomp_parallel(body, ctl.ctypes.data, omp_threads)
    else:
        _lead(ctl, fctl, tag, count)


@jit
def _matmul(ctl, fctl, bounds, helpers, omp_threads, body, kind, x, w,
            out):  # pragma: no cover - numba
    tag = _publish(ctl, kind, bounds, helpers)
    f = FIELDS
    ctl[f], ctl[f + 1], ctl[f + 2] = x.ctypes.data, x.shape[0], x.shape[1]
    ctl[f + 3], ctl[f + 4], ctl[f + 5] = w.ctypes.data, w.shape[0], out.ctypes.data
    _go(ctl, fctl, tag, bounds.size - 1, omp_threads, body)


@jit
def _attention(ctl, fctl, bounds, helpers, omp_threads, body, q, buf, layer, first, last,
               pk, pvt, scale, out, rope, qkv, cos, sin, q_norm, k_norm,
               eps):  # pragma: no cover - numba
    tag = _publish(ctl, ATTENTION, bounds, helpers)
    f = FIELDS
    ctl[LAYER], ctl[LAST] = layer, last
    fctl[0], fctl[4] = scale, eps
    ctl[f + 18], ctl[f + 19], ctl[f + 20] = rope, qkv.ctypes.data, qkv.shape[1]
    ctl[f + 21], ctl[f + 22] = cos.ctypes.data, sin.ctypes.data
    ctl[f + 23], ctl[f + 24] = q_norm.ctypes.data, q_norm.shape[0]
    ctl[f + 25], ctl[f + 26] = k_norm.ctypes.data, k_norm.shape[0]
    ctl[f], ctl[f + 1], ctl[f + 2], ctl[f + 3] = q.ctypes.data, q.shape[0], q.shape[1], q.shape[2]
    ctl[f + 4], ctl[f + 5] = out.ctypes.data, buf.ctypes.data
    for i in range(6):
        ctl[f + 6 + i] = buf.shape[i]
    ctl[f + 12], ctl[f + 13] = first.ctypes.data, pk.ctypes.data
    ctl[f + 14], ctl[f + 15], ctl[f + 16] = pk.shape[0], pk.shape[1], pk.shape[2]
    ctl[f + 17], ctl[f + 27], ctl[f + 28] = pvt.ctypes.data, pvt.shape[1], pvt.shape[2]
    _go(ctl, fctl, tag, bounds.size - 1, omp_threads, body)


@jit
def _sampling(ctl, fctl, bounds, helpers, omp_threads, body, x, s, penalty, temperature, k,
              top_p, uniforms, scratch, heaps, exps, ids, logp, ent,
              ent_top):  # pragma: no cover - numba
    tag = _publish(ctl, SAMPLING, bounds, helpers)
    f = FIELDS
    ctl[f], ctl[f + 1], ctl[f + 2] = x.ctypes.data, x.shape[0], x.shape[1]
    ctl[f + 3], ctl[f + 4], ctl[f + 5] = s.ctypes.data, s.shape[0], s.shape[1]
    ctl[f + 6], ctl[f + 7] = k, uniforms.ctypes.data
    ctl[f + 8], ctl[f + 9] = scratch.ctypes.data, scratch.shape[0]
    ctl[f + 10], ctl[f + 11] = heaps.ctypes.data, heaps.shape[1]
    ctl[f + 12], ctl[f + 13], ctl[f + 14] = exps.ctypes.data, exps.shape[0], exps.shape[1]
    ctl[f + 15], ctl[f + 16] = ids.ctypes.data, logp.ctypes.data
    ctl[f + 17], ctl[f + 18] = ent.ctypes.data, ent_top.ctypes.data
    fctl[1], fctl[2], fctl[3] = penalty, temperature, top_p
    _go(ctl, fctl, tag, bounds.size - 1, omp_threads, body)


JOBS = (_chunk, _stall, _take_chunks, _serve, _publish, _lead, _go, _matmul, _attention,
        _sampling)


def drop_stale_cache(jobs=JOBS, sources=(kernels.__file__, attention.__file__, vec.__file__,
                                         tiles.__file__, panels.__file__, sampling.__file__,
                                         atomics.__file__)) -> bool:
    """The jobs embed the kernels of `kernels.py`, `attention.py`, `tiles.py`, `panels.py`
    and `sampling.py` and the intrinsics of `atomics.py`: `cache.flush_stale` over those
    files (`_omp_cfunc` drops the OpenMP body's)."""
    return flush_stale(jobs, sources, "team")


def _omp_cfunc(stale: bool):
    """`_omp_body_py` as a C callback (`void (*)(void *)`), cached like the jobs: made here,
    after the stale check, because a `cfunc` compiles (or loads its cache) when made."""
    from numba.core import sigutils
    from numba.core.ccallback import CFunc

    sig = sigutils.normalize_signature(types.void(types.voidptr))
    body = CFunc(_omp_body_py, sig, locals={}, options={})
    body.enable_caching()
    if stale:
        body._cache.flush()
    body.compile()
    return body


_omp_body = _omp_cfunc(drop_stale_cache())


class Team:
    """The helper threads and their shared job record (one per process)."""

    def __init__(self):
        self.ctl = np.zeros(TAKEN + MAX_HELPERS, np.int64)
        self.fctl = np.zeros(5, np.float64)
        self.sleeping: list[bool] = []
        self.wake: list[threading.Event] = []
        self.busy = threading.Lock()
        # torch's OpenMP pool runs the jobs where this process has torch's libgomp.
        self.omp = OMP and omp.enabled()

    def _start(self, count: int) -> None:
        while len(self.wake) < count:
            me = len(self.wake)
            self.sleeping.append(False)
            self.wake.append(threading.Event())
            threading.Thread(target=self._loop, args=(me,), daemon=True,
                             name=f"appo-decode-team-{me + 1}").start()

    def _loop(self, me: int) -> None:
        seen = int(self.ctl[SEQ])
        while True:
            seen = _serve(self.ctl, self.fctl, me, seen, SPIN)
            self.sleeping[me] = True
            self.wake[me].wait()
            self.wake[me].clear()

    def _rouse(self, helpers: int) -> None:
        self._start(helpers)
        for me in range(helpers):
            if self.sleeping[me]:  # it misses this job; spinning again for the next
                self.sleeping[me] = False
                self.wake[me].set()

    def run(self, job, args: tuple, chunks: tuple[tuple[int, int], ...], threads: int) -> bool:
        """Run `job(ctl, fctl, bounds, helpers, *args)`; False (nothing run) when another
        Python thread is using the team, or for more than `MAX_THREADS` threads."""
        if threads > MAX_THREADS or not self.busy.acquire(blocking=False):
            return False
        try:
            if self.omp:  # torch's OpenMP pool; the team's helpers stay asleep
                job(self.ctl, self.fctl, _bounds(chunks), 0, threads, _omp_body.address,
                    *args)
            else:
                self._rouse(threads - 1)
                job(self.ctl, self.fctl, _bounds(chunks), threads - 1, 0, 0, *args)
        finally:
            self.busy.release()
        return True


_bounds_cache: dict[tuple, np.ndarray] = {}


def _bounds(chunks: tuple[tuple[int, int], ...]) -> np.ndarray:
    """`chunks` as int64 bounds `[len + 1]` (contiguous chunks), made once per chunking."""
    got = _bounds_cache.get(chunks)
    if got is None:
        got = np.array([chunks[0][0], *(hi for _, hi in chunks)], np.int64)
        if len(_bounds_cache) > 1024:
            _bounds_cache.clear()
        _bounds_cache[chunks] = got
    return got


_TEAM = Team()


def _reset_after_fork() -> None:  # threads do not survive a fork
    global _TEAM
    _TEAM = Team()


os.register_at_fork(after_in_child=_reset_after_fork)


def _plain(*arrays: np.ndarray) -> bool:
    return all(a.dtype == np.float32 and a.flags.c_contiguous for a in arrays)


_KIND_OF = {id(kernels.kernel_for(kind)): number for kind, number in KINDS.items()}


def run(kernel, x: np.ndarray, w: np.ndarray, out: np.ndarray, threads: int) -> None:
    """`split.run`: `kernel(x, w, out, lo, hi)` over all of `w`'s rows, split over `threads`
    threads (`split.column_chunks`), through the team where it applies (a numba matmul
    kernel, float32, C-contiguous), else through `split`."""
    chunks = split.column_chunks(int(w.shape[0]), int(w.shape[1]) * w.itemsize, threads)
    kind = _KIND_OF.get(id(kernel))
    if (len(chunks) > 1 and kind is not None and enabled() and _plain(x, w, out)
            and _TEAM.run(_matmul, (kind, x, w, out), chunks, threads)):
        return
    split.run(kernel, x, w, out, threads)


# `_attention`'s rope arguments when there is none (qkv, cos, sin, q_norm, k_norm, eps):
# the same array types as a real call, so the job keeps one compiled signature.
_NO_ROPE = (*(np.zeros((1, 1), np.float32),) * 3, *(np.zeros(0, np.float32),) * 2, 0.0)


def attend(args: tuple, units: tuple[tuple[int, int], ...], threads: int,
           rope: tuple | None = None) -> None:
    """`attention.attend_units(*args, lo, hi)` for every unit range of `units` (contiguous,
    in order), over `threads` threads: the team where it applies, else `split`. `rope`
    (`qkv, cos, sin, q_norm, k_norm, eps`): each unit first does its share of
    `attention.rope_write` (`attention.rope_attend_units`)."""
    q, buf, layer, first, last, pk, pvt, scale, out = args
    extra = _NO_ROPE if rope is None else rope
    if (len(units) > 1 and enabled() and _plain(q, buf, pk, pvt, out, *extra[:5])
            and first.dtype == np.int64 and first.flags.c_contiguous
            and _TEAM.run(_attention, (q, buf, int(layer), first, int(last), pk, pvt,
                                       float(scale), out, int(rope is not None),
                                       *extra[:5], float(extra[5])), units, threads)):
        return
    if rope is None:
        split.run_chunks(attention.attend_units, args, units, threads)
    else:
        split.run_chunks(attention.rope_attend_units, (*rope, *args), units, threads)


def sample_runner(kernel, args: tuple, units: tuple[tuple[int, int], ...],
                  threads: int) -> None:
    """`sampling.sample_numpy`'s `run`: `kernel(*args, lo, hi)` (`sampling.sample_rows`)
    for every row range of `units`, over `threads` threads: the team where it applies (the
    arrays as `sample_numpy` makes them), else `split`."""
    x, s, penalty, temperature, k, top_p, uniforms, scratch, heaps, exps, ids, logp, ent, \
        ent_top = args
    if (kernel is sampling.sample_rows and len(units) > 1 and enabled()
            and _plain(x, scratch, heaps, logp, ent, ent_top)
            and s.dtype == np.bool_ and uniforms.dtype == exps.dtype == np.float64
            and ids.dtype == np.int64
            and all(a.flags.c_contiguous for a in (s, uniforms, exps, ids))
            and _TEAM.run(_sampling, (x, s, float(penalty), float(temperature), int(k),
                                      float(top_p), uniforms, scratch, heaps, exps, ids, logp,
                                      ent, ent_top), units, threads)):
        return
    split.run_chunks(kernel, args, units, threads)


def warm() -> None:
    """Compile (or load from numba's cache) every job's signature, on small arrays: the
    tiny models of the tests never split a matmul or an attention."""
    x, w = np.zeros((2, 8), np.float32), np.zeros((96, 8), np.float32)
    out = np.empty((2, 96), np.float32)
    for kind in KINDS.values():
        _TEAM.run(_matmul, (kind, x, w, out), ((0, 48), (48, 96)), 2)
    q = np.ones((2, 2, 4), np.float32)
    buf = np.ones((1, 2, 2, 1, 3, 4), np.float32)
    pk, pvt = np.zeros((1, 0, 4), np.float32), np.zeros((1, 4, 0), np.float32)
    _TEAM.run(_attention, (q, buf, 0, np.zeros(2, np.int64), 0, pk, pvt, 0.5,
                           np.empty_like(q), 0, *_NO_ROPE[:5], 0.0), ((0, 1), (1, 1)), 2)
    # The helpers' loop, here rather than in whichever helper thread starts first (it
    # returns at once: no idle round allowed).
    _serve(_TEAM.ctl, _TEAM.fctl, 0, int(_TEAM.ctl[SEQ]), 0)
