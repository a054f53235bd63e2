"""One decode step's sampling (`appo.rollout.sampling.sample`) for CPU float32 logits, in numba.

The torch path dispatches dozens of op calls per decode step over `[B, V]` (penalty,
temperature, masks, log-softmax, exp, float64 cumsum, searchsorted, gather, two entropies,
top-k), most of them a pass over the vocabulary (counts: `benchmarks/engines_profile.py`,
figures in `benchmarks/RESULTS.md`). Here one kernel call (plus the uniforms' `torch.rand`)
does a row in two passes over its `V` logits plus a block of a third, and with top-p
a sort of the values top-k kept (all of them without top-k, as the torch path sorts).
Rows are work units split over the run's threads (`appo.rollout.cpu.split`); they share
nothing, so the split changes no bit:

1. `z = penalty(x) / temperature` (float32 division, as torch's), kept in a scratch row;
   the largest `max(top_k, TOPK_ENTROPY_K)` values in a small min-heap (its largest is the
   row's max). Without a penalty the row goes in blocks of `SCAN_BLOCK`: `z` and a count
   of values above the heap's least in one vectorised loop, the heap pushes only in blocks
   that have one (the heap ends as element by element).
   Top-k keeps `z >= kth largest` (ties at the k-th value kept, as `logits < kth` masks).
   Top-p keeps `z >= t`, `t` found by sorting the still-kept values ascending and applying
   transformers' rule (drop the tail whose cumulative mass, float64 sums of float32
   probabilities as torch's cumsum, is `<= 1 - top_p`; the best token always stays). So
   both masks are one lower bound `lo` on `z`.
2. `e = float32(exp(z - max))` for kept tokens (0 for the others), stored; `S = sum e` and
   `A = sum e (z - max)` in float64, per block of `EXP_BLOCK` logits in `SUM_WIDTH`
   interleaved partial sums (`vec.lane_sums`, vectorised; the same order on every vector
   width) added pairwise, then the blocks' sums in order (kept: the draw's index). The
   float64 exp is a polynomial LLVM vectorises (`_exp_block`, over blocks of `EXP_BLOCK`
   logits), within ~1e-14 of libm's, so `e`
   rounds to the same float32 but in the rarest cases. Then `log Z = max + log S`, the entropy
   `H = log S - A / S` (`-sum p log p` with `p = e / S`), the chosen token's log-prob
   `z[id] - log Z`, and the top-k entropy proxy from the heap's `TOPK_ENTROPY_K` values.
3. The draw: the same uniform `r` per row as the torch path (one `torch.rand((B, 1),
   generator, float64)` call, so the generator's stream is unchanged), and the first token
   whose float64 running sum of `e` exceeds `r * S`: the torch path's inverse CDF
   (`searchsorted(cdf, r * cdf[-1], right=True)`) on the same distribution, scaled by `S`.
   The running sum goes over the blocks' sums to the block where it passes `r * S`, then
   token by token inside it (where rounding leaves that walk short: the block's last kept
   token; at `r * S = S`: the row's last kept token, where torch clamps to the last id).

Greedy (`temperature <= 0`): the first argmax of the penalised logits, log-prob and both
entropies 0 (as torch's point mass gives, -0.0 included), no uniform drawn.

Deviations from the torch path: none intended. Sums run in another order (float64 here), so
log-probs and entropies agree to float32 rounding (the torch path's float32 log-softmax is
the less exact one). A sampled id can differ only where `r` falls within that rounding of a
CDF step: the torch path's float32 probabilities carry relative rounding noise that no other
summation reproduces bit for bit (the measured agreement: `benchmarks/RESULTS.md`, "CPU
sampling kernel"). Likewise top-p's boundary token where
its cumulative mass is within float32 rounding of `1 - top_p`; and at an exact tie of
values at the top-p boundary every tied token is kept, where torch keeps those its unstable
sort puts last.
`tests/rollout/test_rollout_cpu_sampling.py` checks it against the torch path. It imports
numba: the hf engine imports it only when the kernels are available
(`appo.rollout.cpu.kernels.available()`; off with `APPO_CPU_SAMPLING=0` or
`HFEngine(cpu_sampling=False)`).
"""

