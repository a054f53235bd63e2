"""Atomic file and directory writes, and the one place a failed write becomes a message.

A reader (a resumed run, another process, a crash) must only ever see the old content or
the new one, never a half-written file or no file at all:

- `atomic_write_text` / `atomic_write_bytes`: a sibling temporary file, fsync'd, then
  `os.replace` (atomic on POSIX).
- `atomic_dir(final)`: build a directory under a temporary name; on success the old
  `final` is renamed aside, the new one renamed in, and only then the old one deleted.
  A crash at any moment leaves either the old or the new directory under `final`, or the
  old one under its aside name, which `recover_leftovers` renames back at the next start.
  On failure the temporary directory is removed.
- `output_file(path)`: a temporary sibling path for a writer that wants a path (pyarrow, a
  JSONL loop); on success it replaces `path`, on failure it is removed and a failed write
  becomes `write_error`'s one line, so a full disk leaves neither a half file nor a temp.
- `write_error(exc, path)`: an `OSError` (or a library's wrapped write failure, e.g. torch's
  "file write failed") as one `AppoError` line naming the path, "no space left on device"
  when that is the cause.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from appo.errors import AppoError

TMP_PREFIX = ".tmp_"
OLD_PREFIX = ".old_"


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    path = Path(path)
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}_{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


@contextlib.contextmanager
def output_file(path: str | Path) -> Iterator[Path]:
    """Yield a temporary sibling of `path` to write the whole new file to; on a clean exit
    it is fsync'd and renamed over `path`. On any failure it is removed; a failed write
    (the temp or `path` itself, or a library's wrapped write error) is raised as one
    `AppoError` naming `path`, anything else (a bad input's error) unchanged."""
    path = Path(path)
    tmp = _tmp_name(path)
    try:
        yield tmp
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if _is_own_write_failure(exc, (tmp, path)):
            raise write_error(exc, path) from exc
        raise


def _is_own_write_failure(exc: BaseException, paths: tuple[Path, ...]) -> bool:
    """A write failure of one of `paths` (an OSError naming another file is that file's)."""
    if isinstance(exc, OSError) and exc.filename is not None:
        return Path(str(exc.filename)) in paths
    return isinstance(exc, Exception) and is_write_failure(exc)


def _tmp_name(final: Path) -> Path:
    return final.with_name(f"{TMP_PREFIX}{final.name}_{os.getpid()}")


def _old_name(final: Path) -> Path:
    return final.with_name(f"{OLD_PREFIX}{final.name}_{os.getpid()}")


@contextlib.contextmanager
def atomic_dir(final: str | Path) -> Iterator[Path]:
    """Yield a temporary directory to fill; on a clean exit it replaces `final` atomically
    (the old `final`, if any, is deleted only after the new one is in place)."""
    final = Path(final)
    tmp = _tmp_name(final)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = _old_name(final)
    try:
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(tmp, final)
    except BaseException:
        # Put the old directory back if the new one did not make it into place.
        if old.exists() and not final.exists():
            os.replace(old, final)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(old, ignore_errors=True)


def recover_leftovers(root: str | Path) -> list[str]:
    """After a crash: rename an aside directory back when its new version never arrived,
    delete temporary and superseded ones. Returns what it did, one note per entry. Call it
    only where no other process is writing under `root` (a run's own directory at start-up,
    or behind a lock)."""
    root = Path(root)
    notes: list[str] = []
    if not root.is_dir():
        return notes
    for entry in sorted(root.iterdir()):
        name = entry.name
        if name.startswith(OLD_PREFIX):
            target = root / name[len(OLD_PREFIX):].rsplit("_", 1)[0]
            if not target.exists():
                os.replace(entry, target)
                notes.append(f"restored {target.name} (a save was interrupted)")
                continue
            _remove(entry)
            notes.append(f"removed {name} (superseded)")
        elif name.startswith(TMP_PREFIX):
            _remove(entry)
            notes.append(f"removed {name} (an interrupted write)")
    return notes


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


# Library errors that wrap a failed write without an errno (numpy, torch): torch's zip writer on a full
# disk says "[enforce fail at inline_container.cc:672] . unexpected pos 82048 vs 81936"
# (measured on a full tmpfs) or "file write failed"; safetensors says "StorageFull".
_TORCH_WRITER = ("inline_container.cc", "pytorchstreamwriter", "file write failed",
                 " requested and ")  # numpy's short write: "12000 requested and 2016 written"
_NO_SPACE = ("no space left", "storagefull", "os error 28")
_WRITE_FAILURE_HINTS = (*_TORCH_WRITER, *_NO_SPACE, "disk quota")


def is_write_failure(exc: BaseException) -> bool:
    if isinstance(exc, OSError):
        return True
    text = str(exc).lower()
    return any(hint in text for hint in _WRITE_FAILURE_HINTS)


def write_error(exc: BaseException, path: str | Path, what: str = "write") -> AppoError:
    """One line for a failed write under `path`: the cause in words, never a C++ trace.
    Call it before the partial files are removed: torch hides the errno, so a nearly full
    disk at that moment is taken as the cause."""
    path = Path(path)
    text = str(exc)
    lower = text.lower()
    no_space = (isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)) or any(
        hint in lower for hint in _NO_SPACE)
    torch_writer = any(hint in lower for hint in _TORCH_WRITER)
    if not no_space and torch_writer:
        with contextlib.suppress(OSError):
            no_space = shutil.disk_usage(existing_parent(path)).free < 64 * 2**20
    if no_space:
        reason = "no space left on device"
    elif isinstance(exc, OSError) and exc.strerror:
        reason = exc.strerror.lower()
    elif torch_writer:
        reason = "write failed (" + text.splitlines()[0].split("] .")[-1].strip() + ")"
    else:
        reason = text.splitlines()[0] if text else type(exc).__name__
    return AppoError(f"could not {what} {path}: {reason}")


def existing_parent(path: Path) -> Path:
    """`path` or its nearest ancestor that exists."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path
