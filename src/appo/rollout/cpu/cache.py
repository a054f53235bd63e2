"""Values derived from a tensor (a numpy view, a packed copy), kept while it lives: one
cache shared by the decode matmul kernels (`kernels`, `panels`)."""

from __future__ import annotations

import weakref

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
