"""The per-layer work of a CPU decode step between its matmuls, in numba kernels.

A decode step of the lean forward in torch dispatches ~300 eager op calls per layer (rotary
as cat/neg/mul/add, the cache write, attention as batched matmuls + softmax + cat + mask,
RMSNorm decomposed), each from Python, each with its own pass over memory. Here each piece
is one kernel call on numpy views of the same memory:

- `rope_write`: the optional per-head RMSNorm (qwen3's q/k norms), rotary on the queries
  and the new keys, and the write of the new keys/values into the batch buffer
  (`[layers, 2, rows, kv_heads, capacity, head_dim]`, `hf_batch`) at the step's column.
  The fused step runs it inside the attention's units (`rope_attend_units`: each unit its
  rows' heads of its KV head, then its attention), so it splits over the threads too.
- `attend` (`attend_units`: the work units `lo:hi`, for a split over threads; a unit is
  one KV head x `ROWS_PER_UNIT` rows, fewer where that makes under `MIN_UNITS` units):
  decode attention for one layer, one query per row.
  Grouped-query aware: the query heads of one key/value head are handled together. A
  shared prefix (cascade) is two matmuls over every query of the unit (`tiles`: scores,
  then probabilities x values, on the prefix packed once per decode call), so
  each prefix key and value is read once per unit; each row's own columns follow as an
  online softmax over blocks of `BLOCK` columns (flash-decoding) on top of the prefix's
  max, sum and output, the row's query heads of one KV head together, a block's keys and
  values read once for all of them. In float32 with whole vectors per head (`_block_f32`)
  the scores run `vec.LANES` keys at a time and the probabilities x values keep the output
  in registers (`vec.qk`, `vec.pv_acc`); otherwise (float64 in the tests, odd head sizes)
  `_block`: the scores one `_dots`, probabilities x values four columns per pass. While a
  block is worked on, the same block of the unit's next row is prefetched (`prefetch`): a
  decode step's matmuls stream every weight through the caches between two layers'
  attention, so the cache is cold by then. Columns outside a row's `[first, last]` are
  never read (no mask tensor).
- `rms_norm`, `add_rms_norm` (the residual add fused with the next norm), `silu_mul`
  (SiLU(gate) x up).

Same math as the torch path up to float32 rounding (sums reassociated, `fastmath` without
the no-NaN/no-Inf assumptions); `tests/rollout/test_rollout_cpu_attention.py` checks them
against `LeanDecoder`'s torch code. It imports numba: only `fused` imports it, and only when
the kernels are available (`kernels.available()`); otherwise decode steps take the torch
path.
"""

from __future__ import annotations

import numpy as np

from appo.rollout.cpu import panels, tiles, vec
from appo.rollout.cpu.cache import flush_stale
from appo.rollout.cpu.tiles import pack_prefix, tiles_matmul
from appo.rollout.cpu.vec import (
    LANES,
    _exp_nonpositive,
    exp_nonpositive,
    jit,
    prefetch,
    pv_acc,
    qk,
)

# Columns per online-softmax block: each block rescales the running output once (128 ran
# faster than 64 with `vec`'s kernels; a block's keys are read 4 KB at a time either way).
BLOCK = 128
# Rows per work unit of `attend_units` (with one KV head): enough queries for the shared
# prefix's matmuls, few enough that a 2-core split has units to balance at 8+ rows.
ROWS_PER_UNIT = 8
# Fewer units than this (3 KV heads at 8 rows: 3 units, so one of 2 threads does two) and
# the rows per unit are halved, down to 2 (`rows_per_unit`).
MIN_UNITS = 4


# Module-level kernels (numba resolves the helpers they call as globals, so the on-disk
# cache finds them again in a new process; closures' captured helpers defeat it); `jit`:
# `vec.jit` (fastmath without the no-NaN/no-Inf assumptions, numpy's division).


@jit
def _rms_into(src, weight, eps, dst):  # pragma: no cover - numba
    # dst = rms_norm(src) * weight (qwen3's per-head q/k norms)
    d = src.shape[0]
    ss = src.dtype.type(0.0)
    for i in range(d):
        ss += src[i] * src[i]
    r = 1.0 / np.sqrt(ss / d + eps)
    for i in range(d):
        dst[i] = src[i] * r * weight[i]


