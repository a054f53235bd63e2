"""The sandbox zygote: a preloaded interpreter that forks single-use, isolated sandboxes.

Started by `appo.tools.sandbox.host.Sandbox` through the `zygote_main.py` script (`python -I
-B zygote_main.py FD CONFIG`). The worker-side modules (this one, `linux`, `mounts`,
`supervisor`, `child`, `runtime`) import only the standard library and each other, so the
zygote holds nothing but the modules it is told to preload (numpy, sympy, ...).

Process tree::

    zygote [preloaded, single-threaded; forks workers, hands their sockets to the host]
      worker [PID 1 of its own PID + mount namespaces, root; never runs code]
        code process [one per call, forked before the call arrives: setuid, rlimits, empty
                      env, fresh tmpfs working dir; blocks on stdin until the code comes]

A worker hands the host its waiting code process's pipes: the host writes the code into its
stdin and reads its output and exit status directly, so a call costs two wake-ups (host ->
code -> host), no fork and no import. After the call the worker kills everything the code
started, mounts a fresh tmpfs and forks the next code process.

Isolation layers, each used when the kernel allows it (`capabilities` reports which). The
zygote sets up the network and mount namespaces (`mounts`), the worker the PID namespace and
the per-call tmpfs (`supervisor`), the code process the rest (`child`):

- network: the zygote enters a new network namespace (only a downed loopback: nothing, not
  even 127.0.0.1, is reachable). Without it, a seccomp filter in the code process makes `socket()`
  fail for every address family except AF_UNIX, and blocks io_uring; it is kernel-enforced
  and inherited by subprocesses, but local Unix sockets the user can open stay reachable.
- filesystem: the zygote remounts every mount read-only in its own mount namespace; each
  call gets fresh tmpfs mounts on /tmp and /dev/shm (size-capped), so the working dir and
  anything written to /tmp vanish with the call. Directories on the Python path that the
  sandbox uid may not traverse (e.g. a venv under /root) are exposed by a tmpfs over the
  parent holding bind mounts of just those entries. Without a mount namespace: a mkdtemp
  working dir removed afterwards; other writable places (/tmp, /dev/shm) stay writable.
- identity: as root, the code process drops to an unprivileged uid of this zygote's
  own (`sandbox_uid`), no groups, so RLIMIT_NPROC is enforced (root ignores it) and counts
  only this sandbox's processes, other users' files and processes are out of
  reach, and it cannot signal the host. `no_new_privs` stops setuid binaries.
- processes: the code runs as PID 2 of a new PID namespace whose PID 1 is the supervisor;
  every process the code starts, even after setsid(), is killed when the run ends or times
  out. Without it, the supervisor is a child subreaper and kills every orphan it adopts.
- resources: RLIMIT_CPU, RLIMIT_AS (memory on top of the preloaded image), RLIMIT_NPROC,
  RLIMIT_FSIZE, RLIMIT_NOFILE, no core dumps; output read through pipes with a hard cap.
- environment: emptied (a few fixed values: PATH, HOME, LANG, TMPDIR, thread counts).
- IPC: each code process has its own IPC namespace (System V objects, message queues).
"""

from __future__ import annotations

import gc
import json
import os
import signal
import socket
import sys
import time

from .linux import (
    CLONE_NEWNET,
    CLONE_NEWNS,
    CLONE_NEWPID,
    CLONE_NEWUSER,
    MS_PRIVATE,
    MS_REC,
    PR_SET_DUMPABLE,
    _fork_into_namespaces,
    _mount,
    _prctl,
    _unshare,
    _write_file,
)
from .mounts import _expose_untraversable, _remount_all_readonly
from .supervisor import Supervisor

# "auto" uids: above every uid a distribution hands out and below 2**31, plus a live process's
# pid (at most 2**22: the zygote's, then each worker's), so two live sandboxes never share one.
AUTO_UID_BASE = 0x60000000