from __future__ import annotations

import ctypes

import numba
import numpy as np
import torch
from torch import Tensor

from appo.rollout.cpu import panels, split, vec
from appo.rollout.cpu.cache import flush_stale
from appo.rollout.cpu.vec import SUM_WIDTH, lane_sums
from appo.rollout.sampling import TOPK_ENTROPY_K, SamplingParams

# Reassociation would let LLVM reorder the float64 sums, so the draw's running sum and `S`
# could disagree; plain IEEE math keeps them the same sum (and -inf logits well-defined).
jit = numba.njit(fastmath=False, boundscheck=False, nogil=True, cache=True)
_NO_SEEN = np.zeros((1, 0), np.bool_)  # no penalty: a row of nothing
EXP_BLOCK = 2048  # logits per exp block: its float64 scratch (16 KB) stays in L1
SCAN_BLOCK = 64  # logits per block of the first pass (`_scan_row`)
EXP_WORK = 2 * EXP_BLOCK + 2 * SUM_WIDTH  # a row's float64 work space before its blocks' sums
_C_TYPES = {torch.float32: ctypes.c_float, torch.float64: ctypes.c_double,
            torch.bool: ctypes.c_bool}


def _view(t: Tensor) -> np.ndarray:
    """A numpy view of contiguous CPU tensor `t`'s memory, made without dispatching an op
    (`Tensor.numpy()` is four op calls: detach, to, resolve_conj, resolve_neg). Only used
    while `t` is referenced by the caller: the view does not keep it alive."""
    raw = (_C_TYPES[t.dtype] * t.numel()).from_address(t.data_ptr())
    return np.ctypeslib.as_array(raw).reshape(tuple(t.shape))


@jit
def _heap_push(heap, v):  # pragma: no cover - numba
    # Min-heap of the largest values seen: replace the root (the smallest kept) by v.
    n = heap.shape[0]
    heap[0] = v
    i = 0
    while True:
        c = 2 * i + 1
        if c >= n:
            break
        if c + 1 < n and heap[c + 1] < heap[c]:
            c += 1
        if heap[c] >= heap[i]:
            break
        heap[i], heap[c] = heap[c], heap[i]
        i = c


@jit
def _transform(x, seen_row, use_seen, penalty, temperature, i):  # pragma: no cover
    # Repetition penalty (CTRL, as transformers) then temperature, in float32 like torch.
    v = x[i]
    if use_seen and seen_row[i]:
        v = v / penalty if v > 0 else v * penalty
    return v / temperature


@jit
def _top_p_bound(z, lo, thr, cand):  # pragma: no cover - numba
    # Lowest value transformers' top-p keeps among z >= lo: sort them ascending, drop while
    # the cumulative mass (float64 sums of float32 probabilities, as torch) is <= thr.
    n = 0
    for i in range(z.shape[0]):
        if z[i] >= lo and z[i] > -np.inf:
            cand[n] = z[i]
            n += 1
    if n == 0:
        return lo
    vals = np.sort(cand[:n])
    mx = vals[n - 1]
    total = 0.0
    for i in range(n):
        total += np.exp(np.float64(vals[i]) - mx)
    cum = 0.0
    for i in range(n - 1):  # the best token always stays
        cum += np.float32(np.exp(np.float64(vals[i]) - mx) / total)
        if np.float32(cum) > thr:
            return vals[i]
    return vals[n - 1]


