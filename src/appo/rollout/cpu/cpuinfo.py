"""The CPU's vendor, model name and feature flags from /proc/cpuinfo, without numba (so the
trainer can ask before a vLLM engine starts: vLLM's start-up scans every loaded module and
fails on llvmlite's FFI object)."""

from __future__ import annotations

import functools
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
