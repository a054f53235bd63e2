"""A decode matmul kernel over every thread the run is given: the output columns (weight
rows) cut into chunks that the calling thread and `threads - 1` helper threads take in turn.

A decode step's matmuls stream every weight once for a few rows; one thread leaves the
other cores idle. The numba kernels release the GIL, so plain Python threads run them in
parallel. Why not numba's `parallel=True`: its threading layer here is OpenMP (TBB is
rarely installed), and numba loads the system's libgomp next to torch's own, so two OpenMP
pools spin on the same cores; and a static split waits for its slowest thread, which on a
shared machine is the one another job has preempted. Here helpers sleep on a queue (no
spinning between matmuls) and take chunks as they come free, so a late or preempted
helper costs at most the chunk it holds, and a matmul too small to be worth a wake-up is
finished by the caller before the helper arrives.

Exactness: a chunk computes whole output columns with the same kernel code as a call over
all columns, so every output keeps its summation order: results are bit-identical for any
thread count, chunking or timing (rollouts stay deterministic per seed).

Chunks start at multiples of `ALIGN` weight rows (a multiple of every kernel's block
height: 8 for the wide kernel, 3 for the tile kernel, 16 or 32 for the panel kernel). A
matrix under `SPLIT_MIN_BYTES` of weights is not split; larger ones get up to
`CHUNKS_PER_THREAD` chunks per thread, none under `CHUNK_MIN_BYTES`. The helpers are
rebuilt in a forked child (threads do not survive a fork); a second Python thread calling
in while the helpers are busy runs its matmul alone, unsplit.

The decode step's numba matmuls and attention go through `appo.rollout.cpu.team` instead
(the same chunks, handed to spinning helpers without a wake-up); this queue serves the
other kernels (the sampling kernel, float64 tests) and `APPO_CPU_TEAM=0`.
"""

from __future__ import annotations

import functools
import itertools
import os
import queue
import threading
from collections.abc import Callable

ALIGN = 96
# Below these the wake-up of a helper (tens of microseconds) and the per-chunk dispatch
# cost more than the second core gains; measured with benchmarks/decode_kernel.py.
SPLIT_MIN_BYTES = 256 * 1024
CHUNK_MIN_BYTES = 128 * 1024
CHUNKS_PER_THREAD = 4


@functools.lru_cache(maxsize=256)
def column_chunks(columns: int, row_bytes: int, threads: int) -> tuple[tuple[int, int], ...]:
    """`(lo, hi)` bounds covering `0:columns` in order, `lo` a multiple of `ALIGN`; one chunk
    when `threads` is 1 or the weights (`columns * row_bytes`) are too small to split."""
    total = columns * row_bytes
    if threads <= 1 or total < SPLIT_MIN_BYTES or columns <= ALIGN:
        return ((0, columns),)
    blocks = -(-columns // ALIGN)
    min_blocks = -(-CHUNK_MIN_BYTES // (ALIGN * row_bytes))
    # Every thread gets a chunk even where that makes them small: the matrix is worth
    # splitting (over SPLIT_MIN_BYTES), and an idle core gains nothing.
    count = max(min(threads * CHUNKS_PER_THREAD, blocks // min_blocks), min(threads, blocks))
    bounds = [min(columns, blocks * i // count * ALIGN) for i in range(count + 1)]
    return tuple(itertools.pairwise(bounds))


class _Job:
    """One matmul's chunks, taken by whichever thread asks next."""

    __slots__ = ("kernel", "args", "chunks", "taken", "finished", "done", "error")

    def __init__(self, kernel: Callable, args: tuple, chunks: tuple[tuple[int, int], ...]):
        self.kernel, self.args, self.chunks = kernel, args, chunks
        self.taken = itertools.count()  # next() on it is atomic under the GIL
        self.finished: list[int] = []
        self.done = threading.Event()
        self.error: BaseException | None = None

    def work(self) -> None:
        total = len(self.chunks)
        while (i := next(self.taken)) < total:
            try:
                self.kernel(*self.args, *self.chunks[i])
            except BaseException as exc:  # handed to the caller, which re-raises it
                self.error = exc
            self.finished.append(i)
            # The thread finishing the last chunk sees the full list; an earlier one may
            # see it too and set the event twice, which is harmless.
            if len(self.finished) == total:
                self.done.set()


class _Helpers:
    def __init__(self):
        self.queues: list[queue.SimpleQueue] = []
        self.busy = threading.Lock()

    def _start(self, count: int) -> None:
        while len(self.queues) < count:
            jobs: queue.SimpleQueue = queue.SimpleQueue()
            threading.Thread(target=self._serve, args=(jobs,), daemon=True,
                             name=f"appo-decode-matmul-{len(self.queues) + 1}").start()
            self.queues.append(jobs)

    @staticmethod
    def _serve(jobs: queue.SimpleQueue) -> None:
        while True:
            jobs.get().work()  # a job whose chunks are all taken returns at once

    def run(self, kernel: Callable, args: tuple, chunks: tuple[tuple[int, int], ...],
            threads: int) -> None:
        if len(chunks) == 1 or not self.busy.acquire(blocking=False):
            for lo, hi in chunks:
                kernel(*args, lo, hi)
            return
        try:
            self._start(threads - 1)
            job = _Job(kernel, args, chunks)
            for jobs in self.queues[: threads - 1]:
                jobs.put(job)
            job.work()
            job.done.wait()
            if job.error is not None:
                raise job.error
        finally:
            self.busy.release()


_HELPERS = _Helpers()


def _reset_after_fork() -> None:
    global _HELPERS
    _HELPERS = _Helpers()


os.register_at_fork(after_in_child=_reset_after_fork)


def run_chunks(kernel: Callable, args: tuple, chunks: tuple[tuple[int, int], ...],
               threads: int) -> None:
    """`kernel(*args, lo, hi)` for every `(lo, hi)` of `chunks`, over `threads` threads (the
    caller's included): for kernels whose chunks share nothing (the fused decode step's
    attention, chunked by KV head)."""
    _HELPERS.run(kernel, args, chunks, threads)


def run(kernel: Callable, x, w, out, threads: int) -> None:
    """`kernel(x, w, out, lo, hi)` over all of `w`'s rows (`out`'s columns), split over
    `threads` threads (the caller's included)."""
    chunks = column_chunks(int(w.shape[0]), int(w.shape[1]) * w.itemsize, threads)
    _HELPERS.run(kernel, (x, w, out), chunks, threads)
