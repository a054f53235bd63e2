"""Real filesystems for tests of full and read-only disks (root only: the tests that use
these skip elsewhere): a small tmpfs, and a read-only bind mount of a directory."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

MS_RDONLY, MS_REMOUNT, MS_BIND, MNT_DETACH = 1, 32, 4096, 2


def _libc():
    return ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


def _mount(libc, source: bytes | None, target: Path, fstype: bytes | None, flags: int,
           data: bytes | None) -> None:
    if libc.mount(source, str(target).encode(), fstype, flags, data) != 0:
        pytest.skip(f"cannot mount here: {os.strerror(ctypes.get_errno())}")


@contextlib.contextmanager
def small_tmpfs(path: Path, size: str = "48k") -> Iterator[Path]:
    """`path` (created) as a tmpfs of `size`: large writes there fail with ENOSPC."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    libc = _libc()
    path.mkdir(parents=True, exist_ok=True)
    _mount(libc, b"tmpfs", path, b"tmpfs", 0, f"size={size}".encode())
    try:
        yield path
    finally:
        libc.umount2(str(path).encode(), MNT_DETACH)


@contextlib.contextmanager
def read_only(path: Path) -> Iterator[Path]:
    """`path` bind-mounted over itself read-only (EROFS for every write, root's too)."""
    if os.geteuid() != 0:
        pytest.skip("a read-only bind mount needs root")
    libc = _libc()
    _mount(libc, str(path).encode(), path, None, MS_BIND, None)
    try:
        _mount(libc, None, path, None, MS_REMOUNT | MS_BIND | MS_RDONLY, None)
        yield path
    finally:
        libc.umount2(str(path).encode(), MNT_DETACH)
