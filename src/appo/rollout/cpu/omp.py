"""torch's own OpenMP thread pool, for the decode step's numba jobs.

The decode step's numba jobs (`appo.rollout.cpu.team`) used to run on a spinning helper
thread of appo's. oneDNN's GEMM (`appo.rollout.cpu.onednn`) and every other torch CPU op
run on torch's OpenMP pool, whose workers spin after each op waiting for the next. With
both, three busy threads shared two cores: a spinning OpenMP worker held the core the team
helper needed, so the attention ran on the caller alone (`benchmarks/HISTORY.md`, "oneDNN
and torch's OpenMP pool"). Here the jobs run as OpenMP parallel regions of the very pool
torch uses: `GOMP_parallel` of the libgomp that torch loaded, its body a numba `cfunc`
taking chunks as the team's threads do. One pool, so the same worker thread runs a GEMM,
then an attention, then the next GEMM, and nothing else spins.

`gomp_parallel_address()`: the address of that `GOMP_parallel`, found among the libraries
this process has loaded (torch's bundled `libgomp`), or None where torch uses another
OpenMP runtime or none (macOS, Windows, a build without OpenMP); the team then keeps its
own helper. The address is registered with LLVM under `SYMBOL` for the numba code that
calls it; where there is none, a stand-in that runs the body once on the caller (all
chunks) is registered instead, so the compiled code links everywhere.
`APPO_CPU_OMP=0` keeps the team's own helper.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys

SYMBOL = "appo_gomp_parallel"


def enabled() -> bool:
    return os.environ.get("APPO_CPU_OMP", "1") != "0"


def _loaded_libgomp() -> list[str]:
    """Paths of the libgomp copies this process has mapped (Linux)."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libgomp" in line and "/" in line}
    except OSError:
        return []
    return sorted(paths)


@functools.cache
def gomp_parallel_address() -> int | None:
    """`GOMP_parallel` of the libgomp torch runs its ops on, or None."""
    import torch

    if not sys.platform.startswith("linux") or "OpenMP" not in torch.__config__.parallel_info():
        return None
    torch_dir = os.path.dirname(torch.__file__)
    paths = _loaded_libgomp()
    # torch's bundled copy where there are several (another library may bring its own).
    ours = [p for p in paths if p.startswith(torch_dir)] or (paths if len(paths) == 1 else [])
    if not ours:
        return None
    try:
        lib = ctypes.CDLL(ours[0], mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        return ctypes.cast(lib.GOMP_parallel, ctypes.c_void_p).value
    except (OSError, AttributeError):
        return None


@functools.cache
def register() -> bool:
    """Make `SYMBOL` resolvable for numba's code: torch's `GOMP_parallel` (True) or the
    one-thread stand-in (False)."""
    import llvmlite.binding as llvm
    import numba
    from numba import types

    address = gomp_parallel_address()
    if address is None:
        @numba.cfunc(types.void(types.voidptr, types.voidptr, types.uint32, types.uint32))
        def alone(fn, data, threads, flags):  # pragma: no cover - numba
            _call_body(fn, data)

        _keep.append(alone)
        address = alone.address
    llvm.add_symbol(SYMBOL, address)
    return not _keep


_keep: list = []  # the stand-in, alive while its address is registered


def _body_caller():
    from llvmlite import ir
    from numba import types
    from numba.core import cgutils
    from numba.extending import intrinsic

    @intrinsic
    def call_body(typingctx, fn, data):
        """`fn(data)` for a `void (*)(void *)` `fn` given as a pointer."""
        def codegen(context, builder, sig, args):
            fnty = ir.FunctionType(ir.VoidType(), [cgutils.voidptr_t])
            builder.call(builder.bitcast(args[0], fnty.as_pointer()), [args[1]])
            return context.get_dummy_value()
        return types.void(fn, data), codegen

    return call_body


_call_body = _body_caller()
