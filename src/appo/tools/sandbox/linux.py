"""Linux primitives for the sandbox's worker side: syscall and flag constants, thin ctypes
wrappers (unshare, mount, prctl, clone into new namespaces), and the seccomp filter that makes
socket() fail when there is no network namespace.

Worker-side module: imported in the zygote, so standard library only (see `zygote_main`).
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import signal
import socket
import struct

CLONE_NEWNS = 0x00020000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_NOEXEC = 0x8
MS_REMOUNT = 0x20
MS_NOATIME = 0x400
MS_NODIRATIME = 0x800
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 0x40000
MS_RELATIME = 0x200000
MNT_DETACH = 2
PR_SET_DUMPABLE = 4
PR_SET_NO_NEW_PRIVS = 38
PR_SET_CHILD_SUBREAPER = 36
PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2

_libc = ctypes.CDLL(None, use_errno=True)


# ---------------------------------------------------------------------------------------------
# Small syscall helpers
# ---------------------------------------------------------------------------------------------


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _unshare(flags: int) -> None:
    _check(_libc.unshare(ctypes.c_int(flags)), "unshare")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None):
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    _check(
        _libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)),
        f"mount {target}",
    )


_SYS_CLONE = {"x86_64": 56, "aarch64": 220}
_pylibc = ctypes.PyDLL(None, use_errno=True)  # PyDLL: the GIL stays held, as in os.fork()


def _fork_into_namespaces(flags: int) -> int:
    """os.fork() whose child starts in new namespaces (with CLONE_NEWPID it is PID 1 of a
    new PID namespace): the raw clone syscall wrapped in CPython's own fork hooks."""
    nr = _SYS_CLONE.get(platform.machine())
    if nr is None:
        raise OSError(errno.ENOSYS, "clone() not wired for this architecture")
    ctypes.pythonapi.PyOS_BeforeFork()
    pid = _pylibc.syscall(ctypes.c_long(nr), ctypes.c_ulong(flags | signal.SIGCHLD),
                          None, None, None, None)
    if pid == 0:
        ctypes.pythonapi.PyOS_AfterFork_Child()
        return 0
    err = ctypes.get_errno()
    ctypes.pythonapi.PyOS_AfterFork_Parent()
    if pid < 0:
        raise OSError(err, f"clone: {os.strerror(err)}")
    return pid


def _prctl(option: int, arg: int) -> None:
    _check(_libc.prctl(option, ctypes.c_ulong(arg), 0, 0, 0), f"prctl {option}")


def _write_file(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


# ---------------------------------------------------------------------------------------------
# seccomp: deny socket() except AF_UNIX (the fallback when there is no network namespace)
# ---------------------------------------------------------------------------------------------

_ARCH = {  # machine -> (AUDIT_ARCH, __NR_socket, __NR_io_uring_setup)
    "x86_64": (0xC000003E, 41, 425),
    "aarch64": (0xC00000B7, 198, 425),
}


def _install_socket_filter() -> bool:
    arch = _ARCH.get(platform.machine())
    if arch is None:
        return False
    audit_arch, nr_socket, nr_uring = arch
    ld, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06
    allow, deny = 0x7FFF0000, 0x00050000 | errno.EACCES
    # Program (jump offsets count instructions after the current one):
    prog = [
        (ld, 0, 0, 4),  # 0: A = arch
        (jeq, 0, 7, audit_arch),  # 1: foreign ABI (e.g. int 0x80) -> deny
        (ld, 0, 0, 0),  # 2: A = syscall nr
        (jge, 5, 0, 0x40000000),  # 3: x32 ABI -> deny
        (jeq, 4, 0, nr_uring),  # 4: io_uring could create sockets -> deny
        (jeq, 0, 2, nr_socket),  # 5: not socket() -> allow
        (ld, 0, 0, 16),  # 6: A = domain (args[0], low word)
        (jeq, 0, 1, socket.AF_UNIX),  # 7: AF_UNIX -> allow, else deny
        (ret, 0, 0, allow),  # 8
        (ret, 0, 0, deny),  # 9
    ]
    raw = b"".join(struct.pack("HBBI", *ins) for ins in prog)
    buf = ctypes.create_string_buffer(raw)

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    fprog = SockFprog(len(prog), ctypes.addressof(buf))
    ret_code = _libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0)
    return ret_code == 0


def _block_sockets_in_process() -> None:
    """Last resort on architectures without our seccomp program: Python-level only."""
    def refuse(*_a, **_k):
        raise PermissionError(errno.EACCES, "network access is disabled in the sandbox")

    class NoSocket(socket.socket):
        def __init__(self, family=-1, *a, **k):
            if family not in (socket.AF_UNIX,):
                refuse()
            super().__init__(family, *a, **k)

    socket.socket = NoSocket  # type: ignore[misc]
    socket.create_connection = refuse  # type: ignore[assignment]