@jit
def _rope(src, cos, sin, dst):  # pragma: no cover - numba
    # dst = rotary(src): rotate-half, each pair (i, i + d/2) read once.
    half = src.shape[0] // 2
    for i in range(half):
        a = src[i]
        b = src[i + half]
        dst[i] = a * cos[i] - b * sin[i]
        dst[i + half] = b * cos[i + half] + a * sin[i + half]


@jit
def _rope_rows(qkv, cos, sin, q_norm, k_norm, eps, buf, layer, col, q_out, r0, r1, g0,
               g1):  # pragma: no cover - numba
    # `rope_write` for rows r0:r1 and KV heads g0:g1 with their query heads. The norm or
    # not is decided per head outside the element loops: one helper branching on it per
    # call (with a scratch copy either way) ran 2-3x slower.
    heads, d = q_out.shape[1], q_out.shape[2]
    kv_heads = buf.shape[3]
    group = heads // kv_heads
    tmp = np.empty(d, qkv.dtype)
    normed_q = q_norm.shape[0] > 0
    normed_k = k_norm.shape[0] > 0
    for b in range(r0, r1):
        c, s = cos[b], sin[b]
        for g in range(g0, g1):
            for h in range(g * group, (g + 1) * group):
                src = qkv[b, h * d : (h + 1) * d]
                if normed_q:
                    _rms_into(src, q_norm, eps, tmp)
                    _rope(tmp, c, s, q_out[b, h])
                else:
                    _rope(src, c, s, q_out[b, h])
            lo = (heads + g) * d
            src = qkv[b, lo : lo + d]
            if normed_k:
                _rms_into(src, k_norm, eps, tmp)
                _rope(tmp, c, s, buf[layer, 0, b, g, col])
            else:
                _rope(src, c, s, buf[layer, 0, b, g, col])
            lo = (heads + kv_heads + g) * d
            dst = buf[layer, 1, b, g, col]
            for i in range(d):
                dst[i] = qkv[b, lo + i]


@jit
def rope_write(qkv, cos, sin, q_norm, k_norm, eps, buf, layer, col, q_out):  # pragma: no cover
    # qkv [B, (H + 2 KV) * d] (one decode step's packed projection); cos/sin [B, d];
    # q_norm/k_norm [d] or empty; rotated queries -> q_out [B, H, d]; rotated keys and
    # the values -> buf[layer, 0/1, b, kv_head, col].
    _rope_rows(qkv, cos, sin, q_norm, k_norm, eps, buf, layer, col, q_out, 0, q_out.shape[0],
               0, buf.shape[3])


@jit
def _block(qg, keys, values, c0, n, scale, sct, probs, m, s, acc, nk, nv, nc, nn):  # pragma: no cover
    # Online softmax over columns c0:c0+n for the G query heads `qg` [G, d] of one KV head
    # (grouped-query attention: each key and value read once for all G): running max
    # `m` [G, 1], sum `s` [G, 1] and unnormalised output `acc` [G, d], rescaled when the max
    # grows. `sct` [BLOCK, G] and `probs` [G, BLOCK] are scratch. The block after this one
    # (keys `nk` and values `nv`, columns nc:nc+nn) is prefetched along the way.
    groups, d = qg.shape
    _dots(keys[c0 : c0 + n], qg, sct[:n])  # sct[j, g] = keys[c0 + j] . qg[g]
    for g in range(groups):
        p = probs[g]
        top = m[g, 0]
        for j in range(n):
            p[j] = sct[j, g] * scale
            top = max(top, p[j])
        alpha = np.exp(m[g, 0] - top)
        for j in range(n):
            p[j] -= top
        _exp_nonpositive(p, n)
        total = s[g, 0] * alpha
        for j in range(n):
            total += p[j]
        for i in range(d):
            acc[g, i] *= alpha
        m[g, 0] = top
        s[g, 0] = total
    # probs x values, four columns per pass over `acc` (one load and store of `acc` per
    # four multiply-adds, not per one).
    n4 = n - n % 4
    line = 64 // nk.itemsize
    plo, phi = nc * d, (nc + nn) * d  # the next block in the flat keys / values
    step = 4 * d
    for j in range(0, n4, 4):
        for i in range(plo + j * d, min(plo + j * d + step, phi), line):
            prefetch(nk, i)
            prefetch(nv, i)
        v0, v1, v2, v3 = values[c0 + j], values[c0 + j + 1], values[c0 + j + 2], values[c0 + j + 3]
        for g in range(groups):
            p0, p1, p2, p3 = probs[g, j], probs[g, j + 1], probs[g, j + 2], probs[g, j + 3]
            a = acc[g]
            for i in range(d):
                a[i] += (p0 * v0[i] + p1 * v1[i]) + (p2 * v2[i] + p3 * v3[i])
    for i in range(plo + n4 * d, phi, line):
        prefetch(nk, i)
        prefetch(nv, i)
    for j in range(n4, n):
        v = values[c0 + j]
        for g in range(groups):
            pj = probs[g, j]
            for i in range(d):
                acc[g, i] += pj * v[i]


