"""The per-layer work of a CPU decode step between its matmuls, in numba kernels.

A decode step of the lean forward in torch dispatches ~300 eager op calls per layer (rotary
as cat/neg/mul/add, the cache write, attention as batched matmuls + softmax + cat + mask,
RMSNorm decomposed), each from Python, each with its own pass over memory. Here each piece
is one kernel call on numpy views of the same memory:

- `rope_write`: the optional per-head RMSNorm (qwen3's q/k norms), rotary on the queries
  and the new keys, and the write of the new keys/values into the batch buffer
  (`[layers, 2, rows, kv_heads, capacity, head_dim]`, `hf_batch`) at the step's column.
- `attend` (`attend_heads`: the KV heads `lo:hi`, for a split over threads): decode
  attention for one layer, one query per row. Grouped-query aware: the
  query heads of one key/value head are handled together, so each cached key and value is
  read once per KV head (and, under a shared prefix, once for all rows); an online softmax
  over blocks of `BLOCK` columns (flash-decoding), so no score matrix is materialised.
  Columns outside a row's `[first, last]` are never read (no mask tensor: left padding and
  unwritten columns are skipped, not multiplied by zero).
- `rms_norm`, `add_rms_norm` (the residual add fused with the next norm), `silu_mul`
  (SiLU(gate) x up).

Same math as the torch path up to float32 rounding (sums reassociated, `fastmath` without
the no-NaN/no-Inf assumptions); `tests/rollout/test_rollout_cpu_attention.py` checks them
against `LeanDecoder`'s torch code. It imports numba: only `fused` imports it, and only when
the kernels are available (`kernels.available()`); otherwise decode steps take the torch
path.
"""

from __future__ import annotations

import numba
import numpy as np

BLOCK = 32  # columns per online-softmax block: a block of keys/values stays in L1
# Reassociation and contraction only: `attend` starts each running max at -inf.
FAST = {"reassoc", "contract", "arcp", "nsz", "afn"}
# Module-level kernels (numba resolves the helpers they call as globals, so the on-disk
# cache finds them again in a new process; closures' captured helpers defeat it).
jit = numba.njit(fastmath=FAST, boundscheck=False, nogil=True, cache=True)


@jit
def _norm_rope(src, weight, eps, cos, sin, dst):  # pragma: no cover - numba
    # dst = rotary(rms_norm(src) * weight), or rotary(src) when weight is empty.
    d = src.shape[0]
    half = d // 2
    tmp = np.empty(d, src.dtype)
    if weight.shape[0] > 0:
        ss = src.dtype.type(0.0)
        for i in range(d):
            ss += src[i] * src[i]
        r = 1.0 / np.sqrt(ss / d + eps)
        for i in range(d):
            tmp[i] = src[i] * r * weight[i]
    else:
        for i in range(d):
            tmp[i] = src[i]
    for i in range(half):
        dst[i] = tmp[i] * cos[i] - tmp[i + half] * sin[i]
    for i in range(half, d):
        dst[i] = tmp[i] * cos[i] + tmp[i - half] * sin[i]

@jit
def rope_write(qkv, cos, sin, q_norm, k_norm, eps, buf, layer, col, q_out):  # pragma: no cover
    # qkv [B, (H + 2 KV) * d] (one decode step's packed projection); cos/sin [B, d];
    # q_norm/k_norm [d] or empty; rotated queries -> q_out [B, H, d]; rotated keys and
    # the values -> buf[layer, 0/1, b, kv_head, col].
    rows, heads, d = q_out.shape
    kv_heads = buf.shape[3]
    for b in range(rows):
        for h in range(heads):
            _norm_rope(qkv[b, h * d : (h + 1) * d], q_norm, eps, cos[b], sin[b],
                       q_out[b, h])
        for g in range(kv_heads):
            lo = (heads + g) * d
            _norm_rope(qkv[b, lo : lo + d], k_norm, eps, cos[b], sin[b],
                       buf[layer, 0, b, g, col])
            lo = (heads + kv_heads + g) * d
            for i in range(d):
                buf[layer, 1, b, g, col, i] = qkv[b, lo + i]

@jit
def _exp_nonpositive(x, n, bits):  # pragma: no cover - numba
    # x[:n] = exp(x[:n]) for x <= 0, in a loop LLVM vectorises (numba's np.exp is a scalar
    # libm call per element, most of the kernel's time): Cephes' expf, range reduction
    # x = k ln2 + r, a degree-6 polynomial in r, 2^k built in the exponent bits. ~1 ulp
    # (torch's softmax uses Sleef's, also ~1 ulp). x below -87 counts as -87 (e^-87 ~
    # 1.6e-38, nothing next to the block's largest term, e^0 = 1).
    if x.itemsize == 8:  # float64 (tests): numba's exact exp
        for j in range(n):
            x[j] = np.exp(x[j])
        return
    scale2 = bits.view(np.float32)
    for j in range(n):
        v = max(x[j], np.float32(-87.0))
        k = np.floor(v * np.float32(1.44269504) + np.float32(0.5))
        r = v - k * np.float32(0.693359375) + k * np.float32(2.12194440e-4)
        p = np.float32(1.9875691500e-4)
        p = p * r + np.float32(1.3981999507e-3)
        p = p * r + np.float32(8.3334519073e-3)
        p = p * r + np.float32(4.1665795894e-2)
        p = p * r + np.float32(1.6666665459e-1)
        p = p * r + np.float32(5.0000001201e-1)
        x[j] = p * r * r + r + np.float32(1.0)
        bits[j] = (np.int32(k) + np.int32(127)) << np.int32(23)
    for j in range(n):
        x[j] *= scale2[j]


