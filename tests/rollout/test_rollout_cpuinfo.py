"""`appo.rollout.cpu.cpuinfo.read`: vendor, model and flags of the first processor."""

from __future__ import annotations

import builtins
import os
import subprocess
import sys

import pytest

from appo.rollout.cpu import cpuinfo


def test_the_first_processors_fields_are_read(monkeypatch, tmp_path):
    f = tmp_path / "cpuinfo"
    f.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC X\n"
                 "flags\t\t: fpu avx2 avx512f\n\nprocessor\t: 1\nvendor_id\t: Other\n"
                 "model name\t: second\nflags\t\t: fpu\n")
    real_open = builtins.open
    monkeypatch.setattr(builtins, "open", lambda path, *a, **kw: real_open(
        f if path == "/proc/cpuinfo" else path, *a, **kw))
    info = cpuinfo.read()
    assert info["vendor"] == "AuthenticAMD" and info["model"] == "AMD EPYC X"
    assert info["flags"] == frozenset({"fpu", "avx2", "avx512f"})


def test_an_unreadable_file_gives_empty_fields(monkeypatch):
    def refuse(path, *a, **kw):
        raise OSError("no /proc here")

    monkeypatch.setattr(builtins, "open", refuse)
    info = cpuinfo.read()
    assert info["vendor"] == "" and info["flags"] == frozenset() and info["model"]


def test_feature_strings_are_parsed():
    assert cpuinfo.parse_features("+avx2,-avx512f,+fma,,+") == frozenset({"avx2", "fma"})


def test_numba_target_features_follow_numbas_override(monkeypatch):
    pytest.importorskip("numba")
    from numba.core import config

    monkeypatch.setattr(config, "CPU_FEATURES", "+avx2,-avx512f")
    assert cpuinfo.numba_target_features() == frozenset({"avx2"})
    monkeypatch.setattr(config, "CPU_FEATURES", None)
    assert "64bit" in cpuinfo.numba_target_features()  # the host's, as LLVM lists them


# Compiles the panel kernel afresh (numba's cache may hold no assembly) and reports its
# vector width, its registers and whether a 5-row product is right.
_PANEL_PROBE = """
import numba, numpy as np
from appo.rollout.cpu import kernels, panels
fresh = numba.njit(boundscheck=False)(panels.build().py_func)
rng = np.random.default_rng(0)
x = rng.standard_normal((5, 64), dtype=np.float32)
w = rng.standard_normal((2 * panels.PANEL, 64), dtype=np.float32)
out = np.empty((5, w.shape[0]), np.float32)
fresh(x, panels.pack(w), out, 0, w.shape[0])
asm = "".join(fresh.inspect_asm().values())
print(panels.LANES, kernels.wide_registers(), "zmm" in asm, "ymm" in asm,
      bool(np.allclose(out, x @ w.T, rtol=1e-5, atol=1e-4)))
"""


def test_the_avx2_environment_compiles_8_lane_kernels_without_avx512_registers():
    pytest.importorskip("numba")
    env = cpuinfo.avx2_environment()
    from llvmlite import binding

    if not binding.get_host_cpu_features().get("avx2"):
        assert env == {}  # nothing to emulate on a CPU without AVX2
        pytest.skip("no AVX2 here")
    assert env["ATEN_CPU_CAPABILITY"] == "avx2" and "-avx512f" in env["NUMBA_CPU_FEATURES"]
    assert "+avx2" in env["NUMBA_CPU_FEATURES"].split(",")
    done = subprocess.run([sys.executable, "-c", _PANEL_PROBE], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["8", "False", "False", "True", "True"]


def test_on_an_avx512_target_the_panel_kernel_uses_its_registers():
    pytest.importorskip("numba")
    if "avx512f" not in cpuinfo.numba_target_features():
        pytest.skip("numba does not target AVX-512 here")
    done = subprocess.run([sys.executable, "-c", _PANEL_PROBE], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[:3] == ["16", "True", "True"]
    assert done.stdout.split()[4] == "True"


def test_target_flags_follow_numbas_variables_without_importing_numba(monkeypatch):
    monkeypatch.delenv("NUMBA_CPU_NAME", raising=False)
    monkeypatch.delenv("NUMBA_CPU_FEATURES", raising=False)
    assert cpuinfo.target_flags() == cpuinfo.cpu_info()["flags"]
    monkeypatch.setenv("NUMBA_CPU_NAME", "generic")
    assert cpuinfo.target_flags() == frozenset()
    monkeypatch.setenv("NUMBA_CPU_FEATURES", "+avx2,-avx512f")
    assert cpuinfo.target_flags() == frozenset({"avx2"})
    from appo.trainer import cpu_linear  # `actor.cpu_matmul=auto` decides by them too

    assert not cpu_linear._amd_avx512()
