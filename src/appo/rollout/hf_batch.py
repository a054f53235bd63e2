"""The hf engine's cache state: per-row KV blocks, the batch buffer, and one decode call's batch.

- `KVBlock`: the keys/values of a row's first tokens; immutable, shared between forks.
- `HFRow`: an engine row (`appo.rollout.rows.Row`) with its KV block; a fork keeps the part
  of the parent's block its tokens cover.
- `BatchCache`: the cache object handed to the model for one forward; it writes the new keys
  and values into the batch buffer `[layers, 2, rows, kv_heads, capacity, head_dim]`.
- `DecodeBatch`: the state of one `decode` call, from the first sampled token to the last:
  the buffer, which batch slot each row sits in, which rows still sample, how many tokens
  each row has cached, the logits to sample from, the repetition-penalty mask. Rows are
  right-aligned in the buffer (each row's tokens end at the same column, `length`); a row
  that stops stays in the batch as a hole until `compact` drops it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from appo.rollout.rows import Row


class KVBlock:
    """Keys/values of a row's first `length` tokens: the `parent` block's (the prefix the
    row shares with others, e.g. a system prompt, stored once), then `data`
    `[layers, 2, kv_heads, n, head_dim]`, its own tokens after the parent's.

    Immutable once made (its own storage, or a prefix view of another block); shared between
    forks.
    """

    __slots__ = ("data", "parent")

    def __init__(self, data: Tensor, parent: KVBlock | None = None):
        self.data = data
        self.parent = parent

    @property
    def length(self) -> int:
        return int(self.data.shape[3]) + (0 if self.parent is None else self.parent.length)

    @classmethod
    def copy_of(cls, data: Tensor, parent: KVBlock | None = None) -> KVBlock:
        """A block owning exactly these keys/values (after `parent`'s): a view into a batch
        buffer would keep the whole buffer (every other row, padding, spare columns) alive
        as long as the row lives."""
        return cls(data.clone(memory_format=torch.contiguous_format), parent)

    def prefix(self, length: int) -> KVBlock:
        if length == self.length:
            return self
        base = 0 if self.parent is None else self.parent.length
        if length <= base:
            return self.parent.prefix(length)
        return KVBlock(self.data[:, :, :, : length - base], self.parent)

    def write_into(self, dst: Tensor) -> None:
        """Copy the block's keys/values into `dst` `[layers, 2, kv_heads, length, head_dim]`."""
        base = 0
        if self.parent is not None:
            base = self.parent.length
            self.parent.write_into(dst[:, :, :, :base])
        dst[:, :, :, base:] = self.data


@dataclass
class HFRow(Row):
    """A row of the hf engine: its tokens but the last ("pending") ones are in `kv`."""

    kv: KVBlock | None = None

    @property
    def kv_len(self) -> int:
        return 0 if self.kv is None else self.kv.length

    def branch(self, ids: list[int], seg_start: int) -> HFRow:
        kv = self.kv
        if kv is not None and kv.length > len(ids) - 1:
            kv = kv.prefix(len(ids) - 1)  # the last kept token stays pending
        return HFRow(ids, seg_start, kv)


class BatchCache:
    """The cache object handed to the model: writes new keys/values into the buffer.

    Only `update` and `get_seq_length` are used by transformers' decoder layers once a 4D
    mask and explicit position ids are given. `write_mask` (`[rows, T]` bool) protects
    columns that hold a row's earlier tokens from padding queries' keys/values.
    """

    def __init__(self, buf: Tensor, length: int, write_mask: Tensor | None = None):
        self.buf = buf
        self.length = length  # columns filled before the current forward
        self.write_mask = write_mask

    def update(self, key: Tensor, value: Tensor, layer_idx: int, *_: object, **__: object):
        lo, hi = self.length, self.length + key.shape[2]
        for slot, new in ((0, key), (1, value)):
            dst = self.buf[layer_idx, slot, :, :, lo:hi]
            if self.write_mask is None:
                dst.copy_(new)
            else:
                dst.copy_(torch.where(self.write_mask[:, None, :, None], new, dst))
        return self.buf[layer_idx, 0, :, :, :hi], self.buf[layer_idx, 1, :, :, :hi]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length


def gather_rows(buf: Tensor, slots: list[int], lo: int, hi: int, capacity: int) -> Tensor:
    """A new buffer holding columns [lo, hi) of the given batch rows, with room for
    `capacity` columns (row-wise copies: much faster than advanced indexing of a 6-D
    tensor). Columns past `hi - lo` are uninitialised: they are written before being read."""
    layers, _, _, heads, _, dim = buf.shape
    out = buf.new_empty((layers, 2, len(slots), heads, capacity, dim))
    for j, s in enumerate(slots):
        out[:, :, j, :, : hi - lo] = buf[:, :, s, :, lo:hi]
    return out


class DecodeBatch:
    """One decode call's rows in the batch buffer (see module docstring).

    Row `i` (an index into `rows`) sits in batch slot `slot[i]` (-1 once compacted out), has
    `cached[i]` tokens in the buffer (its columns `start[slot]:start[slot] + cached[i]`) and
    samples while `active[i]`. The rows hand their KV blocks to the batch on entry; a row
    leaving the batch (`compact`, `close`) gets a copy of its own columns, so no buffer
    outlives its decode call.
    """

    def __init__(self, rows: list[HFRow], buf: Tensor, length: int, start: Tensor,
                 logits: Tensor, seen: Tensor | None, shared: KVBlock | None,
                 cascade: bool = False):
        self.rows = rows
        self.buf = buf
        self.length = length  # columns filled
        self.start = start  # [slots] first column of each slot's tokens
        self.logits = logits  # [slots, V] logits after each slot's last token
        self.seen = seen  # [slots, V] tokens each slot has seen (repetition penalty)
        # The keys/values of the prefix every row shares, stored once: the parent of the
        # blocks rows leave with, and (`cascade`) read once by decode attention.
        self.shared = shared
        self.cascade = cascade
        self.slot = list(range(len(rows)))
        self.cached = [len(r.ids) for r in rows]  # every token is cached after the prefill
        self.active = [True] * len(rows)
        for row in rows:
            row.kv = None  # copied out of the buffer when the row leaves the batch

    # ---------------------------------------------------------------- reading
    @property
    def size(self) -> int:
        """Slots in the batch (active rows and the holes of stopped ones)."""
        return int(self.buf.shape[2])

    @property
    def any_active(self) -> bool:
        return any(self.active)

    def in_batch(self) -> list[int]:
        return [i for i, s in enumerate(self.slot) if s >= 0]

    def sampling(self) -> list[int]:
        """The rows that sample a token next, in row order."""
        return [i for i in self.in_batch() if self.active[i]]

    def slots_of(self, members: list[int]) -> Tensor:
        return torch.tensor([self.slot[i] for i in members], device=self.buf.device)

    @property
    def shared_kv(self) -> Tensor | None:
        """The shared prefix's keys/values for cascade decode attention (None: off)."""
        return self.shared.data if self.cascade and self.shared is not None else None

    def _kv_of(self, i: int) -> KVBlock:
        """Row `i`'s block: a copy of its own columns after the shared prefix, whose block
        is their parent (one copy of a system prompt for every row, not one per row)."""
        s = self.slot[i]
        first = int(self.start[s])
        base = 0 if self.shared is None else self.shared.length
        return KVBlock.copy_of(self.buf[:, :, s, :, first + base : first + self.cached[i]],
                               self.shared)

    # ---------------------------------------------------------------- sampling
    def add_tokens(self, members: list[int], tokens: list[int]) -> None:
        """Rows `members` sampled `tokens` (one each): each is its row's pending token for
        the next step. One indexed write into the repetition-penalty mask for all of them:
        a tensor item assignment per row is ~6 dispatched op calls (the penalty's largest
        per-row cost at 32 rows)."""
        for i, token in zip(members, tokens, strict=True):
            self.rows[i].ids.append(token)
        if self.seen is not None and members:
            device = self.seen.device
            self.seen[torch.tensor([self.slot[i] for i in members], device=device),
                      torch.tensor(tokens, device=device)] = True

    def stop(self, i: int) -> None:
        self.active[i] = False

    # ---------------------------------------------------------------- the buffer
    def compact(self, fraction: float) -> None:
        """Drop the stopped rows from the batch once they are at least `fraction` of it (and
        at least one): they keep a copy of their tokens' cache, and the remaining rows move
        to a new buffer from their first used column; the old buffer is then freed."""
        members = self.in_batch()
        stopped = [i for i in members if not self.active[i]]
        if not stopped or len(stopped) < max(1, int(fraction * len(members))):
            return
        for i in stopped:
            self.rows[i].kv = self._kv_of(i)
            self.slot[i] = -1
        keep = [i for i in members if self.active[i]]
        keep_slots = self.slots_of(keep)
        start = self.start.index_select(0, keep_slots)
        lo = int(start.min())
        self.buf = gather_rows(self.buf, [self.slot[i] for i in keep], lo, self.length,
                               self.buf.shape[4] - lo)
        self.start, self.length = start - lo, self.length - lo
        if self.seen is not None:
            self.seen = self.seen.index_select(0, keep_slots)
        self.logits = self.logits.index_select(0, keep_slots)
        for s, i in enumerate(keep):
            self.slot[i] = s

    def ensure_room(self, chunk: int) -> None:
        """Grow the buffer by `chunk` columns when the next step would not fit."""
        if self.length >= self.buf.shape[4]:
            self.buf = gather_rows(self.buf, list(range(self.size)), 0, self.length,
                                   self.buf.shape[4] + chunk)

    # ---------------------------------------------------------------- one step
    def step_inputs(self, pad_id: int) -> tuple[Tensor, Tensor]:
        """Token ids and positions `[slots, 1]` of the next decode step: each active row's
        pending token; holes get padding (their output is never read)."""
        # Filled as Python lists, then one tensor each: a tensor item assignment per row
        # is several dispatched op calls (the step's largest per-row cost at 32 rows).
        ids, pos = [pad_id] * self.size, [0] * self.size
        for i in self.sampling():
            ids[self.slot[i]] = self.rows[i].ids[-1]
            pos[self.slot[i]] = self.cached[i]
        return (torch.tensor(ids, dtype=torch.long).reshape(self.size, 1),
                torch.tensor(pos, dtype=torch.long).reshape(self.size, 1))

    def cache(self) -> BatchCache:
        return BatchCache(self.buf, self.length)

    def advance(self, logits: Tensor) -> int:
        """After a decode step's forward: its logits, one more column filled, one more
        cached token per active row. Returns the tokens decoded (the active rows)."""
        self.logits = logits
        self.length += 1
        decoded = self.sampling()
        for i in decoded:
            self.cached[i] += 1
        return len(decoded)

    def close(self) -> None:
        """The rows still in the batch keep a copy of their tokens' cache; the buffer goes."""
        for i in self.in_batch():
            self.rows[i].kv = self._kv_of(i)
