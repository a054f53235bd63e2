"""Transparent huge pages for torch's large CPU buffers: fewer TLB misses when a CPU decode
step streams the model's weights.

A CPU decode step at a few rows reads every weight matrix once (SmolLM2-135M: 538 MB a
step, bandwidth-bound): with 4 KB pages that is ~130,000 pages a step, far more than the
TLB holds, so the page walks add to every matrix. torch's CPU allocator can back each
buffer of 2 MB or more with 2 MB transparent huge pages (`madvise(MADV_HUGEPAGE)`) when
`THP_MEM_ALLOC_ENABLE=1` is in the environment; it reads the variable once, at its first
such allocation, so it must be set before the first large tensor: `import appo` sets it
(`enable`), unless it is already set (either way: the user's value stands) or
`APPO_HUGEPAGES=0`. Child processes (vLLM's engine, tool sandboxes) inherit it.

Linux only, and only where the kernel's THP mode is `always` or `madvise`
(`/sys/kernel/mm/transparent_hugepage/enabled`); elsewhere torch ignores it. Results do not
change: only where the memory lives. Measured (`benchmarks/RESULTS.md`): the demo's peak RSS
unchanged, decode steps and the demo faster. glibc's own switch for every `malloc`
(`GLIBC_TUNABLES=glibc.malloc.hugetlb=1`, read at process start) was measured too: a larger
peak, no faster demo, and different demo numerics (see `benchmarks/HISTORY.md`); it is not
used.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

TORCH_ENV = "THP_MEM_ALLOC_ENABLE"
SWITCH_ENV = "APPO_HUGEPAGES"


def enable(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Set `THP_MEM_ALLOC_ENABLE=1` unless it is set already or `APPO_HUGEPAGES=0`; whether
    it is on now. Only effective before torch's first buffer of 2 MB or more."""
    if environ.get(SWITCH_ENV, "1") == "0":
        return environ.get(TORCH_ENV) == "1"
    environ.setdefault(TORCH_ENV, "1")
    return environ[TORCH_ENV] == "1"
