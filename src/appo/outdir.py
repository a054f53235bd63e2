"""One owner per output directory, and what produced it.

Two appo processes writing one directory mix their outputs (two resumed runs logging the
same steps, an overwrite deleting a live run's files, two evaluations appending to one
samples file). So every command that writes a run, eval or compare directory first takes
`lock_dir(path)`: an exclusive `flock` on `path/.appo.lock`, held for as long as the
command writes there (at the latest until the process ends: the kernel drops the lock of a
dead process, so a killed run never leaves a stale lock behind). A second process is
refused with one line naming the directory and the holder's pid.

Locks are re-entrant within one process (a library caller, or a test, that runs a resume
after a run in the same process): `flock` would otherwise refuse a process its own lock
held through another descriptor.

`check_identity` records what produced a directory (a small JSON file) and refuses a rerun
that would mix in outputs of another definition (another model, other sampling).
"""

from __future__ import annotations

import fcntl
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from appo.errors import AppoError
from appo.fsutil import atomic_write_bytes, atomic_write_text, write_error

LOCK_NAME = ".appo.lock"

# (st_dev, st_ino) of a lock file this process holds -> [descriptor, holders]
_HELD: dict[tuple[int, int], list[int]] = {}


@dataclass
class DirLock:
    """A held lock; `release()` drops this holder (the lock goes with the last one, and with
    the last `DirLock` object that refers to it)."""

    path: Path  # the directory (where it was when locked; a rename takes the lock along)
    key: tuple[int, int]
    released: bool = False
    created: list[Path] = field(default_factory=list)  # directories made for it, deepest first

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        entry = _HELD.get(self.key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] <= 0:
            del _HELD[self.key]
            if self.created:  # nothing was written: no empty directory stays behind
                _remove_if_only_lock(self.path, self.created)
            os.close(entry[0])  # closing the descriptor releases the flock


    def __del__(self) -> None:
        # A holder that is gone (a trainer dropped without `fit()`) lets go of the directory.
        try:
            self.release()
        except Exception:  # noqa: BLE001 - interpreter shutdown: the kernel releases it
            pass


def _remove_if_only_lock(path: Path, created: list[Path]) -> None:
    try:
        if [p.name for p in path.iterdir()] != [LOCK_NAME]:
            return
        (path / LOCK_NAME).unlink()
        for d in created:
            d.rmdir()
    except OSError:
        return


def holder_pid(path: str | Path) -> int | None:
    """The pid written into a directory's lock file by its holder (None if unreadable)."""
    try:
        text = (Path(path) / LOCK_NAME).read_text().strip()
        return int(text) if text else None
    except (OSError, ValueError):
        return None


def lock_dir(path: str | Path, what: str = "output directory") -> DirLock:
    """Lock `path` (created if missing) for this process; AppoError, one line, when another
    process holds it: `<what> <path> is in use by pid N`."""
    path = Path(path)
    lock_file = path / LOCK_NAME
    created = [d for d in (path, *path.parents) if not d.exists()]
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock_file, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise write_error(e, lock_file, "lock") from None
    st = os.fstat(fd)
    key = (st.st_dev, st.st_ino)
    if key in _HELD:  # ours already (see the module docstring)
        os.close(fd)
        _HELD[key][1] += 1
        return DirLock(path, key)  # the first holder removes what it created
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        pid = holder_pid(path)
        who = f"pid {pid}" if pid is not None else "another process"
        raise AppoError(f"{what} {path} is in use by {who} (another appo command writes "
                        "there); wait for it to end, or choose another directory") from None
    except OSError as e:  # a filesystem without locks (some network mounts)
        os.close(fd)
        raise write_error(e, lock_file, "lock") from None
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
    except OSError:
        pass  # the lock holds without the pid; a refusal then says "another process"
    _HELD[key] = [fd, 1]
    return DirLock(path, key, created=created)


def write_output(path: str | Path, data: str | bytes) -> None:
    """Write a user's output file atomically (a temporary sibling, then `os.replace`): a
    reader, or a full disk, never sees it half written, and a failed write leaves the old
    file; the failure is one line naming the path and the cause (no space left on device,
    read-only file system, permission denied)."""
    path = Path(path)
    try:
        atomic_write_bytes(path, data.encode("utf-8") if isinstance(data, str) else data)
    except OSError as e:
        raise write_error(e, path) from None


def is_appo_file(name: str) -> bool:
    """Files appo keeps in any output directory besides its outputs (the lock)."""
    return name == LOCK_NAME


def outputs_in(path: Path) -> list[Path]:
    """The entries of a directory that are outputs (everything but the lock file)."""
    return sorted(p for p in path.iterdir() if not is_appo_file(p.name))


# ---------------------------------------------------------------- what produced it
def differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """`key: old -> new` for every key whose value differs (keys of either side)."""
    out = []
    for key in sorted(set(old) | set(new)):
        if old.get(key) != new.get(key):
            out.append(f"{key}: {_show(old.get(key))} -> {_show(new.get(key))}")
    return out


def _show(value: Any) -> str:
    text = json.dumps(value, sort_keys=True) if not isinstance(value, str) else value
    return text if len(text) <= 60 else text[:57] + "..."


def check_identity(path: str | Path, name: str, identity: dict[str, Any], *,
                   what: str, how: str, has_outputs: bool = True) -> None:
    """Refuse (one line) when `path/name` records another identity than `identity` and the
    directory `has_outputs`; otherwise record `identity` there. `what` names the directory
    in the message (e.g. `--out runs/eval`), `how` says how to proceed."""
    file = Path(path) / name
    identity = json.loads(json.dumps(identity))  # the JSON form: tuples as lists etc.
    if file.is_file() and has_outputs:  # with no outputs yet, the record is simply renewed
        try:
            old = json.loads(file.read_text(encoding="utf-8"))
        except (OSError, ValueError, UnicodeDecodeError) as e:
            raise AppoError(f"{file}: unreadable record of what produced {what} "
                            f"({type(e).__name__}); {how}") from None
        if not isinstance(old, dict):
            raise AppoError(f"{file}: not a record of what produced {what}; {how}")
        diff = differences(old, identity)
        if not diff:
            return
        more = f" (and {len(diff) - 2} more)" if len(diff) > 2 else ""
        raise AppoError(f"{what} was made with other settings ({'; '.join(diff[:2])}{more}): "
                        f"its outputs would be mixed with these; {how}")
    try:
        atomic_write_text(file, json.dumps(identity, indent=1, sort_keys=True) + "\n")
    except OSError as e:
        raise write_error(e, file) from None
