"""The row bookkeeping every engine shares: rows by id, forks, forced tokens, release.

An engine row is a token sequence plus the start of its current model segment (stop strings
are matched inside the segment only). `RowTable` holds an engine's rows and implements the
row operations of the engine protocol (`appo.rollout.engine`); `TableRows` is the mixin that
exposes them as the engine's own methods. An engine that keeps more per row (the hf engine's
KV cache block) subclasses `Row` and overrides `Row.branch`, which makes a fork's row.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

from appo.errors import AppoError


def fork_point(ids: list[int], seg_start: int, at: int | None,
               segment_start: int | None) -> tuple[list[int], int]:
    """The tokens and current-segment start of a fork (`Engine.fork`): `at` truncates to the
    first `at` tokens (the segment start moves back with it), `segment_start` overrides."""
    if at is not None:
        if not 1 <= at <= len(ids):
            raise AppoError(f"fork position {at} outside row of {len(ids)} tokens")
        ids, seg_start = ids[:at], min(seg_start, at)
    return list(ids), seg_start if segment_start is None else segment_start


@dataclass
class Row:
    """A row's token ids and the first token of its current model segment."""

    ids: list[int]
    seg_start: int

    def branch(self, ids: list[int], seg_start: int) -> Row:
        """The row of a fork of this one, holding `ids` (a prefix of this row's tokens).
        Other fields are copied as they are; subclasses whose state depends on the tokens
        override this."""
        return dataclasses.replace(self, ids=ids, seg_start=seg_start)


R = TypeVar("R", bound=Row)


class RowTable(Generic[R]):
    """An engine's rows by id. Ids are never reused, so a released id stays invalid."""

    def __init__(self, row_type: type[R] = Row):  # type: ignore[assignment]
        self.row_type = row_type
        self._rows: dict[int, R] = {}
        self._next_id = 0

    def _insert(self, row: R) -> int:
        rid = self._next_id
        self._next_id += 1
        self._rows[rid] = row
        return rid

    def __getitem__(self, rid: int) -> R:
        try:
            return self._rows[rid]
        except KeyError:
            raise AppoError(f"engine row {rid} does not exist (released?)") from None

    def many(self, rids: Iterable[int]) -> list[R]:
        """The rows of `rids`, in order (an unknown or released id raises)."""
        return [self[rid] for rid in rids]

    def __len__(self) -> int:
        return len(self._rows)

    def __contains__(self, rid: object) -> bool:
        return rid in self._rows

    def __iter__(self) -> Iterator[int]:
        return iter(self._rows)

    def add(self, prompt_ids: Iterable[int]) -> int:
        """A root row holding the prompt; its model segment starts after it."""
        ids = [int(t) for t in prompt_ids]
        if not ids:
            raise AppoError("cannot start a row from an empty prompt")
        return self._insert(self.row_type(ids, len(ids)))

    def fork(self, rid: int, k: int = 1, at: int | None = None,
             segment_start: int | None = None) -> list[int]:
        """`k` new rows copying row `rid`, truncated to its first `at` tokens if given
        (see `fork_point`)."""
        parent = self[rid]
        ids, seg = fork_point(parent.ids, parent.seg_start, at, segment_start)
        # Branch once, then copy that: the k rows share what the branch made (the hf
        # engine's truncated KV block), so the engine can tell they need one prefill.
        template = parent.branch(list(ids), seg)
        return [self._insert(template.branch(list(ids), seg)) for _ in range(k)]

    def append(self, rid: int, token_ids: Iterable[int]) -> None:
        """Forced tokens (e.g. a tool result); a new model segment starts after them."""
        row = self[rid]
        row.ids.extend(int(t) for t in token_ids)
        row.seg_start = len(row.ids)

    def ids(self, rid: int) -> list[int]:
        """A copy of the row's token ids."""
        return list(self[rid].ids)

    def release(self, rids: Iterable[int]) -> None:
        """Forget rows (unknown or already released ids are ignored)."""
        for rid in rids:
            self._rows.pop(rid, None)


class TableRows:
    """The row operations of the engine protocol, on the engine's `self.rows` table."""

    rows: RowTable

    def add_row(self, prompt_ids: list[int]) -> int:
        return self.rows.add(prompt_ids)

    def fork(self, row: int, k: int = 1, at: int | None = None,
             segment_start: int | None = None) -> list[int]:
        return self.rows.fork(row, k, at, segment_start)

    def append(self, row: int, token_ids: list[int]) -> None:
        self.rows.append(row, token_ids)

    def row_ids(self, row: int) -> list[int]:
        return self.rows.ids(row)

    def release(self, rows: list[int]) -> None:
        self.rows.release(rows)

    @property
    def live_rows(self) -> int:
        return len(self.rows)
