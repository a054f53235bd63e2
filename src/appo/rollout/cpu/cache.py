"""Values derived from a tensor (a numpy view, a packed copy), kept while it lives: one
cache shared by the decode matmul kernels (`kernels`, `panels`); and the check that drops
numba's on-disk cache of kernels that embed code from other files (`flush_stale`)."""

from __future__ import annotations

import hashlib
import weakref
from pathlib import Path

import numpy as np
from torch import Tensor


def per_tensor(store: dict, weight: Tensor, stamp: tuple, make) -> np.ndarray:
    """`make(weight)`, kept in `store` while the tensor lives and its `stamp` (e.g. storage
    pointer and shape, or version counter) is unchanged; dropped with the tensor."""
    key = id(weight)
    entry = store.get(key)
    if entry is not None and entry[0]() is weight and entry[1] == stamp:
        return entry[2]
    store.pop(key, None)  # a stale value goes before the new one is made
    value = make(weight)
    store[key] = (weakref.ref(weight, lambda _, key=key: store.pop(key, None)), stamp, value)
    return value


def flush_stale(functions, sources, name: str) -> bool:
    """numba's cache checks only a function's defining file, but `functions` embed code
    of `sources` too (kernels inlined from other modules, intrinsics): their cached code is
    dropped (True) when those files differ from the stamp `name.depends` kept beside the
    cache. Call it before the functions' first use in the process."""
    try:
        stamp = hashlib.sha256(b"".join(Path(p).read_bytes() for p in sources)).hexdigest()
        stamp_file = Path(functions[0]._cache._cache_path) / f"{name}.depends"
        if stamp_file.exists() and stamp_file.read_text() == stamp:
            return False
        for fn in functions:
            fn._cache.flush()
        stamp_file.write_text(stamp)
        return True
    except (AttributeError, OSError):  # a numba without these internals, or no cache dir
        return False