@jit
def _exp_block(d, n):  # pragma: no cover - numba
    # d[:n] = exp(d[:n]) for float64 d <= 0 (NaN-free), in a loop LLVM vectorises (numba's
    # np.exp is a scalar libm call per element: most of a row's time before). x = k ln2 + r
    # (ln2 in two parts, Cody-Waite), |r| <= ln2 / 2, e^r by its Taylor series to r^12
    # (relative error < 1e-14), 2^k written into the exponent bits. Its result rounded to
    # float32 equals libm's exp rounded to float32 but where the exact value lies within
    # ~1e-14 of a float32 rounding boundary. d below -700 counts as -700: e^-700 is 0 in
    # float32 either way.
    bits = d.view(np.int64)
    for j in range(n):
        x = max(d[j], -700.0)
        k = np.floor(x * 1.4426950408889634 + 0.5)
        r = (x - k * 0.6931471803691238) - k * 1.9082149292705877e-10
        p = 1.0 / 479001600.0
        p = p * r + 1.0 / 39916800.0
        p = p * r + 1.0 / 3628800.0
        p = p * r + 1.0 / 362880.0
        p = p * r + 1.0 / 40320.0
        p = p * r + 1.0 / 5040.0
        p = p * r + 1.0 / 720.0
        p = p * r + 1.0 / 120.0
        p = p * r + 1.0 / 24.0
        p = p * r + 1.0 / 6.0
        p = p * r + 0.5
        p = p * r + 1.0
        d[j] = p * r + 1.0
        # via int32 (AVX2 converts float64 vectors to int32, not to int64)
        bits[j] = bits[j] + (np.int64(np.int32(k)) << np.int64(52))


@jit
def _argmax_row(x, seen_row, use_seen, pen):  # pragma: no cover - numba
    # Greedy: the first argmax of the penalised logits.
    best, bv = 0, -np.inf
    for i in range(x.shape[0]):
        v = _transform(x, seen_row, use_seen, pen, np.float32(1.0), i)
        if v > bv:
            best, bv = i, v
    return best


@jit
def _scan_row(x, seen_row, use_seen, pen, temp, z, heap):  # pragma: no cover - numba
    # Pass 1: z = transform(x) and the largest values in `heap`; returns the max (the
    # heap's largest: it holds the row's top values). Without a penalty, blocks of
    # SCAN_BLOCK: z and a count of values above the heap's least in one loop LLVM
    # vectorises; only a block with such a value is walked again, pushing as the
    # element-wise loop did (the least only rises, so a block with no value above it at
    # its start had none to push). The heap ends the same as element by element.
    heap[:] = -np.inf
    vocab = x.shape[0]
    if use_seen:
        for i in range(vocab):
            v = _transform(x, seen_row, True, pen, temp, i)
            z[i] = v
            if v > heap[0]:
                _heap_push(heap, v)
        return heap.max()
    for b0 in range(0, vocab, SCAN_BLOCK):
        # Slices, not `x[b0 + i]`: LLVM vectorised the loop over a slice, not over an
        # offset range (~6x slower).
        xs, zs = x[b0 : b0 + SCAN_BLOCK], z[b0 : b0 + SCAN_BLOCK]
        least = heap[0]
        above = 0
        for i in range(xs.shape[0]):
            v = xs[i] / temp  # `_transform` without a penalty
            zs[i] = v
            above += v > least
        if above:
            for i in range(zs.shape[0]):
                if zs[i] > heap[0]:
                    _heap_push(heap, zs[i])
    return heap.max()


