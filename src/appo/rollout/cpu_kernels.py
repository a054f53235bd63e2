"""A float32 `x @ W^T` for decode steps on CPU (a few rows against a big weight), in numba.

At 8 rows a decode step's matmuls are neither bandwidth- nor compute-bound for MKL: its
small-M float32 GEMM runs at ~20 GFLOP/s on this project's machine (AMD Zen 3, AVX2, one
thread), a third of what the core does on cached data. This kernel walks the weight once,
one row at a time, and dots it with eight (then four, then single) input rows while it
stays in L1; LLVM vectorises the dot products (8 lanes). Measured on the same machine:
~30 GFLOP/s streaming the SmolLM2-135M weights at 8 rows, 1.56x MKL per decode step
(`benchmarks/decode_kernel.py`, figures in `benchmarks/RESULTS.md`).

Only the rollout engine's lean decoder uses it, never training; sums are reassociated
(`fastmath`), so results differ from MKL's in the last bits, like any other GEMM. numba is
optional: without it (or with `APPO_CPU_KERNELS=0`) `available()` is False and callers
use `torch.mm`.
"""

from __future__ import annotations

import os

import numpy as np
import torch
from torch import Tensor

try:  # optional dependency: the lean decoder falls back to MKL without it
    import numba
except ImportError:  # pragma: no cover - exercised on installs without numba
    numba = None

_kernel = None


def available() -> bool:
    return numba is not None and os.environ.get("APPO_CPU_KERNELS", "1") != "0"


def _build():
    @numba.njit(fastmath=True, boundscheck=False, nogil=True, cache=True)
    def rows_times_weight_t(x, w, out):  # pragma: no cover - compiled by numba
        m_rows, k_len = x.shape
        m8 = m_rows - m_rows % 8
        m4 = m_rows - m_rows % 4
        for n in range(w.shape[0]):
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


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """`F.linear(x, weight, bias)` on CPU, `x` `[..., K]`, `weight` `[N, K]` (float32, or
    float64 in tests); returns `[..., N]`, a new contiguous tensor."""
    global _kernel
    if _kernel is None:
        _kernel = _build()
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.empty((rows.shape[0], weight.shape[0]), dtype=x.dtype)
    _kernel(rows.detach().numpy(), weight.detach().numpy(), out.numpy())
    out = out if bias is None else out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])
