"""Float32 `x @ W^T` for CPU decode steps on weights packed in column panels, in numba.

The kernels of `appo.rollout.cpu.kernels` dot each weight row with the input rows: LLVM
vectorises the `K` loop, so every output ends in a horizontal sum, and each multiply-add
needs its own load of an input vector (7 loads per 12 multiply-adds in the tile kernel).
Here the weights are packed once into panels of `PANEL` output columns (two vectors: 16 on
AVX2, 32 where LLVM targets AVX-512), `[N / PANEL, K, PANEL]` (k-major inside a panel, so a
panel is one contiguous stream), and the microkernel keeps a block of up to `MAX_ROWS`
input rows x `PANEL` columns in vector accumulators: per `k` it loads the panel's two
vectors, broadcasts each row's `x[m, k]` and does two fused multiply-adds per row, with
no horizontal sum (the BLIS / GotoBLAS layout). On AVX2: 6 rows, 12 accumulators, 15 of
its 16 vector registers. On AVX-512: 16-float vectors and 8 rows (16 accumulators of 32
registers). At both widths the panel stream is prefetched `PREFETCH` bytes ahead: at a
few rows a decode step's matmuls read the weights and little else, and the hardware
prefetcher alone left the memory bus partly idle. The microkernel is written in LLVM IR
(a numba intrinsic per row count: `<LANES x float>` vectors and `llvm.fma`), so its accumulators
stay in registers whatever LLVM's vectoriser would have made of scalar code.

Exactness: each output is one chain of float32 fused multiply-adds over `k = 0..K-1` from
0, whatever the row block, panel or thread computed it: results are bit-identical for any
row count split or column split (the engine's determinism), though not equal to MKL's or
the other kernels' sums (summation order, as any GEMM).

`packed(weight)` makes the packed copy (cached per weight tensor, repacked when its storage
or version counter changes, freed with the tensor or by `drop()`; moved onto huge pages
once it keeps serving decode steps, `appo.rollout.cpu.hugepages`); `N` must be a multiple
of `PANEL` (`fits`), other matrices take the tile kernel. Which row counts use it is the decode
rule's choice (`appo.rollout.cpu.matmuls`, implementation `numba_panel`); timings in
`benchmarks/RESULTS.md` ("CPU rollout").
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic
from torch import Tensor

from appo.rollout.cpu import hugepages
from appo.rollout.cpu.cache import per_tensor
from appo.rollout.cpu.cpuinfo import numba_target_features

# Vector width: 16 floats where numba targets AVX-512 (32 vector registers), else 8 (AVX2's 16):
# the target numba compiles for, which `NUMBA_CPU_FEATURES` may set below the host's.
LANES = 16 if "avx512f" in numba_target_features() else 8
PANEL = 2 * LANES  # output columns per panel: two vectors
# Rows per microkernel call: rows x 2 accumulators + 2 weight vectors + 1 broadcast registers.
MAX_ROWS = 8 if LANES == 16 else 6
# How far ahead of its loads the microkernel prefetches its panel stream (bytes: 48 steps of
# k at AVX-512 width, 96 at AVX2's). Measured on a Zen 5, one decode step's matmuls at 8
# rows: AVX-512 12.6-13.7 ms with it, 15.0-18.2 without; the AVX2 kernels there
# (`cpuinfo.avx2_environment`) 15.0-15.7 with it, 22.1-22.8 without; 12 KB was no faster
# at either width (benchmarks/HISTORY.md, "The panel kernel at AVX-512 width" and "The
# AVX2 kernels on an AVX-512 machine"). Not measured on a Zen 3.
PREFETCH = 6 * 1024


def _microkernel(rows: int, lanes: int = LANES, prefetch: int = 0):
    """The intrinsic `out[r, 0:W] = sum_k x[r, k] * panel[k, 0:W]` for `rows` rows, W = 2 x
    `lanes` (`<lanes x float>` vectors). `prefetch` > 0: each step of k also prefetches
    the panel's lines `prefetch` bytes ahead of its loads (past the panel's end: the next
    panel's, which the caller reads next)."""
    width = 2 * lanes

    @intrinsic
    def micro(typingctx, x_addr, x_stride, w_addr, out_addr, out_stride, k_len):
        """Addresses as int64; strides in floats; `k_len` >= 1."""
        sig = types.void(types.int64, types.int64, types.int64, types.int64, types.int64,
                         types.int64)

        def codegen(context, builder, sig, args):
            xa, xs, wa, oa, os_, kl = args
            i64, i32 = ir.IntType(64), ir.IntType(32)
            f32, vec, fma = vector_ops(builder, lanes)
            xp, wp, op = (builder.inttoptr(a, f32.as_pointer()) for a in (xa, wa, oa))
            undef = ir.Constant(vec, ir.Undefined)
            splat = ir.Constant(ir.VectorType(i32, lanes), [0] * lanes)
            entry, loop, done = open_loop(builder, "panel")
            k = builder.phi(i64)
            accs = [[builder.phi(vec) for _ in range(2)] for _ in range(rows)]
            base = builder.mul(k, ir.Constant(i64, width))
            if prefetch:
                ahead = builder.add(wa, builder.mul(base, ir.Constant(i64, 4)))
                for line in range(0, width * 4, 64):
                    prefetch_line(builder, builder.inttoptr(builder.add(
                        ahead, ir.Constant(i64, prefetch + line)), ir.IntType(8).as_pointer()))
            w = [builder.load(builder.bitcast(builder.gep(wp, [builder.add(
                base, ir.Constant(i64, v * lanes))]), vec.as_pointer()), align=4)
                for v in range(2)]
            new = []
            for r in range(rows):
                xv = builder.load(builder.gep(xp, [builder.add(
                    builder.mul(ir.Constant(i64, r), xs), k)]), align=4)
                b = builder.shuffle_vector(
                    builder.insert_element(undef, xv, ir.Constant(i32, 0)), undef, splat)
                new.append([builder.call(fma, [b, w[v], accs[r][v]]) for v in range(2)])
            k1 = builder.add(k, ir.Constant(i64, 1))
            k.add_incoming(ir.Constant(i64, 0), entry)
            k.add_incoming(k1, loop)
            for r in range(rows):
                for v in range(2):
                    accs[r][v].add_incoming(ir.Constant(vec, [0.0] * lanes), entry)
                    accs[r][v].add_incoming(new[r][v], loop)
            builder.cbranch(builder.icmp_signed("<", k1, kl), loop, done)
            builder.position_at_end(done)
            for r in range(rows):
                for v in range(2):
                    at = builder.add(builder.mul(ir.Constant(i64, r), os_),
                                     ir.Constant(i64, v * lanes))
                    builder.store(new[r][v], builder.bitcast(builder.gep(op, [at]),
                                                             vec.as_pointer()), align=4)
            return context.get_dummy_value()

        return sig, codegen

    return micro


