"""A sandbox worker, forked by the zygote (`spares` up front, more when more calls run at
once): it keeps a fresh, isolated code process waiting, hands the host that process's pipes,
acts on the host's time limit and kill requests, then kills everything the call started and
resets /tmp.

Worker-side module: standard library and sibling modules only (see `zygote_main`).
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import time

from .child import Child
from .linux import (
    CLONE_NEWNS,
    MNT_DETACH,
    MS_BIND,
    MS_NODEV,
    MS_NOEXEC,
    MS_NOSUID,
    MS_REC,
    PR_SET_CHILD_SUBREAPER,
    _check,
    _libc,
    _mount,
    _prctl,
    _unshare,
)

# Not `typing.TYPE_CHECKING`: the zygote imports nothing it does not need (see zygote_main).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from .zygote import Zygote

# Starts the code process's stderr when its set-up failed: the host reports an infra error.
SETUP_FAILED = "appo sandbox setup failed: "


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


class Supervisor:
    """A worker: root in its own namespaces (PID 1 of its PID namespace), it never runs code.
    For each call it prepares a fresh code process (forked from its clean copy of the
    preloaded image, isolated, waiting on stdin), hands the host that process's pipes
    (stdin for the code; stdout, stderr, status to read), acts on the host's word, and
    afterwards kills everything the code started and gives /tmp a fresh tmpfs. So calls
    share nothing, and a call costs one fork, done before it arrives.

    From the host (one message each): b"t" time limit (SIGTERM, so the code can flush;
    SIGKILL 0.2 s later), b"k" kill now, b"d" done (clean up, prepare the next call),
    b"q" or EOF quit. To the host: b"r" + 4 fds (ready), b"X{json}" (the code process
    exited: raw wait status, CPU time), b"E{text}" (set-up failed; the worker exits)."""

    def __init__(self, zygote: Zygote, conn: socket.socket):
        self.z = zygote
        self.conn = conn
        self.limits = zygote.config["limits"]
        self.workdir = ""
        self.pid = 0
        self.pipes: dict[str, int] = {}
        self.tmp_mounted = False
        self.keep_fds: list[tuple[str, str, int]] | None = None

    def run(self) -> int:
        if self.z.caps["pidns"]:
            try:  # a /proc that shows only this worker's processes
                _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
            except OSError:
                pass
        elif self.z.caps["mountns"]:
            try:
                _unshare(CLONE_NEWNS)
            except OSError as e:
                self.send(b"E" + f"sandbox setup failed: {e}".encode())
                return 1
        _prctl(PR_SET_CHILD_SUBREAPER, 1)
        while True:
            try:
                self.prepare()
                handed = [self.pipes.pop(k) for k in ("code_w", "out_r", "err_r", "status_r")]
                socket.send_fds(self.conn, [b"r"], handed)
                for fd in handed:
                    os.close(fd)
            except Exception as e:  # noqa: BLE001 - the host reports it as an infra failure
                self.send(b"E" + f"sandbox setup failed: {type(e).__name__}: {e}".encode())
                self.cleanup()
                return 1
            try:
                more = self.keep_time()
            finally:
                self.cleanup()
            if not more:
                return 0

    def send(self, msg: bytes) -> None:
        try:
            self.conn.send(msg)
        except OSError:
            pass

    def keep_time(self) -> bool:
        """Act on the host's word until the call is done. Returns False to quit.
        The host keeps the clock, so starting a call does not need to wake us; RLIMIT_CPU
        still stops a busy loop if the host itself stalls."""
        conn, pid = self.conn, self.pid
        try:
            pidfd = os.pidfd_open(pid)
        except (AttributeError, OSError):
            pidfd = None
        kill_at = None
        exited = False
        try:
            while True:
                if not exited:
                    waited, status, rusage = os.wait4(pid, os.WNOHANG)
                    if waited == pid:
                        exited = True
                        cpu = rusage.ru_utime + rusage.ru_stime
                        self.send(b"X" + json.dumps({"status": status, "cpu_s": cpu}).encode())
                        # The run is over: whatever it started goes now (it may hold the
                        # output pipes open, or still be forking).
                        self.kill_descendants()
                if kill_at is not None and not exited and time.monotonic() >= kill_at:
                    _kill(pid, signal.SIGKILL)
                    kill_at = None
                watched = [conn] + ([pidfd] if pidfd is not None and not exited else [])
                if exited:
                    wait = None
                elif kill_at is not None:
                    wait = max(0.0, kill_at - time.monotonic())
                else:
                    wait = None if pidfd is not None else 0.01
                ready, _, _ = select.select(watched, [], [], wait)
                if conn not in ready:
                    continue
                try:
                    msg = conn.recv(64)
                except OSError:
                    msg = b""
                if not msg or msg == b"q":
                    return False  # quit (or the host is gone)
                if msg == b"d":
                    return True
                if msg == b"t" and not exited and kill_at is None:
                    _kill(pid, signal.SIGTERM)  # lets the code flush what it printed
                    kill_at = time.monotonic() + 0.2
                if msg == b"k":
                    if exited:
                        self.kill_descendants()
                    else:
                        _kill(pid, signal.SIGKILL)
        finally:
            if pidfd is not None:
                os.close(pidfd)

    def fresh_tmp(self) -> None:
        """A new, empty, size-capped tmpfs on /tmp and /dev/shm for this call (the previous
        call's is detached: its processes are all dead by now)."""
        z = self.z
        size = f"size={int(self.limits['disk_mb'])}m"
        if self.keep_fds is None:
            # A bind source must be a mount of this worker's own mount namespace: fds the
            # zygote opened point into its namespace (EINVAL here), so open them again now,
            # before the first tmpfs hides the entries.
            self.keep_fds = [(d, n, os.open(os.path.join(d, n), os.O_PATH))
                             for d, n, _ in z.tmp_keep]
        for mount_dir in ("/tmp", "/dev/shm"):
            if not os.path.isdir(mount_dir):
                continue
            if self.tmp_mounted:
                _check(_libc.umount2(mount_dir.encode(), MNT_DETACH), f"umount {mount_dir}")
            _mount("tmpfs", mount_dir, "tmpfs", MS_NOSUID | MS_NODEV, f"mode=1777,{size}")
            for kept_dir, name, fd in self.keep_fds:
                if kept_dir == mount_dir:
                    target = os.path.join(mount_dir, name)
                    os.mkdir(target, 0o755)
                    _mount(f"/proc/self/fd/{fd}", target, None, MS_BIND | MS_REC, None)
        self.tmp_mounted = True
        self.workdir = "/tmp/work"
        os.mkdir(self.workdir, 0o700)

    def prepare(self) -> None:
        """Namespaces, working dir, pipes, and the code process waiting for its code."""
        z = self.z
        if z.caps["mountns"]:
            self.fresh_tmp()
        else:
            import tempfile

            self.workdir = tempfile.mkdtemp(prefix="appo-sandbox-")
        if z.uid is not None:
            os.chown(self.workdir, z.uid, z.gid)
        p = self.pipes
        p["out_r"], p["out_w"] = os.pipe()
        p["err_r"], p["err_w"] = os.pipe()
        p["status_r"], p["status_w"] = os.pipe()
        p["code_r"], p["code_w"] = os.pipe()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                self.conn.detach()  # closed below with the other fds; never shut down
                for name in ("out_r", "err_r", "status_r", "code_w"):
                    os.close(p[name])
                code = Child(z, self.limits, self.workdir, p).run()
            except BaseException as e:  # noqa: BLE001 - last resort inside the child
                try:
                    os.write(p["err_w"], f"{SETUP_FAILED}{type(e).__name__}: {e}\n".encode())
                except OSError:
                    pass
            finally:
                os._exit(code)
        self.pid = pid
        for name in ("out_w", "err_w", "status_w", "code_r"):
            os.close(p.pop(name))

    def kill_descendants(self) -> None:
        """Kill and reap everything the code started. As PID 1 of the namespace one
        kill(-1) reaches every process in it at once (a fork bomb cannot outrun it).
        Without a PID namespace we are a child subreaper: kill the whole tree below us,
        round after round, until nothing is left."""
        if self.pid:
            _kill(self.pid, signal.SIGKILL)
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            if self.z.caps["pidns"]:
                _kill(-1, signal.SIGKILL)
            else:
                for pid in _descendants(os.getpid()):
                    _kill(pid, signal.SIGKILL)
            try:
                while os.waitpid(-1, os.WNOHANG)[0] > 0:
                    pass
            except ChildProcessError:
                return
            time.sleep(0.001)

    def cleanup(self) -> None:
        self.kill_descendants()
        self.pid = 0
        for fd in self.pipes.values():
            try:
                os.close(fd)
            except OSError:
                pass
        self.pipes = {}
        if self.workdir and not self.z.caps["mountns"]:
            import shutil

            shutil.rmtree(self.workdir, ignore_errors=True)
        self.workdir = ""


def _descendants(root: int) -> list[int]:
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            parents.setdefault(ppid, []).append(int(entry))
    out, frontier = [], [root]
    while frontier:
        kids = parents.get(frontier.pop(), [])
        out += kids
        frontier += kids
    return out
