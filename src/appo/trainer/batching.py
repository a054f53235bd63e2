"""Micro-batches by token budget (verl's dynamic batch size) and padded collation.

Rows are sorted by length and packed greedily so that a micro-batch's padded size
(`rows * longest row`) stays within `max_tokens`. Sorting keeps rows of similar length
together, which is what keeps padding small; the padding fraction is reported so a
researcher can see it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class MicroBatchPlan:
    batches: list[list[int]]  # row indices per micro-batch
    real_tokens: int
    padded_tokens: int
    rows_tokens: int = 0  # sum of row lengths; differs from real_tokens with a shared prefix

    @property
    def padding_fraction(self) -> float:
        return 1.0 - self.real_tokens / self.padded_tokens if self.padded_tokens else 0.0


def plan_microbatches(lengths: list[int], max_tokens: int) -> MicroBatchPlan:
    """Group row indices so each group's `len(group) * max(length)` <= max_tokens.

    A row longer than the budget gets a micro-batch of its own (it has to be computed
    somehow; the budget is a memory target, not a correctness bound).
    """
    if max_tokens < 1:
        raise ValueError("max_tokens must be >= 1")
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    batches: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i in order:
        new_longest = max(longest, lengths[i])
        if current and new_longest * (len(current) + 1) > max_tokens:
            batches.append(current)
            current, new_longest = [], lengths[i]
        current.append(i)
        longest = new_longest
    if current:
        batches.append(current)
    padded = sum(len(b) * max(lengths[i] for i in b) for b in batches)
    return MicroBatchPlan(batches=batches, real_tokens=sum(lengths), padded_tokens=padded)


def pad_right(rows: list[list[int]] | list[list[float]], value, dtype) -> torch.Tensor:
    """`[B, T]` tensor of rows padded on the right with `value`."""
    width = max((len(r) for r in rows), default=0)
    out = torch.full((len(rows), width), value, dtype=dtype)
    for i, row in enumerate(rows):
        if row:
            out[i, : len(row)] = torch.as_tensor(row, dtype=dtype)
    return out