def vector_ops(builder, lanes: int):
    """(float, `<lanes x float>`, its `llvm.fma`) for a microkernel's IR."""
    f32 = ir.FloatType()
    vec = ir.VectorType(f32, lanes)
    fma = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(vec, [vec, vec, vec]), f"llvm.fma.v{lanes}f32")
    return f32, vec, fma


def open_loop(builder, name: str, count=None):
    """Start a loop in a microkernel's IR: returns its (entry, loop, done) blocks with the
    builder inside `loop`. With `count` (an i64) the loop is skipped where `count <= 0`;
    without, it runs at least once."""
    entry = builder.block
    loop = builder.append_basic_block(f"{name}_loop")
    done = builder.append_basic_block(f"{name}_done")
    if count is None:
        builder.branch(loop)
    else:
        builder.cbranch(builder.icmp_signed(">", count, ir.Constant(ir.IntType(64), 0)),
                        loop, done)
    builder.position_at_end(loop)
    return entry, loop, done


def prefetch_line(builder, address) -> None:
    """`llvm.prefetch` of the line holding `address` (an i8*): a read, into L2 and outer."""
    i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(
        ir.VoidType(), [i8p, i32, i32, i32]), "llvm.prefetch.p0")
    builder.call(fn, [address, ir.Constant(i32, 0), ir.Constant(i32, 1), ir.Constant(i32, 1)])


# Rows 7 and 8 only run where MAX_ROWS is 8 (AVX-512).
_M1, _M2, _M3, _M4, _M5, _M6, _M7, _M8 = (_microkernel(r, LANES, PREFETCH)
                                          for r in range(1, 9))


