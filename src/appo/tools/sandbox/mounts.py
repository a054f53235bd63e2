"""The zygote's filesystem view, set up once in its mount namespace: every mount remounted
read-only, and the directories on the Python path that the sandbox uid may not traverse (e.g.
a venv under /root) exposed through a tmpfs holding bind mounts of just those entries.

Worker-side module: standard library and sibling modules only (see `zygote_main`).
"""

from __future__ import annotations

import os

from .linux import (
    MS_BIND,
    MS_NOATIME,
    MS_NODEV,
    MS_NODIRATIME,
    MS_NOEXEC,
    MS_NOSUID,
    MS_RDONLY,
    MS_REC,
    MS_RELATIME,
    MS_REMOUNT,
    _mount,
)


def _others_can(path: str, bits: int) -> bool:
    try:
        return os.stat(path).st_mode & bits == bits
    except OSError:
        return False


def _mask_dir(directory: str, keep: dict[str, int]) -> None:
    """Mount a small tmpfs over `directory`, re-exposing only the entries in `keep`
    (name -> O_PATH fd opened before the tmpfs hid them) through bind mounts."""
    _mount("tmpfs", directory, "tmpfs", MS_NOSUID | MS_NODEV, "mode=755,size=1m")
    for name, fd in keep.items():
        target = os.path.join(directory, name)
        if os.path.isdir(f"/proc/self/fd/{fd}"):
            os.mkdir(target, 0o755)
        else:
            open(target, "w").close()
        _mount(f"/proc/self/fd/{fd}", target, None, MS_BIND | MS_REC, None)


def _expose_untraversable(paths: list[str]) -> list[str]:
    """Make every directory on `paths` traversable for an unprivileged uid (root mode)."""
    masked: list[str] = []
    while True:
        blocked: dict[str, set[str]] = {}
        for path in paths:
            parts = [p for p in path.split("/") if p]
            cur = "/"
            for part in parts:
                nxt = os.path.join(cur, part)
                if not os.path.exists(nxt):
                    break
                if not _others_can(cur, 0o001):
                    blocked.setdefault(cur, set()).add(part)
                    break
                cur = nxt
        blocked = {d: names for d, names in blocked.items() if d not in masked}
        if not blocked:
            return masked
        for directory, names in sorted(blocked.items()):
            keep = {n: os.open(os.path.join(directory, n), os.O_PATH) for n in names}
            try:
                _mask_dir(directory, keep)
            finally:
                for fd in keep.values():
                    os.close(fd)
            masked.append(directory)


_FLAG_OPTS = {
    "nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC,
    "noatime": MS_NOATIME, "nodiratime": MS_NODIRATIME, "relatime": MS_RELATIME,
}


def _remount_all_readonly() -> int:
    """Bind-remount every mount read-only (keeping its nosuid/nodev/... flags: in a user
    namespace those are locked). Returns how many mounts could not be made read-only."""
    failed = 0
    with open("/proc/self/mountinfo") as f:
        lines = f.read().splitlines()
    for line in lines:
        fields = line.split()
        target = fields[4].replace("\\040", " ")
        if target.startswith(("/proc", "/sys")):
            continue
        flags = MS_BIND | MS_REMOUNT | MS_RDONLY
        for opt in fields[5].split(","):
            flags |= _FLAG_OPTS.get(opt, 0)
        try:
            _mount(None, target, None, flags, None)
        except OSError:
            failed += 1
    return failed
