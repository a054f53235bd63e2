"""Reading user text files (JSON Lines of objects, JSON, sample and rollout dumps), with
errors that name the file and line.

The one place where a user file's bytes become text: bytes that are not UTF-8 are an
`AppoError` naming `FILE:LINE:COL` and the byte, not a `UnicodeDecodeError` from deep
inside a loader. Stdlib only: used by the data loaders, the evaluation records, the rollout
dumps and the torch-free tools package.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from appo.errors import AppoError

SAVE_AS_UTF8 = "save the file as UTF-8"


def _not_utf8(path: Path, lineno: int, col: int, byte: int, hint: str) -> AppoError:
    return AppoError(f"{path}:{lineno}:{col}: not UTF-8 text (byte 0x{byte:02x}); {hint}")


def iter_lines(path: Path, hint: str = SAVE_AS_UTF8) -> Iterator[tuple[int, str]]:
    """(line number, text) for every line of a UTF-8 text file."""
    with Path(path).open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                yield lineno, raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise _not_utf8(path, lineno, e.start + 1, raw[e.start], hint) from None


def read_text(path: Path, hint: str = SAVE_AS_UTF8) -> str:
    """A whole UTF-8 text file."""
    data = Path(path).read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line_start = data.rfind(b"\n", 0, e.start) + 1
        raise _not_utf8(path, data.count(b"\n", 0, e.start) + 1, e.start - line_start + 1,
                        data[e.start], hint) from None


def iter_objects(path: Path, expected: str = "a JSON object") -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) for every non-blank line; AppoError on bad JSON or a non-object."""
    for lineno, line in iter_lines(path):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise AppoError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise AppoError(
                f"{path}:{lineno}: each line must be {expected}, got {type(row).__name__}"
            )
        yield lineno, row