@jit
def _block_f32(qg, keys, values, c0, n, scale, probs, kpad, m, s, acc, nk, nv, nc,
               nn):  # pragma: no cover - numba
    # `_block` for float32 with d a multiple of `vec.LANES`, on `vec`'s microkernels: the
    # scores `LANES` keys at a time (`qk`; a last partial group through `kpad` [LANES, d],
    # zero-padded), then the probabilities times the values with the output in registers
    # (`pv_acc`). The next row's block (`nk` / `nv`, columns nc:nc+nn) is prefetched: its
    # keys beside the scores of the same columns, its values inside `pv_acc`.
    groups, d = qg.shape
    pst = probs.shape[1]
    nw = n - n % LANES
    qa, pa, ka = qg.ctypes.data, probs.ctypes.data, keys.ctypes.data + c0 * d * 4
    plo, phi = nc * d, (nc + nn) * d
    for j in range(0, n, LANES):
        for i in range(plo + j * d, min(plo + (j + LANES) * d, phi), 16):
            prefetch(nk, i)
        src = ka + j * d * 4
        if j >= nw:
            kpad[: n - nw] = keys[c0 + nw : c0 + n]
            kpad[n - nw :] = 0.0
            src = kpad.ctypes.data
        for g in range(groups):
            qk(qa + g * d * 4, src, pa + (g * pst + j) * 4, d)
    for g in range(groups):
        p = probs[g]
        top = m[g, 0]
        for j in range(n):
            p[j] *= scale
            top = max(top, p[j])
        alpha = exp_nonpositive(m[g, 0] - top)
        for j in range(n):
            p[j] -= top
        _exp_nonpositive(p, n)
        total = s[g, 0] * alpha
        for j in range(n):
            total += p[j]
        for i in range(d):
            acc[g, i] *= alpha
        m[g, 0] = top
        s[g, 0] = total
    va = values.ctypes.data + c0 * d * 4
    pv_acc(pa, pst, va, d, acc.ctypes.data, acc.strides[0] // 4, groups, n,
           nv.ctypes.data + nc * d * 4 if nn > 0 else va)


@jit
def _dots(a, b, out):  # pragma: no cover - numba
    # out[m, n] = sum_k a[m, k] * b[n, k] (a [M, K], b [N, K], both rows contiguous): three
    # rows of b against four of a, 12 accumulators (AVX2's 16 registers), the k loop
    # vectorised; the same blocking for every call, so an output's sum never depends on
    # which rows were computed with it.
    m_rows, k_len = a.shape
    n_rows = b.shape[0]
    zero = a.dtype.type(0.0)
    n3 = n_rows - n_rows % 3
    m4 = m_rows - m_rows % 4
    for n in range(0, n3, 3):
        for m in range(0, m4, 4):
            a0 = a1 = a2 = b0 = b1 = b2 = c0 = c1 = c2 = d0 = d1 = d2 = zero
            for k in range(k_len):
                w0, w1, w2 = b[n, k], b[n + 1, k], b[n + 2, k]
                xa, xb, xc, xd = a[m, k], a[m + 1, k], a[m + 2, k], a[m + 3, k]
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
            a0 = a1 = a2 = zero
            for k in range(k_len):
                xa = a[m, k]
                a0 += xa * b[n, k]
                a1 += xa * b[n + 1, k]
                a2 += xa * b[n + 2, k]
            out[m, n], out[m, n + 1], out[m, n + 2] = a0, a1, a2
    for n in range(n3, n_rows):
        for m in range(m_rows):
            a0 = zero
            for k in range(k_len):
                a0 += a[m, k] * b[n, k]
            out[m, n] = a0


