"""Atomics and other LLVM intrinsics for the decode step's numba jobs (`appo.rollout.cpu.team`):
acquire / release loads and stores, read-modify-writes, x86's `pause`, `sched_yield`,
int64 addresses as typed pointers, and a call of torch's `GOMP_parallel`
(`appo.rollout.cpu.omp`)."""

from __future__ import annotations

import platform
import sys

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from appo.rollout.cpu import omp

_X86 = platform.machine().lower() in {"x86_64", "amd64", "i686", "i386"}
_YIELD = sys.platform != "win32"


def element(context, builder, sig, args):
    arrty = sig.args[0]
    ary = context.make_array(arrty)(context, builder, args[0])
    return cgutils.get_item_pointer(context, builder, arrty, ary, [args[1]])


@intrinsic
def load(typingctx, arr, idx):
    """`arr[idx]` as an acquire load (never hoisted out of a spin loop)."""
    def codegen(context, builder, sig, args):
        return builder.load_atomic(element(context, builder, sig, args), "acquire", 8)
    return types.int64(arr, idx), codegen


@intrinsic
def store(typingctx, arr, idx, val):
    """`arr[idx] = val` as a release store."""
    def codegen(context, builder, sig, args):
        builder.store_atomic(args[2], element(context, builder, sig, args), "release", 8)
        return context.get_dummy_value()
    return types.void(arr, idx, val), codegen


def read_modify_write(op: str):
    @intrinsic
    def rmw(typingctx, arr, idx, val):
        """`arr[idx] = arr[idx] <op> val` atomically (acquire and release); returns the
        value before."""
        def codegen(context, builder, sig, args):
            return builder.atomic_rmw(op, element(context, builder, sig, args), args[2],
                                      "acq_rel")
        return types.int64(arr, idx, val), codegen
    return rmw


# `fetch_add`: `arr[idx] += val`; `exchange`: `arr[idx] = val`, ordered before every
# later store.
fetch_add, exchange = read_modify_write("add"), read_modify_write("xchg")


@intrinsic
def compare_exchange(typingctx, arr, idx, expected, val):
    """`arr[idx] = val` if it holds `expected`, atomically; True where it did."""
    def codegen(context, builder, sig, args):
        pair = builder.cmpxchg(element(context, builder, sig, args), args[2], args[3],
                               "acq_rel", "acquire")
        return builder.extract_value(pair, 1)
    return types.boolean(arr, idx, expected, val), codegen


@intrinsic
def pause(typingctx):
    """x86's spin-wait hint (nothing elsewhere)."""
    def codegen(context, builder, sig, args):
        if _X86:
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(
                ir.VoidType(), []), "llvm.x86.sse2.pause")
            builder.call(fn, [])
        return context.get_dummy_value()
    return types.void(), codegen


@intrinsic
def sched_yield(typingctx):
    """`sched_yield()`: a spinning helper lets another thread on its core run."""
    def codegen(context, builder, sig, args):
        if _YIELD:
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(
                ir.IntType(32), []), "sched_yield")
            builder.call(fn, [])
        return context.get_dummy_value()
    return types.void(), codegen


@intrinsic
def gomp_parallel(typingctx, body, data, threads):
    """`GOMP_parallel(body, data, threads, 0)` of torch's libgomp (`appo.rollout.cpu.omp`):
    `body(data)` on `threads` threads of torch's OpenMP pool, the caller one of them."""
    def codegen(context, builder, sig, args):
        i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(
            ir.VoidType(), [i8p, i8p, i32, i32]), omp.SYMBOL)
        builder.call(fn, [builder.inttoptr(args[0], i8p), builder.inttoptr(args[1], i8p),
                          builder.trunc(args[2], i32), ir.Constant(i32, 0)])
        return context.get_dummy_value()
    return types.void(types.int64, types.int64, types.int64), codegen


def pointer_to(dtype):
    @intrinsic
    def at(typingctx, address):
        """The int64 `address` as a pointer to `dtype`."""
        def codegen(context, builder, sig, args):
            return builder.inttoptr(args[0], context.get_value_type(sig.return_type))
        return types.CPointer(dtype)(types.int64), codegen
    return at


f32_at, i64_at = pointer_to(types.float32), pointer_to(types.int64)
f64_at, bool_at = pointer_to(types.float64), pointer_to(types.boolean)
