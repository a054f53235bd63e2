"""Where appo keeps files it creates: the cache root (`$APPO_CACHE`, default ~/.cache/appo),
and the check that an output directory can be written before a command starts work."""

import os
import tempfile
from pathlib import Path

from appo.errors import AppoError


def cache_dir(*parts: str) -> Path:
    """Return (and create) a directory under the appo cache root."""
    root = Path(os.environ.get("APPO_CACHE") or Path.home() / ".cache" / "appo").expanduser()
    path = root.joinpath(*parts)
    path.mkdir(parents=True, exist_ok=True)
    return path


def check_output_dir(path: str | os.PathLike, key: str) -> None:
    """AppoError (one line naming the directory and the config key) unless `path` is, or can
    be created as, a directory appo can write: a file in the way, a read-only or full disk
    then stops a run in its first second, not at its first checkpoint an hour later.

    The check writes for real (a probe file, and the missing directories) rather than asking
    `os.access`, which answers "yes" for root on a read-only mount; whatever it created is
    removed again, so a command that fails later leaves no empty directories behind.
    """
    target = Path(path).expanduser()
    existing = target
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        what = "is a file" if existing == target else f"cannot be created: {existing} is a file"
        raise AppoError(f"output directory {target} ({key}) {what}")
    created = [d for d in (target, *target.parents) if d != existing and existing in d.parents]
    try:
        target.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=target, prefix=".appo-write-check-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise AppoError(f"cannot write to output directory {target} ({key}): "
                        f"{e.strerror or type(e).__name__}") from None
    finally:
        for d in created:  # deepest first
            try:
                d.rmdir()
            except OSError:
                pass