@jit
def _block(q, keys, values, c0, n, scale, scores, bits, m, s, acc):  # pragma: no cover
    # Online softmax over columns c0:c0+n of one (row, head): running max `m[0]`, sum
    # `s[0]` and unnormalised output `acc`, rescaled when the max grows.
    d = q.shape[0]
    top = m[0]
    for j in range(n):
        dot = q.dtype.type(0.0)
        for i in range(d):
            dot += q[i] * keys[c0 + j, i]
        scores[j] = dot * scale
        top = max(top, scores[j])
    alpha = np.exp(m[0] - top)
    for j in range(n):
        scores[j] -= top
    _exp_nonpositive(scores, n, bits)
    total = s[0] * alpha
    for i in range(d):
        acc[i] *= alpha
    for j in range(n):
        p = scores[j]
        total += p
        for i in range(d):
            acc[i] += p * values[c0 + j, i]
    m[0] = top
    s[0] = total

@jit
def _shared_block(qt, keys, values, c0, n, scale, scores, bits, m, s, acc, top):  # pragma: no cover
    # `_block` for the many queries that read the shared prefix (every row's query heads
    # of one KV head, `qt` [d, nq] transposed): the scores are computed with the queries
    # as the vector lanes (each key element broadcast once), so the block's keys and
    # values are read once for all of them.
    d, nq = qt.shape
    sc = scores[: n * nq].reshape((n, nq))
    for j in range(n):
        for qi in range(nq):
            sc[j, qi] = 0.0
        for i in range(d):
            kv = keys[c0 + j, i]
            for qi in range(nq):
                sc[j, qi] += qt[i, qi] * kv
    top[:] = m
    for j in range(n):
        for qi in range(nq):
            sc[j, qi] *= scale
            top[qi] = max(top[qi], sc[j, qi])
    for j in range(n):
        for qi in range(nq):
            sc[j, qi] -= top[qi]
    _exp_nonpositive(scores, n * nq, bits)
    for qi in range(nq):
        alpha = np.exp(m[qi] - top[qi])
        total = s[qi] * alpha
        for i in range(d):
            acc[qi, i] *= alpha
        for j in range(n):
            p = sc[j, qi]
            total += p
            for i in range(d):
                acc[qi, i] += p * values[c0 + j, i]
        m[qi] = top[qi]
        s[qi] = total


@jit
def attend_heads(q, buf, layer, first, last, pk, pv, scale, out, lo, hi):  # pragma: no cover
    # q [B, H, d] -> out [B, H, d] for the query heads of KV heads lo:hi. Row b attends to
    # the shared prefix pk/pv [KV, P, d] (P may be 0) and to its own columns
    # first[b]..last of the buffer. KV heads share nothing, so any split of 0:KV over
    # calls (threads) computes every output with the same code: bit-identical.
    rows, heads, d = q.shape
    kv_heads = buf.shape[3]
    group = heads // kv_heads
    prefix = pk.shape[1]
    m = np.full((rows, heads, 1), -np.inf, q.dtype)
    s = np.zeros((rows, heads, 1), q.dtype)
    nq = rows * group
    scores = np.empty(BLOCK * max(nq, 1), q.dtype)
    bits = np.empty(BLOCK * max(nq, 1), np.int32)
    qt = np.empty((d, nq), q.dtype)
    mg, sg, top = np.empty(nq, q.dtype), np.empty(nq, q.dtype), np.empty(nq, q.dtype)
    acc = np.empty((nq, d), q.dtype)
    for g in range(lo, hi):
        # The shared prefix: each block of keys/values read once for every row's queries.
        for b in range(rows):
            for j in range(group):
                for i in range(d):
                    qt[i, b * group + j] = q[b, g * group + j, i]
        mg[:] = -np.inf
        sg[:] = 0.0
        acc[:] = 0.0
        for c0 in range(0, prefix, BLOCK):
            _shared_block(qt, pk[g], pv[g], c0, min(BLOCK, prefix - c0), scale, scores,
                          bits, mg, sg, acc, top)
        for b in range(rows):
            for j in range(group):
                h = g * group + j
                m[b, h, 0], s[b, h, 0] = mg[b * group + j], sg[b * group + j]
                out[b, h] = acc[b * group + j]
        # Each row's own columns: each block read once for the query heads of this KV head.
        for b in range(rows):
            keys, values = buf[layer, 0, b, g], buf[layer, 1, b, g]
            for c0 in range(first[b], last + 1, BLOCK):
                n = min(BLOCK, last + 1 - c0)
                for h in range(g * group, (g + 1) * group):
                    _block(q[b, h], keys, values, c0, n, scale, scores, bits, m[b, h],
                           s[b, h], out[b, h])
        for b in range(rows):
            for h in range(g * group, (g + 1) * group):
                inv = 1.0 / s[b, h, 0]
                for i in range(d):
                    out[b, h, i] *= inv


@jit
def attend(q, buf, layer, first, last, pk, pv, scale, out):  # pragma: no cover - numba
    # Every KV head in one call.
    attend_heads(q, buf, layer, first, last, pk, pv, scale, out, 0, buf.shape[3])


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
    # out = silu(gate) * up, gate_up = [gate | up] along the last axis.
    rows, width = out.shape
    for b in range(rows):
        for i in range(width):
            g = gate_up[b, i]
            out[b, i] = g / (1.0 + np.exp(-g)) * gate_up[b, width + i]