def build():
    @numba.njit(boundscheck=False, nogil=True, cache=True)
    def panels_times_rows(x, wp, out, lo, hi):  # pragma: no cover - compiled by numba
        # Output columns lo:hi (multiples of PANEL); `wp` `[N, K]` holds the panels
        # `[N / PANEL, K, PANEL]` (`pack`). Rows in balanced blocks of at most MAX_ROWS:
        # on AVX2 8 rows run as 4 + 4 (8 accumulators each keep both FMA units busy), not
        # 6 + 2.
        m_rows, k_len = x.shape
        if m_rows == 0 or k_len == 0:
            out[:, lo:hi] = 0.0
            return
        n_cols = out.shape[1]
        blocks = (m_rows + MAX_ROWS - 1) // MAX_ROWS
        size, extra = m_rows // blocks, m_rows % blocks
        xa, wa, oa = x.ctypes.data, wp.ctypes.data, out.ctypes.data
        for p in range(lo // PANEL, hi // PANEL):
            pa = wa + p * k_len * PANEL * 4
            m0 = 0
            for b in range(blocks):
                r = size + (1 if b < extra else 0)
                xo = xa + m0 * k_len * 4
                oo = oa + (m0 * n_cols + p * PANEL) * 4
                if r == 8:
                    _M8(xo, k_len, pa, oo, n_cols, k_len)
                elif r == 7:
                    _M7(xo, k_len, pa, oo, n_cols, k_len)
                elif r == 6:
                    _M6(xo, k_len, pa, oo, n_cols, k_len)
                elif r == 5:
                    _M5(xo, k_len, pa, oo, n_cols, k_len)
                elif r == 4:
                    _M4(xo, k_len, pa, oo, n_cols, k_len)
                elif r == 3:
                    _M3(xo, k_len, pa, oo, n_cols, k_len)
                elif r == 2:
                    _M2(xo, k_len, pa, oo, n_cols, k_len)
                else:
                    _M1(xo, k_len, pa, oo, n_cols, k_len)
                m0 += r

    return panels_times_rows


def fits(weight: Tensor) -> bool:
    """Whether `weight` `[N, K]` can be packed: float32, `N` a multiple of `PANEL`."""
    return (weight.dim() == 2 and weight.dtype == torch.float32
            and weight.shape[0] % PANEL == 0 and weight.shape[0] > 0)


def pack(weight: np.ndarray) -> np.ndarray:
    """`[N, K]` -> the same-shape array holding `[N / PANEL, K, PANEL]` panels."""
    n, k = weight.shape
    panels = np.empty((n // PANEL, k, PANEL), weight.dtype)
    panels[:] = weight.reshape(n // PANEL, PANEL, k).transpose(0, 2, 1)
    hugepages.track(panels, panels.ctypes.data, panels.nbytes)  # moved once it keeps serving
    return panels.reshape(n, k)


_packed: dict[int, tuple] = {}  # `cache.per_tensor`'s entries
_MARK = "_appo_panels"  # set on tensors whose memory holds panels (`pack_tensor`)


def pack_tensor(weight: Tensor) -> Tensor:
    """`weight` `[N, K]` (`fits`) as a new tensor of the same shape whose memory holds its
    panels (`pack`), which `packed` hands over as they are: for a caller that keeps the
    packed copy instead of a dense one (the lean decoder's concatenated QKV and gate/up
    where every forward runs on the panel kernel). Only the panel kernel may read it as a
    weight; `dense` gives the matrix back."""
    out = torch.from_numpy(pack(weight.detach().contiguous().numpy()))
    setattr(out, _MARK, True)
    return out


def is_packed(weight: Tensor) -> bool:
    """Whether `weight` was made by `pack_tensor`."""
    return getattr(weight, _MARK, False)


def dense(weight: Tensor) -> Tensor:
    """The `[N, K]` matrix of a `pack_tensor` result (any other tensor: itself)."""
    if not is_packed(weight):
        return weight
    n, k = weight.shape
    return weight.reshape(n // PANEL, k, PANEL).transpose(1, 2).reshape(n, k)


def packed(weight: Tensor) -> np.ndarray:
    """`weight`'s packed copy, made on first use and whenever the tensor's storage or
    version counter (an in-place update: optimizer step, weight sync) has changed; a
    `pack_tensor` result is its own."""
    if is_packed(weight):
        return weight.numpy()
    # Inference-mode tensors (the lean decoder's packed QKV and gate/up copies) keep no
    # version counter; they are remade, not updated, when a weight changes.
    version = -1 if weight.is_inference() else weight._version
    return per_tensor(_packed, weight, (weight.data_ptr(), version),
                      lambda w: pack(w.detach().numpy()))


def drop() -> None:
    """Free every packed copy (an engine dropping its weight copies before an update)."""
    _packed.clear()
