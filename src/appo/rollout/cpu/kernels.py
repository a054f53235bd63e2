"""Float32 `x @ W^T` for CPU decode steps (a few rows against a big weight), in numba.

A decode step multiplies one row per sequence by every weight matrix. MKL's small-M float32
GEMM streams the weights well below the memory bandwidth at such shapes; these kernels walk
the weight once and keep each weight row in L1 while every input row is dotted with it.
LLVM vectorises the dot products.

- `rows_times_weight_t` ("numba"): one weight row at a time against eight, then four, then
  single input rows.
- `weight_blocks_times_row_pairs` ("numba_wide"): eight weight rows against two input rows,
  16 accumulators. It needs 32 vector registers (AVX-512) to pay off: with AVX-512 the first
  kernel is load-bound past a few rows, reloading every input row for every weight row.
- `weight_triples_times_row_quads` ("numba_tile"): three weight rows against four input
  rows, 12 accumulators, 7 loads per 12 multiply-adds: it fits AVX2's 16 registers. At
  many rows the first kernel rereads every input row (too big for L1 past a few rows) for
  every weight row; this one rereads them a third as often.

Both compute the output columns `lo:hi` of one call; `linear` splits the columns over the
run's threads (`appo.rollout.cpu.split`), bit-identical to one call over all of them.

Which kernel (or MKL) a decode step runs is decided in `appo.rollout.cpu.matmuls`; timings
per CPU are in `benchmarks/RESULTS.md` (`benchmarks/decode_kernel.py`).

Only the rollout engine's lean decoder uses them, never training; sums are reassociated
(`fastmath`), so results differ from MKL's in the last bits, like any other GEMM. numba is
an optional extra (`pip install 'appo[cpu-kernels]'`): without it (or with
`APPO_CPU_KERNELS=0`) `available()` is False and decode steps use torch, only slower.
"""

from __future__ import annotations

import functools
import os
import weakref

import numpy as np
import torch
from torch import Tensor

from appo.rollout.cpu import split
from appo.rollout.cpu.cache import per_tensor

try:  # optional extra: the lean decoder falls back to torch without it
    import numba
except ImportError:  # pragma: no cover - exercised on installs without numba
    numba = None



def available() -> bool:
    return numba is not None and os.environ.get("APPO_CPU_KERNELS", "1") != "0"


def _build():
    @numba.njit(fastmath=True, boundscheck=False, nogil=True, cache=True)
    def rows_times_weight_t(x, w, out, lo, hi):  # pragma: no cover - compiled by numba
        # Output columns lo:hi (weight rows); each column's sum runs the same code whatever
        # the bounds, so splitting the columns over calls leaves every output unchanged.
        m_rows, k_len = x.shape
        m8 = m_rows - m_rows % 8
        m4 = m_rows - m_rows % 4
        for n in range(lo, hi):
            # One weight row at a time (read from memory once), against 8, then 4, then
            # single input rows: it stays in L1 for all of them.
            for m in range(0, m8, 8):
                a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = np.float32(0.0)
                for k in range(k_len):
                    wk = w[n, k]
                    a0 += x[m, k] * wk
                    a1 += x[m + 1, k] * wk
                    a2 += x[m + 2, k] * wk
                    a3 += x[m + 3, k] * wk
                    a4 += x[m + 4, k] * wk
                    a5 += x[m + 5, k] * wk
                    a6 += x[m + 6, k] * wk
                    a7 += x[m + 7, k] * wk
                out[m, n], out[m + 1, n], out[m + 2, n], out[m + 3, n] = a0, a1, a2, a3
                out[m + 4, n], out[m + 5, n], out[m + 6, n], out[m + 7, n] = a4, a5, a6, a7
            for m in range(m8, m4, 4):
                a0 = a1 = a2 = a3 = np.float32(0.0)
                for k in range(k_len):
                    wk = w[n, k]
                    a0 += x[m, k] * wk
                    a1 += x[m + 1, k] * wk
                    a2 += x[m + 2, k] * wk
                    a3 += x[m + 3, k] * wk
                out[m, n], out[m + 1, n], out[m + 2, n], out[m + 3, n] = a0, a1, a2, a3
            for m in range(m4, m_rows):
                a0 = np.float32(0.0)
                for k in range(k_len):
                    a0 += x[m, k] * w[n, k]
                out[m, n] = a0

    return rows_times_weight_t


