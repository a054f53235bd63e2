"""Small float32 matmuls on a register-blocked microkernel, for the decode attention's
shared prefix (`attention.attend_units`).

A unit of decode attention multiplies its queries (a few dozen rows) by a shared prefix's
keys, then the probabilities by its values. As dot products along the head dimension (64)
every output ends in a horizontal sum; here the right-hand matrix is packed once per decode
call into panels of `TILE` columns (`pack_prefix`) and `panels`' microkernel keeps up to
6 rows x `TILE` outputs in vector registers over the whole sum, no horizontal sum. Its
vectors are 16 floats where LLVM targets AVX-512 (with 8 the kernel ran no faster than
the dot products there: `benchmarks/HISTORY.md`, "a register-blocked prefix"), else 8.
Each output is one chain of multiply-adds over k from 0, whichever rows share a call:
any split of the rows gives the same bits.
"""

from __future__ import annotations

import numba
import numpy as np

from appo.rollout.cpu import panels
from appo.rollout.cpu.cache import flush_stale

TILE_LANES = panels.LANES
TILE = 2 * TILE_LANES  # columns per panel
_T1, _T2, _T3, _T4, _T5, _T6 = (panels._microkernel(r, TILE_LANES) for r in range(1, 7))


@numba.njit(boundscheck=False, nogil=True, cache=True)
def tiles_matmul(x, m_rows, k_len, wp, out, n_cols):  # pragma: no cover - numba
    # out[:m_rows, :n_cols] = x[:m_rows, :k_len] @ W^T, W `[n_cols, k_len]` held in `wp` as
    # panels `[n_cols / TILE, k_len, TILE]` (`pack_prefix`); k_len >= 1. float32: the
    # microkernel on up to 6 rows at a time (balanced blocks, as `panels`), each output one
    # chain of multiply-adds over k from 0, whichever rows share a call. float64 (tests):
    # the same sums in loops.
    flat = wp.reshape(-1)
    if x.itemsize == 8:
        for m in range(m_rows):
            for c in range(n_cols):
                base = (c // TILE) * k_len * TILE + c % TILE
                total = 0.0
                for k in range(k_len):
                    total += x[m, k] * flat[base + k * TILE]
                out[m, c] = total
        return
    xs, os_ = x.shape[1], out.shape[1]
    blocks = (m_rows + 5) // 6
    size, extra = m_rows // blocks, m_rows % blocks
    xa, wa, oa = x.ctypes.data, flat.ctypes.data, out.ctypes.data
    for p in range(n_cols // TILE):
        pa = wa + p * k_len * TILE * 4
        m0 = 0
        for b in range(blocks):
            r = size + (1 if b < extra else 0)
            xo, oo = xa + m0 * xs * 4, oa + (m0 * os_ + p * TILE) * 4
            if r == 6:
                _T6(xo, xs, pa, oo, os_, k_len)
            elif r == 5:
                _T5(xo, xs, pa, oo, os_, k_len)
            elif r == 4:
                _T4(xo, xs, pa, oo, os_, k_len)
            elif r == 3:
                _T3(xo, xs, pa, oo, os_, k_len)
            elif r == 2:
                _T2(xo, xs, pa, oo, os_, k_len)
            else:
                _T1(xo, xs, pa, oo, os_, k_len)
            m0 += r


def pack_prefix(pk: np.ndarray, pv: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A shared prefix's keys and values (`[KV, P, d]` each) as `attend_units` reads them,
    in `TILE`-wide panels for `_tiles`: keys `[KV, P', d]` holding `[KV, P' / TILE, d,
    TILE]` (P' = P rounded up to whole panels, zeros past P), values `[KV, d', P]` holding
    `[KV, d' / TILE, P, TILE]` (d' likewise). Made once per shared prefix (a decode call)."""
    kv, p, d = pk.shape
    pp, dp = -(-p // TILE) * TILE, -(-d // TILE) * TILE
    keys = np.zeros((kv, pp, d), pk.dtype)
    keys[:, :p] = pk
    values = np.zeros((kv, p, dp), pv.dtype)
    values[:, :, :d] = pv
    keys = keys.reshape(kv, pp // TILE, TILE, d).transpose(0, 1, 3, 2)
    values = values.reshape(kv, p, dp // TILE, TILE).transpose(0, 2, 1, 3)
    return (np.ascontiguousarray(keys).reshape(kv, pp, d),
            np.ascontiguousarray(values).reshape(kv, dp, p))



flush_stale((tiles_matmul,), (__file__, panels.__file__), "tiles")
