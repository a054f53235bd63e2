"""The code process's isolation, applied by the process itself between its fork and the
code's arrival: its own session and IPC namespace, rlimits, an empty environment, the uid
drop, `no_new_privs` and the socket filter; then `runtime.Runtime` waits for the code.

Worker-side module: standard library and sibling modules only (see `zygote_main`).
"""

from __future__ import annotations

import os
import resource

from .linux import (
    CLONE_NEWIPC,
    PR_SET_NO_NEW_PRIVS,
    _block_sockets_in_process,
    _install_socket_filter,
    _prctl,
    _unshare,
)
from .runtime import STATUS_FD, Runtime

# Not `typing.TYPE_CHECKING`: the zygote imports nothing it does not need (see zygote_main).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from .zygote import Zygote


class Child:
    def __init__(self, zygote: Zygote, limits: dict, workdir: str, pipes: dict[str, int]):
        self.z = zygote
        self.limits = limits
        self.workdir = workdir
        self.code_r = pipes["code_r"]
        self.out_w = pipes["out_w"]
        self.err_w = pipes["err_w"]
        self.status_w = pipes["status_w"]

    def run(self) -> int:
        """Isolate this process, then wait for the code on stdin and run it."""
        z = self.z
        os.setsid()
        os.dup2(self.code_r, 0)
        os.dup2(self.out_w, 1)
        os.dup2(self.err_w, 2)
        os.dup2(self.status_w, STATUS_FD)
        os.set_inheritable(STATUS_FD, False)
        os.closerange(STATUS_FD + 1, 1 << 20)  # nothing of the zygote's leaks (control socket)
        os.chdir(self.workdir)
        if z.caps["mountns"]:
            # Own System V IPC objects and POSIX message queues, destroyed with this process:
            # nothing a call creates there survives it or reaches another call.
            _unshare(CLONE_NEWIPC)
        self.set_limits(self.limits)
        os.environ.clear()
        os.environ.update({
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "HOME": self.workdir,
            "TMPDIR": self.workdir,
            "LANG": "C.UTF-8",
            "OPENBLAS_NUM_THREADS": "1",
            "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
        })
        if z.uid is not None:
            os.setgroups([])
            os.setgid(z.gid)
            os.setuid(z.uid)
        _prctl(PR_SET_NO_NEW_PRIVS, 1)
        if z.caps["seccomp_net"] and not _install_socket_filter():
            _block_sockets_in_process()
        runtime = Runtime()
        # Ready. The call's code arrives on stdin (EOF = complete); stdin is then /dev/null.
        chunks = []
        while chunk := os.read(0, 1 << 16):
            chunks.append(chunk)
        devnull = os.open("/dev/null", os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        return runtime.run(b"".join(chunks).decode("utf-8", "surrogatepass"))

    def set_limits(self, limits: dict) -> None:
        page = os.sysconf("SC_PAGE_SIZE")
        with open("/proc/self/statm") as f:
            vm_now = int(f.read().split()[0]) * page
        mb = 1 << 20
        cpu = max(1, int(limits.get("cpu_s") or limits["timeout"]) + 1)
        nproc = int(limits["max_processes"])
        if self.z.uid is None and os.geteuid() != 0 and not self.z.caps["userns"]:
            # Without a uid of its own, RLIMIT_NPROC counts every process of the user.
            nproc += _count_user_tasks(os.getuid())
        settings = {
            resource.RLIMIT_CPU: (cpu, cpu + 1),
            resource.RLIMIT_AS: (vm_now + int(limits["memory_mb"]) * mb,) * 2,
            resource.RLIMIT_NPROC: (nproc, nproc),
            resource.RLIMIT_FSIZE: (int(limits["max_file_mb"]) * mb,) * 2,
            resource.RLIMIT_NOFILE: (256, 256),
            resource.RLIMIT_CORE: (0, 0),
        }
        for which, (soft, hard) in settings.items():
            _cur_soft, cur_hard = resource.getrlimit(which)
            if cur_hard != resource.RLIM_INFINITY:  # never try to raise a hard limit
                soft, hard = min(soft, cur_hard), min(hard, cur_hard)
            resource.setrlimit(which, (soft, hard))


def _count_user_tasks(uid: int) -> int:
    count = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}").st_uid == uid:
                    count += len(os.listdir(f"/proc/{entry}/task"))
            except OSError:
                pass
    return count

