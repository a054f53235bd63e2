"""Packed decode weights onto 2 MB transparent huge pages, once they keep serving.

A decode step at a few rows streams every weight once; on 4 KB pages that is ~130,000
pages a step for SmolLM2, far more than the TLB holds. The packed copies the decode
matmuls read (oneDNN's, `appo.rollout.cpu.onednn`; the panel kernel's,
`appo.rollout.cpu.panels`) are registered here when made (`track`) and moved onto huge
pages (`advise`: `madvise` `MADV_HUGEPAGE` + `MADV_COLLAPSE`, Linux 6.1+, where the
kernel's THP mode is `madvise` or `always`): oneDNN's matmuls ran 6-12 % slower on 4 KB
pages, the panel kernel's ~7 % (`benchmarks/RESULTS.md`). The move copies the bytes, about
what `HUGE_PAGES_AFTER` decode steps gain back (both scale with the weights' size), so it
happens once the copies made since the last packing have served that many steps
(`decode_step`; a rent-or-buy rule: at most twice the best choice's cost whatever comes
next). An RL step whose rollout is shorter, repacked after every update, never pays it; a
long rollout, an evaluation or a benchmark does, once. The bytes and their addresses stay
the same, so results do not change. `APPO_CPU_HUGE_PAGES=0` turns it off; elsewhere
(another OS, an older kernel, THP off) nothing happens.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
import weakref

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE, MADV_COLLAPSE = 14, 25  # Linux's <asm-generic/mman-common.h>

# Decode steps the packed copies serve before their move onto huge pages (`decode_step`):
# moving SmolLM2's 540 MB took 0.3-1.4 s, a step's matmuls gained ~1-2 ms (Zen 5).
HUGE_PAGES_AFTER = 256
# Live packed copies not on huge pages yet: id(owner) -> (weak reference, start, bytes).
_unmoved: dict[int, tuple] = {}
_steps_since_pack = 0


@functools.cache
def _madvise():
    """libc's `madvise`, on Linux with the switch on (None elsewhere)."""
    if not sys.platform.startswith("linux") or os.environ.get("APPO_CPU_HUGE_PAGES") == "0":
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int), ctypes.c_int
    return fn


def advise(start: int, size: int) -> bool:
    """Back the `size` bytes at address `start` with 2 MB pages, now; True where the kernel
    did. The range is widened to whole 2 MB pages: the copy's neighbours in the heap
    (mostly other packed copies) move with it, their bytes unchanged."""
    madvise = _madvise()
    if madvise is None or size <= 0:
        return False
    lo, hi = start & -HUGE_PAGE, (start + size + HUGE_PAGE - 1) & -HUGE_PAGE
    # Failures (no THP, a kernel before 6.1, no huge page free) leave 4 KB pages: same bytes.
    madvise(lo, hi - lo, MADV_HUGEPAGE)
    return madvise(lo, hi - lo, MADV_COLLAPSE) == 0


def track(owner, start: int, size: int) -> None:
    """Register a packed copy just made (`owner` holds the `size` bytes at `start` while it
    lives): `decode_step` moves it later, and the count of steps starts again."""
    global _steps_since_pack
    key = id(owner)
    _unmoved[key] = (weakref.ref(owner, lambda _, key=key: _unmoved.pop(key, None)), start,
                     size)
    _steps_since_pack = 0


def decode_step() -> None:
    """Count one decode step served by the packed copies; at `HUGE_PAGES_AFTER` steps since
    the last packing, move every live copy made since onto huge pages (`advise`)."""
    global _steps_since_pack
    if not _unmoved:
        return
    _steps_since_pack += 1
    if _steps_since_pack >= HUGE_PAGES_AFTER:
        for ref, start, size in list(_unmoved.values()):
            if ref() is not None:
                advise(start, size)
        _unmoved.clear()