def _build_wide():
    @numba.njit(fastmath=True, boundscheck=False, nogil=True, cache=True)
    def weight_blocks_times_row_pairs(x, w, out, lo, hi):  # pragma: no cover - numba
        # Eight weight rows against two input rows: 16 accumulators, 10 loads per 16
        # multiply-adds (the row-at-a-time kernel does 9 per 8). Needs 32 vector registers
        # (AVX-512); with 16 the accumulators spill. Output columns lo:hi; with lo a
        # multiple of 8 the blocks of 8 fall where a call over all columns puts them, so
        # each output runs the same code (`split.column_chunks` keeps that alignment).
        m_rows, k_len = x.shape
        n8 = hi - (hi - lo) % 8
        m2 = m_rows - m_rows % 2
        for n in range(lo, n8, 8):
            for m in range(0, m2, 2):
                a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = np.float32(0.0)
                b0 = b1 = b2 = b3 = b4 = b5 = b6 = b7 = np.float32(0.0)
                for k in range(k_len):
                    xa, xb = x[m, k], x[m + 1, k]
                    w0, w1, w2, w3 = w[n, k], w[n + 1, k], w[n + 2, k], w[n + 3, k]
                    w4, w5, w6, w7 = w[n + 4, k], w[n + 5, k], w[n + 6, k], w[n + 7, k]
                    a0 += xa * w0
                    a1 += xa * w1
                    a2 += xa * w2
                    a3 += xa * w3
                    a4 += xa * w4
                    a5 += xa * w5
                    a6 += xa * w6
                    a7 += xa * w7
                    b0 += xb * w0
                    b1 += xb * w1
                    b2 += xb * w2
                    b3 += xb * w3
                    b4 += xb * w4
                    b5 += xb * w5
                    b6 += xb * w6
                    b7 += xb * w7
                out[m, n], out[m, n + 1], out[m, n + 2], out[m, n + 3] = a0, a1, a2, a3
                out[m, n + 4], out[m, n + 5], out[m, n + 6], out[m, n + 7] = a4, a5, a6, a7
                out[m + 1, n], out[m + 1, n + 1], out[m + 1, n + 2] = b0, b1, b2
                out[m + 1, n + 3], out[m + 1, n + 4], out[m + 1, n + 5] = b3, b4, b5
                out[m + 1, n + 6], out[m + 1, n + 7] = b6, b7
            for m in range(m2, m_rows):
                for j in range(8):
                    a0 = np.float32(0.0)
                    for k in range(k_len):
                        a0 += x[m, k] * w[n + j, k]
                    out[m, n + j] = a0
        for n in range(n8, hi):
            for m in range(m_rows):
                a0 = np.float32(0.0)
                for k in range(k_len):
                    a0 += x[m, k] * w[n, k]
                out[m, n] = a0

    return weight_blocks_times_row_pairs


def _build_tile():
    @numba.njit(fastmath=True, boundscheck=False, nogil=True, cache=True)
    def weight_triples_times_row_quads(x, w, out, lo, hi):  # pragma: no cover - numba
        # Three weight rows against four input rows (12 accumulators; then three weight
        # rows against single input rows, then single weight rows). Output columns lo:hi;
        # with lo a multiple of 3 (`split.ALIGN`) the blocks of 3 fall where a call over
        # all columns puts them, so each output runs the same code.
        m_rows, k_len = x.shape
        n3 = hi - (hi - lo) % 3
        m4 = m_rows - m_rows % 4
        for n in range(lo, n3, 3):
            for m in range(0, m4, 4):
                a0 = a1 = a2 = b0 = b1 = b2 = np.float32(0.0)
                c0 = c1 = c2 = d0 = d1 = d2 = np.float32(0.0)
                for k in range(k_len):
                    w0, w1, w2 = w[n, k], w[n + 1, k], w[n + 2, k]
                    xa, xb, xc, xd = x[m, k], x[m + 1, k], x[m + 2, k], x[m + 3, k]
                    a0 += xa * w0
                    a1 += xa * w1
                    a2 += xa * w2
                    b0 += xb * w0
                    b1 += xb * w1
                    b2 += xb * w2
                    c0 += xc * w0
                    c1 += xc * w1
                    c2 += xc * w2
                    d0 += xd * w0
                    d1 += xd * w1
                    d2 += xd * w2
                out[m, n], out[m, n + 1], out[m, n + 2] = a0, a1, a2
                out[m + 1, n], out[m + 1, n + 1], out[m + 1, n + 2] = b0, b1, b2
                out[m + 2, n], out[m + 2, n + 1], out[m + 2, n + 2] = c0, c1, c2
                out[m + 3, n], out[m + 3, n + 1], out[m + 3, n + 2] = d0, d1, d2
            for m in range(m4, m_rows):
                a0 = a1 = a2 = np.float32(0.0)
                for k in range(k_len):
                    xa = x[m, k]
                    a0 += xa * w[n, k]
                    a1 += xa * w[n + 1, k]
                    a2 += xa * w[n + 2, k]
                out[m, n], out[m, n + 1], out[m, n + 2] = a0, a1, a2
        for n in range(n3, hi):
            for m in range(m_rows):
                a0 = np.float32(0.0)
                for k in range(k_len):
                    a0 += x[m, k] * w[n, k]
                out[m, n] = a0

    return weight_triples_times_row_quads


