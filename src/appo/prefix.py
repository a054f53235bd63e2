"""Longest common prefix of token sequences (shared by the rollout engine's prefill and the
training forward, which both compute a common prefix once)."""

from __future__ import annotations

from collections.abc import Sequence


def common_prefix_length(rows: Sequence[Sequence[int]], limit: int | None = None) -> int:
    """Length of the longest prefix every row starts with, at most `limit` (0 for no rows)."""
    if not rows:
        return 0
    first = rows[0]
    n = min(len(r) for r in rows)
    if limit is not None:
        n = min(n, limit)
    for row in rows[1:]:
        k = 0
        while k < n and row[k] == first[k]:
            k += 1
        n = k
        if n == 0:
            break
    return n