@jit
def rows_per_unit(rows, kv_heads):  # pragma: no cover - numba
    # ROWS_PER_UNIT, halved while that makes fewer than MIN_UNITS units (down to 2).
    per = ROWS_PER_UNIT
    while per > 2 and kv_heads * -(-rows // per) < MIN_UNITS:
        per //= 2
    return per


def units(rows: int, kv_heads: int) -> int:
    """How many work units `attend_units` splits a layer's attention into."""
    return kv_heads * -(-rows // rows_per_unit(rows, kv_heads))


@jit
def attend_units(q, buf, layer, first, last, pk, pvt, scale, out, lo, hi):  # pragma: no cover
    # q [B, H, d] -> out [B, H, d] for the work units lo:hi: unit u is KV head
    # u // blocks and rows per * (u % blocks) onwards (per = `rows_per_unit`). Row b attends to the
    # shared prefix pk [KV, P', d] / pvt [KV, d', P] (`pack_prefix`'s panels; P may be 0)
    # and to its own columns first[b]..last of the buffer. Units share nothing and each
    # computes its outputs the same way whatever else runs, so any split of the units over
    # calls (threads) is bit-identical.
    rows, heads, d = q.shape
    kv_heads = buf.shape[3]
    group = heads // kv_heads
    prefix, width, d_pad = pvt.shape[2], pk.shape[1], max(d, pvt.shape[1])
    per = rows_per_unit(rows, kv_heads)
    blocks = -(-rows // per)
    nq = per * group
    qa = np.empty((nq, d), q.dtype)
    # Scratch with contiguous rows (numba vectorises `_dots` only over C-layout slices).
    ps = np.empty((nq, width), q.dtype)
    sct = np.empty((BLOCK, group), q.dtype)
    probs = np.empty((group, BLOCK), q.dtype)
    acc = np.empty((nq, d_pad), q.dtype)
    kpad = np.empty((LANES, d), q.dtype)
    # float32 heads of whole vectors take `vec`'s microkernels (`_block_f32`).
    f32 = q.itemsize == 4 and d % LANES == 0
    m = np.empty((nq, 1), q.dtype)
    s = np.empty((nq, 1), q.dtype)
    for u in range(lo, hi):
        g, r0 = u // blocks, per * (u % blocks)
        r1 = min(rows, r0 + per)
        n = (r1 - r0) * group
        # The shared prefix as two small matmuls over every query of the unit: scores,
        # then (after the softmax's exp) probabilities times the values.
        for b in range(r0, r1):
            for j in range(group):
                qa[(b - r0) * group + j] = q[b, g * group + j]
        if prefix > 0:
            tiles_matmul(qa, n, d, pk[g], ps, width)
            for qi in range(n):
                row = ps[qi]
                for j in range(prefix):
                    row[j] *= scale
                top = row[0]
                for j in range(1, prefix):
                    top = max(top, row[j])
                for j in range(prefix):
                    row[j] -= top
                _exp_nonpositive(row, prefix)
                total = q.dtype.type(0.0)
                for j in range(prefix):
                    total += row[j]
                m[qi, 0], s[qi, 0] = top, total
            tiles_matmul(ps, n, prefix, pvt[g], acc, pvt.shape[1])
        else:
            m[:n] = -np.inf
            s[:n] = 0.0
            acc[:n] = 0.0
        # Each row's own columns, online softmax in blocks on top of the prefix's state,
        # the row's query heads of this KV head together.
        for b in range(r0, r1):
            keys, values = buf[layer, 0, b, g], buf[layer, 1, b, g]
            q0, q1 = (b - r0) * group, (b - r0 + 1) * group
            for c0 in range(first[b], last + 1, BLOCK):
                # Prefetched meanwhile: the next row's block at the same place (one row's
                # work ahead; none after the unit's last row).
                nb = min(b + 1, r1 - 1)
                nc = c0 - first[b] + first[nb]
                nn = 0 if b + 1 >= r1 else max(0, min(BLOCK, last + 1 - nc))
                cols = min(BLOCK, last + 1 - c0)
                nk, nv = buf[layer, 0, nb, g].reshape(-1), buf[layer, 1, nb, g].reshape(-1)
                if f32:
                    _block_f32(qa[q0:q1], keys, values, c0, cols, scale, probs, kpad,
                               m[q0:q1], s[q0:q1], acc[q0:q1], nk, nv, nc, nn)
                else:
                    _block(qa[q0:q1], keys, values, c0, cols, scale, sct, probs, m[q0:q1],
                           s[q0:q1], acc[q0:q1], nk, nv, nc, nn)
            for j in range(group):
                qi = q0 + j
                inv = 1.0 / s[qi, 0]
                h = g * group + j
                for i in range(d):
                    out[b, h, i] = acc[qi, i] * inv


@jit
def rope_attend_units(qkv, cos, sin, q_norm, k_norm, eps, q, buf, layer, first, last, pk, pvt,
                      scale, out, lo, hi):  # pragma: no cover - numba
    # `rope_write` then `attend_units` for the work units lo:hi: each unit first rotates
    # its rows' queries of its KV head and writes that head's new key and value (column
    # `last`), then attends. The units cover every (row, head) once and read only what
    # they wrote, so the rotary work splits over the threads with the attention, bit for
    # bit as `rope_write` over all rows followed by `attend_units`.
    rows, kv_heads = q.shape[0], buf.shape[3]
    per = rows_per_unit(rows, kv_heads)
    blocks = -(-rows // per)
    for u in range(lo, hi):
        g, r0 = u // blocks, per * (u % blocks)
        _rope_rows(qkv, cos, sin, q_norm, k_norm, eps, buf, layer, last, q, r0,
                   min(rows, r0 + per), g, g + 1)
    attend_units(q, buf, layer, first, last, pk, pvt, scale, out, lo, hi)


def attend(q, buf, layer, first, last, pk, pv, scale, out) -> None:
    """`attend_units` over every unit in one call, the shared prefix given as its keys and
    values `[KV, P, d]`."""
    attend_units(q, buf, layer, first, last, *pack_prefix(pk, pv), scale, out, 0,
                 units(q.shape[0], buf.shape[3]))


@jit
def rms_norm(x, weight, eps, out):  # pragma: no cover - numba
    rows, width = x.shape
    for b in range(rows):
        ss = x.dtype.type(0.0)
        for i in range(width):
            ss += x[b, i] * x[b, i]
        r = 1.0 / np.sqrt(ss / width + eps)
        for i in range(width):
            out[b, i] = x[b, i] * r * weight[i]

@jit
def add_rms_norm(h, delta, weight, eps, out):  # pragma: no cover - numba
    # h += delta (the residual, in place), out = rms_norm(h) * weight.
    rows, width = h.shape
    for b in range(rows):
        for i in range(width):
            h[b, i] += delta[b, i]
    rms_norm(h, weight, eps, out)

@jit
def silu_mul(gate_up, out):  # pragma: no cover - numba
    # out = silu(gate) * up, gate_up = [gate | up] along the last axis. silu(g) = g / (1 +
    # e^-g), with e = e^-|g| from the vectorised exp (numba's np.exp is a scalar libm call
    # per element, in float64 for a float32 g): g / (1 + e) for g >= 0, g e / (1 + e) below.
    rows, width = out.shape
    e = np.empty(width, out.dtype)
    one = out.dtype.type(1.0)
    for b in range(rows):
        for i in range(width):
            e[i] = -abs(gate_up[b, i])
        _exp_nonpositive(e, width)
        for i in range(width):
            g = gate_up[b, i]
            s = one / (one + e[i])
            out[b, i] = g * (s if g >= 0 else e[i] * s) * gate_up[b, width + i]


# The kernels embed `tiles`' matmul, `panels`' and `vec`'s microkernels: numba's cache of them is
# dropped when those files change too (it checks only this one).
flush_stale((rope_write, _block, _block_f32, _dots, rows_per_unit, attend_units,
             rope_attend_units, rms_norm, add_rms_norm, silu_mul),
            (__file__, tiles.__file__, panels.__file__, vec.__file__), "attention")
