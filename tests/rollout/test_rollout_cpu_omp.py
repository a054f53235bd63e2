"""`appo.rollout.cpu.omp`: torch's `GOMP_parallel` is found where torch runs on GNU OpenMP,
and where it is not, a one-thread stand-in links instead and the team keeps its helper."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from appo.rollout.cpu import kernels

pytestmark = pytest.mark.skipif(not kernels.available(), reason="numba not installed")


def test_torchs_gomp_parallel_is_found_where_torch_has_it():
    from appo.rollout.cpu import omp

    bundled = Path(torch.__file__).parent / "lib" / "libgomp.so.1"
    if not (sys.platform.startswith("linux") and bundled.exists()):
        pytest.skip("torch does not bundle GNU OpenMP here")
    assert omp.gomp_parallel_address() is not None
    assert any(p.startswith(str(Path(torch.__file__).parent)) for p in omp._loaded_libgomp())


STAND_IN = """
import ctypes
import llvmlite.binding as llvm
import numba
import numpy as np
from numba import types
from appo.rollout.cpu import omp
omp.gomp_parallel_address = lambda: None  # as on a machine without torch's libgomp
from appo.rollout.cpu import team
assert team.OMP is False and team._TEAM.omp is False

@numba.cfunc(types.void(types.voidptr))
def body(data):
    a = numba.carray(data, (1,), np.int64)
    a[0] += 1

hits = np.zeros(1, np.int64)
call = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint)(
    llvm.address_of_symbol(omp.SYMBOL))
call(body.address, hits.ctypes.data, 4, 0)
assert hits[0] == 1, hits  # the body ran once, on the caller
# The team's jobs still run (its own helper) and stay exact.
x = np.random.default_rng(0).standard_normal((3, 64), dtype=np.float32)
w = np.random.default_rng(1).standard_normal((4096, 64), dtype=np.float32)
want, out = np.empty((3, 4096), np.float32), np.empty((3, 4096), np.float32)
kernels = team.kernels
kernels.kernel_for("wide")(x, w, want, 0, 4096)
team.run(kernels.kernel_for("wide"), x, w, out, 2)
assert np.array_equal(out, want)
print("stand-in ok")
"""


def test_without_torchs_libgomp_a_stand_in_links_and_the_helper_serves():
    r = subprocess.run([sys.executable, "-c", STAND_IN], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and "stand-in ok" in r.stdout, r.stdout + r.stderr[-3000:]