def sandbox_uid(value: int | str | None) -> int | None:
    """The uid the code runs as (when appo runs as root). "auto": a uid of this zygote's own,
    so RLIMIT_NPROC, a per-uid count, sees only this sandbox's processes; a shared uid such as
    `nobody` lets every other appo run's sandbox processes eat this one's process limit (and
    lets their code signal each other's)."""
    if value == "auto":
        return AUTO_UID_BASE + os.getpid()
    return None if value is None else int(value)


class Zygote:
    def __init__(self, config: dict):
        self.config = config
        self.caps: dict = {"uid": os.geteuid(), "errors": []}
        self.tmp_keep: list[tuple[str, str, int]] = []  # (mount dir, relative entry, fd)
        self.uid: int | None = None
        self.gid: int | None = None

    # -- startup --------------------------------------------------------------------------

    def preload(self) -> None:
        failed = []
        for name in self.config.get("preload", []):
            try:
                __import__(name)
            except Exception as e:  # noqa: BLE001 - a missing optional module is not fatal
                failed.append(f"{name}: {type(e).__name__}: {e}")
        self.caps["preload_failed"] = failed

    def python_paths(self) -> list[str]:
        paths = [p for p in sys.path if p and os.path.isdir(p)]
        paths += [sys.prefix, sys.base_prefix, sys.exec_prefix, os.path.dirname(sys.executable)]
        paths += [os.path.realpath(p) for p in list(paths)]
        paths.append(os.path.dirname(os.path.realpath(sys.executable)))
        return sorted(set(paths))

    def setup_isolation(self) -> None:
        cfg, caps = self.config, self.caps
        isolation = cfg.get("isolation", "auto")
        want_net = not cfg.get("network", False)
        is_root = os.geteuid() == 0
        caps.update(netns=False, mountns=False, pidns=False, userns=False, readonly_fs=False)
        drop_uid = sandbox_uid(cfg.get("drop_uid"))
        if is_root and drop_uid is not None:
            self.uid, self.gid = drop_uid, int(cfg.get("drop_gid", drop_uid))
        if isolation in ("auto", "userns"):
            flags = CLONE_NEWNS | (CLONE_NEWNET if want_net else 0)
            try:
                if is_root and isolation == "auto":
                    _unshare(flags)
                else:
                    # Unprivileged path: a user namespace grants the capabilities to create
                    # the others. (Tested as root by first becoming `nobody` for good.)
                    if is_root:
                        nobody = drop_uid if drop_uid is not None else 65534
                        os.setgroups([])
                        os.setgid(nobody)
                        os.setuid(nobody)
                        _prctl(PR_SET_DUMPABLE, 1)  # else /proc/self/* stays root's
                    uid, gid = os.geteuid(), os.getegid()
                    _unshare(flags | CLONE_NEWUSER)
                    _write_file("/proc/self/setgroups", "deny")
                    _write_file("/proc/self/uid_map", f"0 {uid} 1")
                    _write_file("/proc/self/gid_map", f"0 {gid} 1")
                    caps["userns"] = True
                    self.uid = self.gid = None
                caps["netns"] = want_net
                caps["mountns"] = True
            except OSError as e:
                caps["errors"].append(f"namespaces unavailable: {e}")
        if caps["mountns"]:
            try:
                _mount(None, "/", None, MS_REC | MS_PRIVATE, None)
                if self.uid is not None:
                    caps["masked"] = _expose_untraversable(self.python_paths())
                self.prepare_tmp_keep()
                caps["readonly_failures"] = _remount_all_readonly()
                caps["readonly_fs"] = True
            except OSError as e:
                caps["errors"].append(f"mount setup failed: {e}")
                caps["mountns"] = False
            caps["pidns"] = self.probe_pidns()
        caps["seccomp_net"] = want_net and not caps["netns"]
        caps["uid_drop"] = self.uid
        caps["uid_per_worker"] = self.uid is not None and cfg.get("drop_uid") == "auto"

    def prepare_tmp_keep(self) -> None:
        """Python-path entries under /tmp or /dev/shm (e.g. a CI venv) must survive the
        per-call tmpfs: keep O_PATH fds to re-expose them by bind mounts."""
        for path in self.python_paths():
            for mount_dir in ("/tmp", "/dev/shm"):
                if path.startswith(mount_dir + "/"):
                    top = path[len(mount_dir) + 1 :].split("/")[0]
                    if not any(k[0] == mount_dir and k[1] == top for k in self.tmp_keep):
                        fd = os.open(os.path.join(mount_dir, top), os.O_PATH)
                        self.tmp_keep.append((mount_dir, top, fd))

    def probe_pidns(self) -> bool:
        try:
            pid = _fork_into_namespaces(CLONE_NEWNS | CLONE_NEWPID)
        except OSError as e:
            self.caps["errors"].append(f"pid namespace unavailable: {e}")
            return False
        if pid == 0:
            os._exit(0 if os.getpid() == 1 else 1)
        _, status = os.waitpid(pid, 0)
        return os.waitstatus_to_exitcode(status) == 0

    # -- main loop ------------------------------------------------------------------------

    def serve(self, control: socket.socket) -> None:
        """Fork workers and hand each one's socket to the host: `spares` at once, then one
        more per b"n" the host sends (when all are busy). The host talks to a worker
        directly, so the zygote is not on the path of a call."""
        signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # workers are reaped by the kernel
        self.control = control
        spares = int(self.config.get("spares", 2))
        self.caps["spares"] = spares
        control.send(json.dumps({"ready": True, "capabilities": self.caps}).encode())
        gc.collect()
        gc.freeze()  # keep preloaded objects out of the collector: fewer copy-on-write faults
        for _ in range(spares):
            self.give_worker()
        while True:
            try:
                msg = control.recv(1024)
            except InterruptedError:
                continue
            except OSError:
                return
            if not msg:
                # The host is closing (or gone): workers are told on their own sockets.
                # Exit once every worker has cleaned up, so that the host's close()
                # returns with nothing left behind.
                self.wait_for_children(timeout=10.0)
                return
            for _ in range(msg.count(b"n")):
                self.give_worker()

    def wait_for_children(self, timeout: float) -> None:
        me, deadline = os.getpid(), time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with open(f"/proc/{me}/task/{me}/children") as f:
                    if not f.read().split():
                        return
            except OSError:
                return
            time.sleep(0.01)

    def give_worker(self) -> None:
        sandbox = self.spawn()
        try:
            if sandbox is None:  # fork failed (memory?): the host keeps waiting, then infra
                self.control.send(b"f")
            else:
                socket.send_fds(self.control, [b"s"], [sandbox.fileno()])
        except OSError:
            pass  # the host is gone: the next recv() sees EOF
        finally:
            if sandbox is not None:
                sandbox.close()

    def spawn(self) -> socket.socket | None:
        """Fork one worker; return the socket the host will talk to it on."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            if self.caps["pidns"]:  # the supervisor is PID 1 of its own namespaces
                pid = _fork_into_namespaces(CLONE_NEWNS | CLONE_NEWPID)
            else:
                pid = os.fork()
        except OSError:
            ours.close()
            theirs.close()
            return None
        if pid == 0:
            code = 1
            try:
                self.control.close()
                ours.close()
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                # The worker's pid as the zygote sees it (in its own PID namespace the
                # worker is PID 1): the first message on its socket.
                self.own_uid(int(theirs.recv(32)))
                code = Supervisor(self, theirs).run()
            finally:
                os._exit(code)
        theirs.close()
        ours.send(b"%d" % pid)
        return ours

    def own_uid(self, worker_pid: int) -> None:
        """With `sandbox_uid="auto"` each worker's code runs as a uid of its own (from the
        worker's pid, unique among live processes), so RLIMIT_NPROC, a per-uid count, gives
        every concurrent call of one run its whole `max_processes` (one uid for the run
        let 16 concurrent calls share 64 processes). A fixed `sandbox_uid` stays shared."""
        if self.uid is not None and self.config.get("drop_uid") == "auto":
            self.uid = self.gid = AUTO_UID_BASE + worker_pid


def main() -> None:
    fd = int(sys.argv[1])
    config = json.loads(sys.argv[2])
    control = socket.socket(fileno=fd)
    zygote = Zygote(config)
    zygote.preload()
    zygote.setup_isolation()
    zygote.serve(control)