def _build_panel():
    from appo.rollout.cpu import panels  # LLVM IR intrinsics: imported with numba only

    return panels.build()


# Kernel kind -> its builder (numba compiles on the first call of each). "panel" takes
# weights packed by `appo.rollout.cpu.panels` (`linear_numpy` packs them).
BUILDERS = {"row": _build, "wide": _build_wide, "tile": _build_tile, "panel": _build_panel}
_built: dict[str, object] = {}


@functools.cache
def wide_registers() -> bool:
    """Whether the CPU numba compiles for has AVX-512 (32 vector registers); False
    without numba."""
    if numba is None:
        return False
    from appo.rollout.cpu.cpuinfo import numba_target_features

    return "avx512f" in numba_target_features()


def _weight_array(weight: Tensor) -> np.ndarray:
    """`weight` as a numpy array sharing its memory, made once per weight tensor: every
    `Tensor.numpy()` is five dispatched op calls, and a decode step passes each weight
    once. Kept while the tensor lives and still points at the same memory (a parameter
    whose `.data` was swapped gets a new array; in-place updates show through the view)."""
    return per_tensor(_arrays, weight, (weight.data_ptr(), tuple(weight.shape)),
                      lambda w: w.detach().numpy())


_arrays: dict[int, tuple[weakref.ref, tuple, np.ndarray]] = {}


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None,
           kind: str = "row", threads: int | None = None, run=None) -> Tensor:
    """`F.linear(x, weight, bias)` on CPU, `x` `[..., K]`, `weight` `[N, K]` (float32, or
    float64 in tests); returns `[..., N]`, a new contiguous tensor. `kind` picks the kernel
    (`BUILDERS`: "row", "wide" = 8 weight rows x 2 input rows, worth it only with AVX-512's
    32 registers, "tile" = 3 weight rows x 4 input rows, for many rows).
    `threads` (default: torch's thread count) split the output columns
    (`appo.rollout.cpu.split`); the result is bit-identical for any count. `run`: what
    splits them (`split.run`'s signature; default `split.run`)."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.from_numpy(linear_numpy(
        rows.detach().numpy() if rows.requires_grad else rows.numpy(), weight, None, kind,
        threads, run))
    out = out if bias is None else out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


def kernel_for(kind: str):
    """The compiled kernel of `kind` (`BUILDERS`), built once."""
    if kind not in _built:
        _built[kind] = BUILDERS[kind]()
    return _built[kind]


def linear_numpy(x: np.ndarray, weight: Tensor, bias: Tensor | None = None,
                 kind: str = "row", threads: int | None = None, run=None) -> np.ndarray:
    """`linear` on a contiguous `[M, K]` numpy array, returning a new `[M, N]` numpy array:
    the decode step of `appo.rollout.cpu.fused` keeps its activations in numpy, and each
    tensor <-> numpy conversion is several dispatched op calls."""
    # numpy's own empty array: `torch.empty(...).numpy()` costs five more op calls.
    out = np.empty((x.shape[0], weight.shape[0]), dtype=x.dtype)
    if kind == "panel":
        from appo.rollout.cpu import panels

        if panels.fits(weight) and x.dtype == np.float32:
            w = panels.packed(weight)
            x = np.ascontiguousarray(x)  # its microkernel reads rows at stride K
        else:  # float64 (tests) or N not a multiple of 16: the tile kernel, plain weights
            kind, w = "tile", _weight_array(weight)
    else:
        w = _weight_array(weight)
    (run or split.run)(kernel_for(kind), x, w, out,
                       torch.get_num_threads() if threads is None else threads)
    if bias is not None:
        out += _weight_array(bias)
    return out

