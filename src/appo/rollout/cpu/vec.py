"""Float32 vector pieces of the CPU decode attention (`appo.rollout.cpu.attention`), in numba
and LLVM IR: a prefetch hint, a bit reinterpretation, a vectorised exp, and the two
microkernels a row's own columns run on; and `lane_sums`, the float64 column sums of the
sampling kernel (`appo.rollout.cpu.sampling`).

A row's own keys and values (`[columns, d]`, each row contiguous) are read once per decode
step and never reused, so each score should cost a few multiply-adds, not a horizontal sum:

- `qk`: the scores of `LANES` consecutive keys against one query. Per key a chain of
  fused multiply-adds over the head dimension in `LANES`-float vectors (lane i sums
  elements i, i + LANES, ...), then one reduction tree for all `LANES` keys at once (pairs
  of vectors folded by halves, `log2(LANES)` levels of shuffles and adds) instead of a
  horizontal sum per key. The keys are read in memory order, a whole row at a time.
- `pv`: `acc[g] += sum_j p[g, j] * values[j]` for up to 3 query heads of one KV head over
  `n` columns, the output (up to 4 `LANES`-float vectors per head) held in registers for
  the whole sum: one chain of fused multiply-adds per output element, over j in order.

`LANES` is 16 where LLVM targets AVX-512, else 8 (AVX2's 16 registers: `pv` then takes 2
heads at a time). Each score and each output element is computed the same way whichever
rows, blocks or threads ran beside it, so splits of the work stay bit-identical; the sums
run in another order than the dot products of `attention._dots` (float32 rounding,
`docs/algorithms.md`).
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from appo.rollout.cpu.panels import open_loop as _open_loop
from appo.rollout.cpu.panels import prefetch_line as _prefetch_line
from appo.rollout.cpu.panels import vector_ops as _vector_ops
from appo.rollout.cpu.tiles import TILE_LANES

LANES = TILE_LANES
PV_GROUPS = 3 if LANES == 16 else 2  # heads per `pv` call: 4 x heads accumulators in registers
PV_VECTORS = 4  # LANES-float vectors of the output per `pv` call
# Reassociation and contraction only: `attend` starts each running max at -inf.
FAST = {"reassoc", "contract", "arcp", "nsz", "afn"}
# `error_model="numpy"`: a float division is IEEE's (inf/NaN on zero). Python's model
# (numba's default) checks every divisor for zero, which keeps a loop with a division
# from vectorising: SiLU's loop ran ~4x slower.
jit = numba.njit(fastmath=FAST, boundscheck=False, nogil=True, cache=True,
                 error_model="numpy")


@intrinsic
def prefetch(typingctx, arr, idx):
    """A hint to bring the cache line holding `arr[idx]` (a 1-D array) into the caches (LLVM's
    `llvm.prefetch`: a read, into L2 and outer levels): no result, never a fault, nothing
    where the target has no prefetch instruction."""
    def codegen(context, builder, sig, args):
        ptr = cgutils.get_item_pointer(context, builder, sig.args[0],
                                       context.make_array(sig.args[0])(context, builder,
                                                                       args[0]), [args[1]])
        _prefetch_line(builder, builder.bitcast(ptr, ir.IntType(8).as_pointer()))
        return context.get_dummy_value()
    return types.void(arr, idx), codegen


@intrinsic
def f32_from_bits(typingctx, bits):
    """The float32 whose bit pattern is the int32 `bits` (LLVM's `bitcast`, which vectorises;
    numba has no scalar reinterpretation)."""
    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.int32), codegen


@jit
def _exp_nonpositive(x, n):  # pragma: no cover - numba
    # x[:n] = exp(x[:n]) for x <= 0, in a loop LLVM vectorises (numba's np.exp is a scalar
    # libm call per element, most of the kernel's time): Cephes' expf, range reduction
    # x = k ln2 + r, a degree-6 polynomial in r, times 2^k built in the exponent bits
    # (`f32_from_bits`: exact, k >= -126). ~1 ulp (torch's softmax uses Sleef's, also ~1
    # ulp). x below -87 counts as -87 (e^-87 ~ 1.6e-38, nothing next to the block's
    # largest term, e^0 = 1).
    if x.itemsize == 8:  # float64 (tests): numba's exact exp
        for j in range(n):
            x[j] = np.exp(x[j])
        return
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
        x[j] = (p * r * r + r + np.float32(1.0)) * f32_from_bits(
            (np.int32(k) + np.int32(127)) << np.int32(23))


@jit
def exp_nonpositive(v):  # pragma: no cover - numba
    # `_exp_nonpositive` of one float32 (inlined where numba's np.exp is a libm call).
    v = max(v, np.float32(-87.0))
    k = np.floor(v * np.float32(1.44269504) + np.float32(0.5))
    r = v - k * np.float32(0.693359375) + k * np.float32(2.12194440e-4)
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    return (p * r * r + r + np.float32(1.0)) * f32_from_bits(
        (np.int32(k) + np.int32(127)) << np.int32(23))


def _load(builder, base, index, vec, align: int = 4):
    return builder.load(builder.bitcast(builder.gep(base, [index]), vec.as_pointer()),
                        align=align)


def _qk(lanes: int):
    @intrinsic
    def qk(typingctx, q_addr, k_addr, out_addr, d):
        """out[c] = sum_i q[i] * k[c * d + i] for c < `lanes` (float32 addresses as int64;
        `d` a multiple of `lanes`, >= `lanes`)."""
        sig = types.void(types.int64, types.int64, types.int64, types.int64)

        def codegen(context, builder, sig, args):
            qa, ka, oa, dl = args
            i64, i32 = ir.IntType(64), ir.IntType(32)
            f32, vec, fma = _vector_ops(builder, lanes)
            qp, kp, op = (builder.inttoptr(a, f32.as_pointer()) for a in (qa, ka, oa))
            entry, loop, done = _open_loop(builder, "qk")
            i = builder.phi(i64)
            accs = [builder.phi(vec) for _ in range(lanes)]
            qv = _load(builder, qp, i, vec)
            new = [builder.call(fma, [qv, _load(builder, kp, builder.add(
                builder.mul(ir.Constant(i64, c), dl), i), vec), accs[c]]) for c in range(lanes)]
            i1 = builder.add(i, ir.Constant(i64, lanes))
            i.add_incoming(ir.Constant(i64, 0), entry)
            i.add_incoming(i1, loop)
            for c in range(lanes):
                accs[c].add_incoming(ir.Constant(vec, [0.0] * lanes), entry)
                accs[c].add_incoming(new[c], loop)
            builder.cbranch(builder.icmp_signed("<", i1, dl), loop, done)
            builder.position_at_end(done)
            # The reduction tree: each vector holds `items` keys' partial sums, `size` lanes
            # each; two of them fold into one holding twice the keys at half the lanes
            # (first halves + second halves), until one vector holds every key's sum, in
            # key order.
            vs, size = new, lanes
            while len(vs) > 1:
                half, items = size // 2, lanes // size
                lo, hi = [], []
                for src in (0, lanes):
                    for t in range(items):
                        lo += [src + t * size + e for e in range(half)]
                        hi += [src + t * size + half + e for e in range(half)]
                lo_c = ir.Constant(ir.VectorType(i32, lanes), lo)
                hi_c = ir.Constant(ir.VectorType(i32, lanes), hi)
                vs = [builder.fadd(builder.shuffle_vector(a, b, lo_c),
                                   builder.shuffle_vector(a, b, hi_c))
                      for a, b in zip(vs[::2], vs[1::2], strict=True)]
                size = half
            builder.store(vs[0], builder.bitcast(op, vec.as_pointer()), align=4)
            return context.get_dummy_value()

        return sig, codegen

    return qk


def _pv(groups: int, nvec: int, lanes: int):
    @intrinsic
    def pv(typingctx, p_addr, p_stride, v_addr, d, acc_addr, acc_stride, n, pf_addr):
        """acc[g, 0:nvec * lanes] += sum_{j < n} p[g * p_stride + j] * v[j * d + 0:nvec *
        lanes] for g < `groups` (float32 addresses as int64, strides in floats); at step j
        the lines of `pf_addr + j * d * 4` that those columns span are prefetched (the
        same columns of the next row's value j)."""
        sig = types.void(*([types.int64] * 8))

        def codegen(context, builder, sig, args):
            pa, ps, va, dl, aa, ast, nl, pfa = args
            i64, i32 = ir.IntType(64), ir.IntType(32)
            f32, vec, fma = _vector_ops(builder, lanes)
            pp, vp, ap = (builder.inttoptr(a, f32.as_pointer()) for a in (pa, va, aa))
            undef = ir.Constant(vec, ir.Undefined)
            splat = ir.Constant(ir.VectorType(i32, lanes), [0] * lanes)
            at = [[builder.add(builder.mul(ir.Constant(i64, g), ast),
                               ir.Constant(i64, v * lanes)) for v in range(nvec)]
                  for g in range(groups)]
            init = [[_load(builder, ap, at[g][v], vec) for v in range(nvec)]
                    for g in range(groups)]
            entry, loop, done = _open_loop(builder, "pv", nl)
            j = builder.phi(i64)
            accs = [[builder.phi(vec) for _ in range(nvec)] for _ in range(groups)]
            row = builder.mul(j, dl)
            here = builder.add(pfa, builder.mul(row, ir.Constant(i64, 4)))
            for line in range(0, nvec * lanes * 4, 64):
                _prefetch_line(builder, builder.inttoptr(builder.add(
                    here, ir.Constant(i64, line)), ir.IntType(8).as_pointer()))
            vv = [_load(builder, vp, builder.add(row, ir.Constant(i64, v * lanes)), vec)
                  for v in range(nvec)]
            new = []
            for g in range(groups):
                x = builder.load(builder.gep(pp, [builder.add(
                    builder.mul(ir.Constant(i64, g), ps), j)]), align=4)
                b = builder.shuffle_vector(builder.insert_element(
                    undef, x, ir.Constant(i32, 0)), undef, splat)
                new.append([builder.call(fma, [b, vv[v], accs[g][v]]) for v in range(nvec)])
            j1 = builder.add(j, ir.Constant(i64, 1))
            j.add_incoming(ir.Constant(i64, 0), entry)
            j.add_incoming(j1, loop)
            for g in range(groups):
                for v in range(nvec):
                    accs[g][v].add_incoming(init[g][v], entry)
                    accs[g][v].add_incoming(new[g][v], loop)
            builder.cbranch(builder.icmp_signed("<", j1, nl), loop, done)
            builder.position_at_end(done)
            outs = [[builder.phi(vec) for _ in range(nvec)] for _ in range(groups)]
            for g in range(groups):
                for v in range(nvec):
                    outs[g][v].add_incoming(init[g][v], entry)
                    outs[g][v].add_incoming(new[g][v], loop)
            for g in range(groups):
                for v in range(nvec):
                    builder.store(outs[g][v], builder.bitcast(builder.gep(ap, [at[g][v]]),
                                                              vec.as_pointer()), align=4)
            return context.get_dummy_value()

        return sig, codegen

    return pv


qk = _qk(LANES)
# `pv` for 1-3 heads x 1-4 vectors (`pv_acc` takes at most PV_GROUPS heads at a time).
(_P11, _P12, _P13, _P14), (_P21, _P22, _P23, _P24), (_P31, _P32, _P33, _P34) = (
    tuple(_pv(g, v, LANES) for v in range(1, 5)) for g in range(1, 4))


@jit
def _pv_tile(ng, nv, pa, ps, va, d, aa, ast, n, pfa):  # pragma: no cover - numba
    if ng == 3:
        if nv == 4:
            _P34(pa, ps, va, d, aa, ast, n, pfa)
        elif nv == 3:
            _P33(pa, ps, va, d, aa, ast, n, pfa)
        elif nv == 2:
            _P32(pa, ps, va, d, aa, ast, n, pfa)
        else:
            _P31(pa, ps, va, d, aa, ast, n, pfa)
    elif ng == 2:
        if nv == 4:
            _P24(pa, ps, va, d, aa, ast, n, pfa)
        elif nv == 3:
            _P23(pa, ps, va, d, aa, ast, n, pfa)
        elif nv == 2:
            _P22(pa, ps, va, d, aa, ast, n, pfa)
        else:
            _P21(pa, ps, va, d, aa, ast, n, pfa)
    elif nv == 4:
        _P14(pa, ps, va, d, aa, ast, n, pfa)
    elif nv == 3:
        _P13(pa, ps, va, d, aa, ast, n, pfa)
    elif nv == 2:
        _P12(pa, ps, va, d, aa, ast, n, pfa)
    else:
        _P11(pa, ps, va, d, aa, ast, n, pfa)


@jit
def pv_acc(pa, ps, va, d, aa, ast, groups, n, pfa):  # pragma: no cover - numba
    # acc [groups, d] (at `aa`, row stride `ast`) += p [groups, n] (at `pa`, row stride
    # `ps`) @ v [n, d] (at `va`), in tiles of PV_GROUPS heads x PV_VECTORS vectors; the
    # next row's values at `pfa` (same layout) are prefetched along the way (`_pv`). Float32
    # addresses as int64, strides in floats; `d` a multiple of LANES.
    for d0 in range(0, d, PV_VECTORS * LANES):
        nv = min(PV_VECTORS, (d - d0) // LANES)
        for g0 in range(0, groups, PV_GROUPS):
            _pv_tile(min(PV_GROUPS, groups - g0), nv, pa + g0 * ps * 4, ps, va + d0 * 4, d,
                     aa + (g0 * ast + d0) * 4, ast, n, pfa + d0 * 4)


# `lane_sums`: 4 vectors of 8 float64 per input, whatever the target's vector width (AVX2
# splits each into two), so the partial sums are the same on every machine.
SUM_VECTORS = 4
SUM_LANES = 8
SUM_WIDTH = SUM_VECTORS * SUM_LANES


@intrinsic
def lane_sums(typingctx, a_addr, b_addr, n, out_addr):
    """out[c] += sum_i a[i * SUM_WIDTH + c] and out[SUM_WIDTH + c] += sum_i b[i * SUM_WIDTH
    + c] for c < SUM_WIDTH: each in order over i, the SUM_WIDTH columns side by side in
    vectors (float64 addresses as int64, `n` a multiple of SUM_WIDTH). The sampling
    kernel's sums of a block's probabilities and entropy terms."""
    sig = types.void(types.int64, types.int64, types.int64, types.int64)

    def codegen(context, builder, sig, args):
        aa, ba, nl, oa = args
        i64 = ir.IntType(64)
        f64 = ir.DoubleType()
        vec = ir.VectorType(f64, SUM_LANES)
        ap, bp, op = (builder.inttoptr(x, f64.as_pointer()) for x in (aa, ba, oa))

        at = [ir.Constant(i64, k * SUM_LANES) for k in range(2 * SUM_VECTORS)]
        init = [_load(builder, op, at[k], vec, 8) for k in range(2 * SUM_VECTORS)]
        entry, loop, done = _open_loop(builder, "sums", nl)
        i = builder.phi(i64)
        accs = [builder.phi(vec) for _ in range(2 * SUM_VECTORS)]
        new = []
        for k in range(2 * SUM_VECTORS):
            base = ap if k < SUM_VECTORS else bp
            off = builder.add(i, ir.Constant(i64, (k % SUM_VECTORS) * SUM_LANES))
            new.append(builder.fadd(accs[k], _load(builder, base, off, vec, 8)))
        i1 = builder.add(i, ir.Constant(i64, SUM_WIDTH))
        i.add_incoming(ir.Constant(i64, 0), entry)
        i.add_incoming(i1, loop)
        for k in range(2 * SUM_VECTORS):
            accs[k].add_incoming(init[k], entry)
            accs[k].add_incoming(new[k], loop)
        builder.cbranch(builder.icmp_signed("<", i1, nl), loop, done)
        builder.position_at_end(done)
        outs = [builder.phi(vec) for _ in range(2 * SUM_VECTORS)]
        for k, out in enumerate(outs):
            out.add_incoming(init[k], entry)
            out.add_incoming(new[k], loop)
        for k, out in enumerate(outs):
            builder.store(out, builder.bitcast(builder.gep(op, [at[k]]), vec.as_pointer()),
                          align=8)
        return context.get_dummy_value()

    return sig, codegen