@jit
def _exp_row(z, lo, mf, block, terms, sums, partial):  # pragma: no cover - numba
    # Pass 2: z <- float32(exp(z - max)) where kept (z >= lo), else 0; returns (S, A) and
    # each block's sum of e in `sums` (the draw's index). A block's e and its entropy terms
    # are summed in SUM_WIDTH interleaved float64 partial sums (`lane_sums`: the same
    # order whatever the vector width), added as a balanced tree (`_tree`); S and A are
    # the blocks' sums added in order.
    width = block.shape[0]
    s = 0.0
    a = 0.0
    for b in range(sums.shape[0]):
        zs = z[b * width : (b + 1) * width]
        n = zs.shape[0]
        for j in range(n):  # a loop LLVM vectorises, exp included (`_exp_block`)
            block[j] = np.float64(zs[j]) - mf
        _exp_block(block, n)
        for j in range(n):
            v = zs[j]
            keep = v >= lo and v > -np.inf
            e = np.float32(block[j]) if keep else np.float32(0.0)
            zs[j] = e
            block[j] = e
            terms[j] = e * (np.float64(v) - mf) if keep else 0.0
        padded = -(-n // SUM_WIDTH) * SUM_WIDTH
        block[n:padded] = 0.0
        terms[n:padded] = 0.0
        partial[:] = 0.0
        lane_sums(block.ctypes.data, terms.ctypes.data, padded, partial.ctypes.data)
        bs = _tree(partial[:SUM_WIDTH])
        sums[b] = bs
        s += bs
        a += _tree(partial[SUM_WIDTH:])
    return s, a


@jit
def _tree(p):  # pragma: no cover - numba
    # p's values (a power of two of them) added pairwise, neighbours first.
    n = p.shape[0]
    t = p.copy()
    while n > 1:
        n //= 2
        for i in range(n):
            t[i] = t[2 * i] + t[2 * i + 1]
    return t[0]


@jit
def _draw_row(z, u, sums, width):  # pragma: no cover - numba
    # Pass 3 (partial): the inverse CDF. The block whose sum takes the running sum (of the
    # blocks' sums, in order: S's own sum) past u, then the first token in it whose running
    # sum exceeds u. Rounding can leave that walk short of u (its sums run in another order
    # than the block's): then the block's last kept token.
    cum = 0.0
    vocab = z.shape[0]
    for b in range(sums.shape[0]):
        if cum + sums[b] > u:
            last = -1
            for i in range(b * width, min((b + 1) * width, vocab)):
                if z[i] > 0:
                    last = i
                cum += z[i]
                if cum > u:
                    return i
            if last >= 0:
                return last
        cum += sums[b]
    for i in range(vocab - 1, -1, -1):  # u at S (r within rounding of 1): the last kept
        if z[i] > 0:
            return i
    return vocab - 1


@jit
def sample_rows(logits, seen, penalty, temperature, top_k, top_p, uniforms, scratch, heaps,
                exps, ids, logp, ent, ent_top, lo_row, hi_row):  # pragma: no cover - numba
    """Rows `lo_row:hi_row` of `logits` `[B, V]` float32 -> `ids`, `logp`, `ent`, `ent_top`
    `[B]`. `seen` `[B, V]` bool (or `[1, 0]`: no penalty), `uniforms` `[B]` float64,
    `scratch` `[B, V]` float32, `heaps` `[B, H]` float32 and `exps` `[B, EXP_WORK + ceil(V / W)]`
    float64 work space (`H` = `max(top_k, TOPK_ENTROPY_K)` clipped to `V`; `W` =
    `EXP_BLOCK`: the exp block, its entropy terms, the partial sums, the blocks' sums).
    `temperature <= 0`: greedy. Each pass over the vocabulary is its own function: in
    one function body, numba/LLVM compiled the passes' loops ~15x slower."""
    vocab = logits.shape[1]
    use_seen = seen.shape[1] > 0 and penalty != 1.0
    pen = np.float32(penalty)
    temp = np.float32(temperature)
    k_on = 0 < top_k < vocab
    thr = np.float32(1.0 - top_p)
    n_top = min(TOPK_ENTROPY_K, vocab)
    for r in range(lo_row, hi_row):
        x = logits[r]
        seen_row = seen[r] if use_seen else seen[0]
        if temperature <= 0:
            ids[r], logp[r], ent[r], ent_top[r] = _argmax_row(x, seen_row, use_seen, pen), \
                0.0, -0.0, -0.0
            continue
        z = scratch[r]
        m = _scan_row(x, seen_row, use_seen, pen, temp, z, heaps[r])
        top = np.sort(heaps[r])[::-1]  # descending
        lo = top[top_k - 1] if k_on else np.float32(-np.inf)
        if top_p < 1.0:
            lo = max(lo, _top_p_bound(z, lo, thr, x.copy()))
        mf = np.float64(m)
        work = exps[r]
        sums = work[2 * EXP_BLOCK + 2 * SUM_WIDTH :]
        s, a = _exp_row(z, lo, mf, work[:EXP_BLOCK], work[EXP_BLOCK : 2 * EXP_BLOCK], sums,
                        work[2 * EXP_BLOCK : 2 * EXP_BLOCK + 2 * SUM_WIDTH])
        log_s = np.log(s)
        log_z = mf + log_s
        ent[r] = log_s - a / s
        h_top = np.float32(0.0)
        for j in range(n_top):
            if top[j] >= lo and top[j] > -np.inf:
                lp = np.float32(np.float64(top[j]) - log_z)
                p = np.exp(lp)
                if p > 0:
                    h_top -= p * lp
        ent_top[r] = h_top
        chosen = _draw_row(z, uniforms[r] * s, sums, EXP_BLOCK)
        ids[r] = chosen
        v = _transform(x, seen_row, use_seen, pen, temp, chosen)
        logp[r] = np.float64(v) - log_z if v >= lo else -np.inf


def sample_numpy(logits: Tensor, params: SamplingParams, generator: torch.Generator | None,
                 seen: Tensor | None = None, threads: int | None = None, run=None
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """`appo.rollout.sampling.sample` on CPU float32 `logits` `[B, V]` (`seen`: `[B, V]`
    bool); returns numpy arrays `[B]` (ids int64, log-prob / entropy / top-k entropy
    float32): the decode loop only reads them as lists. `run(kernel, args, units,
    threads)` splits the rows over the threads: `split.run_chunks` by default; the hf
    engine passes `team.sample_runner` (the rows on the team or torch's OpenMP pool)."""
    # One array layout (C-contiguous) and one set of argument types: a single compiled
    # signature, which `appo.rollout.cpu.warm` puts into numba's on-disk cache.
    logits = logits if logits.is_contiguous() else logits.contiguous()
    x = _view(logits)
    rows, vocab = x.shape
    greedy = params.greedy
    # The torch path's one draw per row (none when greedy), so the stream stays the same.
    drawn = None if greedy else torch.rand((rows, 1), generator=generator, dtype=torch.float64)
    uniforms = np.zeros(rows) if drawn is None else _view(drawn).reshape(rows)
    use_seen = seen is not None and params.repetition_penalty != 1.0
    if use_seen and not seen.is_contiguous():
        seen = seen.contiguous()
    s = _view(seen) if use_seen else _NO_SEEN
    k = int(params.top_k)
    width = min(max(k if 0 < k < vocab else 0, TOPK_ENTROPY_K), vocab)
    scratch = np.empty((0, vocab) if greedy else (rows, vocab), np.float32)
    heaps = np.empty((rows, width), np.float32)
    exps = np.empty((0, 0) if greedy else (rows, EXP_WORK + -(-vocab // EXP_BLOCK)))
    ids = np.empty(rows, np.int64)
    logp, ent, ent_top = (np.empty(rows, np.float32) for _ in range(3))
    args = (x, s, float(params.repetition_penalty), float(params.temperature), k,
            float(params.top_p), uniforms, scratch, heaps, exps, ids, logp, ent, ent_top)
    threads = torch.get_num_threads() if threads is None else threads
    units = tuple((r, r + 1) for r in range(rows)) if threads > 1 and rows > 1 else ((0, rows),)
    (run or split.run_chunks)(sample_rows, args, units, threads)
    return ids, logp, ent, ent_top


def sample(logits: Tensor, params: SamplingParams, generator: torch.Generator | None = None,
           seen: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """`sample_numpy` as tensors `[B]`: the signature of `appo.rollout.sampling.sample`."""
    return tuple(torch.from_numpy(a) for a in sample_numpy(logits, params, generator, seen))


# `_exp_row` (and `sample_rows`, which calls it) embed `vec.lane_sums`, built with
# `panels.open_loop`.
flush_stale((_exp_row, sample_rows), (__file__, vec.__file__, panels.__file__), "sampling")
