"""The CPU's vendor, model name and feature flags from /proc/cpuinfo, without numba (so the
trainer can ask before a vLLM engine starts: vLLM's start-up scans every loaded module and
fails on llvmlite's FFI object); the features numba compiles the CPU kernels for
(`numba_target_features`, or numba-free `target_flags`), which `NUMBA_CPU_FEATURES` may set
below the machine's; and `avx2_environment`, the variables that run a process on an
AVX-512 machine as on an AVX2 one (`python -m appo.rollout.cpu.cpuinfo --avx2`)."""

from __future__ import annotations

import functools
import os
import platform


def read() -> dict:
    """`vendor` (e.g. AuthenticAMD), `model` name and `flags` (a frozenset) of the first
    processor listed; empty vendor and flags where /proc/cpuinfo cannot be read."""
    info = {"vendor": "", "model": platform.processor() or platform.machine(),
            "flags": frozenset()}
    seen: set[str] = set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in seen or key not in ("vendor_id", "model name", "flags"):
                    continue
                seen.add(key)
                if key == "vendor_id":
                    info["vendor"] = value.strip()
                elif key == "model name":
                    info["model"] = value.strip()
                else:
                    info["flags"] = frozenset(value.split())
                if len(seen) == 3:
                    break
    except OSError:
        pass
    return info


cpu_info = functools.cache(read)


def parse_features(text: str) -> frozenset[str]:
    """The features switched on in an LLVM feature string ("+avx2,-avx512f,+fma")."""
    return frozenset(f[1:] for f in text.split(",") if f.startswith("+") and len(f) > 1)


def target_flags() -> frozenset[str]:
    """`numba_target_features` without importing numba: the features of
    `NUMBA_CPU_FEATURES` where that variable is set (none under `NUMBA_CPU_NAME=generic`),
    else /proc/cpuinfo's flags (the same names for the x86 vector extensions)."""
    features = os.environ.get("NUMBA_CPU_FEATURES")
    if features is None and os.environ.get("NUMBA_CPU_NAME", "").lower() == "generic":
        features = ""
    return cpu_info()["flags"] if features is None else parse_features(features)


def numba_target_features() -> frozenset[str]:
    """The CPU features numba compiles for, by numba's own rule: `NUMBA_CPU_FEATURES` where
    it is set (also "" under `NUMBA_CPU_NAME=generic`), else the host's as LLVM sees them.
    The kernels' vector width follows this, not /proc/cpuinfo, so code built for another
    target (a portable cache, or `avx2_environment` on an AVX-512 machine) keeps the width
    its instructions have. Imports numba: not for code that runs before a vLLM start-up."""
    from llvmlite import binding
    from numba.core import config

    if config.CPU_FEATURES is not None:
        return parse_features(config.CPU_FEATURES)
    return frozenset(k for k, on in binding.get_host_cpu_features().items() if on)


# The features an AVX-512 CPU loses when it is run as an AVX2 one (`avx2_environment`).
WIDE_FEATURE_PREFIXES = ("avx512", "amx", "avx10", "evex512")


def avx2_environment() -> dict[str, str]:
    """Environment variables that run a process on this machine as on an AVX2-only one:
    numba compiles without AVX-512 (so the kernels take their 8-lane forms and the AMD or
    Intel AVX2 decode rule), and torch's own kernels, oneDNN and MKL stop at AVX2. The
    hardware (caches, memory) stays this machine's. Used by the suite to test the AVX2
    kernels on AVX-512 machines and by `benchmarks/` to measure them; empty where numba
    is missing or the CPU has no AVX2 (another architecture: nothing to emulate)."""
    try:
        from llvmlite import binding
    except ImportError:
        return {}
    host = binding.get_host_cpu_features()
    if not host.get("avx2"):
        return {}
    features = ",".join(("-" if not on or k.startswith(WIDE_FEATURE_PREFIXES) else "+") + k
                        for k, on in sorted(host.items()))
    vendor = cpu_info()["vendor"]
    return {"NUMBA_CPU_NAME": "znver3" if vendor == "AuthenticAMD" else "haswell",
            "NUMBA_CPU_FEATURES": features, "ATEN_CPU_CAPABILITY": "avx2",
            "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


if __name__ == "__main__":
    # `eval "$(python -m appo.rollout.cpu.cpuinfo --avx2)"`: this shell as an AVX2 machine.
    import shlex
    import sys

    if sys.argv[1:] != ["--avx2"]:
        sys.exit("usage: python -m appo.rollout.cpu.cpuinfo --avx2")
    env = avx2_environment()
    if not env:
        sys.exit("this CPU has no AVX2 (or numba is missing): nothing to run as an AVX2 machine")
    for key, value in env.items():
        print(f"export {key}={shlex.quote(value)}")
