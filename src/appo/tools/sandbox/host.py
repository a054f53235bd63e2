"""Host side of the sandbox: `Sandbox` starts the zygote (the `zygote_main.py` script) in a
clean environment, keeps the idle workers it hands over, and runs each call on one of them
(`appo.tools.sandbox.call`). A dead zygote is restarted; a forked host starts its own.
"""

from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections import deque
from dataclasses import asdict
from pathlib import Path

from appo.tools.sandbox.call import RunOutcome, SandboxLimits, _Call

ZYGOTE_MAIN = Path(__file__).with_name("zygote_main.py")

# Preloaded in the zygote (import once, fork many). Missing ones are skipped.
DEFAULT_PRELOAD = (
    "numpy", "numpy.linalg", "numpy.random", "numpy.fft", "sympy",
    "math", "cmath", "fractions", "decimal", "statistics", "random", "itertools",
    "functools", "collections", "heapq", "bisect", "re", "json", "string", "datetime",
    "time", "copy", "operator", "typing", "dataclasses", "textwrap", "ctypes", "subprocess",
    "io", "traceback", "linecache", "faulthandler", "atexit", "numbers", "array", "struct",
    "hashlib", "base64", "csv", "pprint", "enum", "unicodedata", "calendar", "tempfile",
    "shutil", "glob", "pathlib", "contextlib", "inspect", "difflib", "socket", "encodings.idna",
)

# The zygote starts from this environment, not the host's: nothing secret to inherit.
_ZYGOTE_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "OPENBLAS_NUM_THREADS": "1",  # no BLAS thread pool: the zygote must stay single-threaded
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}


class _Zygote:
    """A running zygote and the thread that receives the workers it forks."""

    def __init__(self, proc: subprocess.Popen, control: socket.socket, log, cond):
        self.proc = proc
        self.control = control
        self.log = log  # temporary file holding the zygote's stderr
        self.cond = cond
        self.capabilities: dict | None = None
        self.alive = True
        self.pool: deque[socket.socket] = deque()  # idle workers (the oldest first)
        self.pending = 0  # workers asked for and not yet received
        self.reader = threading.Thread(target=self._receive, daemon=True,
                                       name="appo-sandbox-reader")
        self.reader.start()

    def _receive(self) -> None:
        while True:
            try:
                msg, fds, _, _ = socket.recv_fds(self.control, 1 << 20, 16)
            except OSError:
                msg, fds = b"", []
            with self.cond:
                if not msg and not fds:
                    self.alive = False
                    self.cond.notify_all()
                    return
                if not self.alive:  # shutting down: workers still arriving are dropped
                    for fd in fds:
                        os.close(fd)  # EOF: the worker cleans up and exits
                    continue
                if msg.startswith(b"{"):
                    self.capabilities = json.loads(msg)["capabilities"]
                    self.pending = int(self.capabilities.get("spares", 0))
                else:
                    self.pool.extend(socket.socket(fileno=fd) for fd in fds)
                    self.pending = max(0, self.pending - len(fds) - msg.count(b"f"))
                self.cond.notify_all()

    def request(self, n: int = 1) -> None:
        """Ask for n more workers (caller holds the condition)."""
        try:
            self.control.send(b"n" * n)
            self.pending += n
        except OSError:
            self.alive = False

    def shutdown(self) -> None:
        """Stop: idle workers are told to quit, the zygote exits once every worker has
        cleaned up. Do not hold the condition: the receiver thread needs it."""
        with self.cond:
            self.alive = False
            idle = list(self.pool)
            self.pool.clear()
        for worker in idle:
            _retire(worker)
        try:
            self.control.shutdown(socket.SHUT_RDWR)  # EOF for the zygote and our receiver
        except OSError:
            pass
        self.reader.join(timeout=5)
        self.control.close()
        try:
            self.proc.wait(timeout=12)  # the zygote waits for its sandboxes to clean up
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()

    def error_detail(self) -> str:
        self.log.seek(0)
        lines = self.log.read().decode(errors="replace").strip().splitlines()[-5:]
        return " | ".join(lines) or f"exit status {self.proc.poll()}"


def _retire(worker: socket.socket, timeout: float = 5.0) -> None:
    """Tell a worker to quit and wait until it has cleaned up (its processes gone, its
    working dir removed): its socket reaches EOF when it exits."""
    try:
        worker.send(b"q")
        worker.settimeout(timeout)
        while True:
            msg, fds, _, _ = socket.recv_fds(worker, 4096, 4)
            for fd in fds:
                os.close(fd)
            if not msg:
                break
    except OSError:
        pass
    finally:
        worker.close()


def _forget_after_fork(ref: weakref.ref) -> None:
    sandbox = ref()
    if sandbox is not None:
        sandbox._cond = threading.Condition()
        sandbox._state = {"zygote": None}
        sandbox._waiting = 0
        sandbox._finalizer.detach()
        sandbox._finalizer = weakref.finalize(sandbox, _shutdown, sandbox._state)


def _shutdown(state: dict) -> None:
    z: _Zygote | None = state.get("zygote")
    state["zygote"] = None
    if z is not None:
        z.shutdown()


class Sandbox:
    """Runs Python code in isolated, resource-limited processes, a fresh one per call.

    A zygote forks `spares` workers up front (more when more calls run at once); each worker
    keeps a fresh, isolated code process waiting, and the host writes a call's code straight
    into one. Thread-safe: any number of threads may call `run` at once. A dead zygote is
    restarted; workers it already handed over keep working.
    """

    def __init__(
        self,
        limits: SandboxLimits | None = None,
        preload: tuple[str, ...] | list[str] = DEFAULT_PRELOAD,
        isolation: str = "auto",
        network: bool = False,
        drop_uid: int | str | None = "auto",
        spares: int = 2,
        python: str | None = None,
        start_timeout: float = 120.0,
    ):
        if isolation not in ("auto", "rlimits", "userns"):
            from appo.errors import AppoError

            raise AppoError(f"bad sandbox isolation {isolation!r} (choose auto or rlimits)")
        if not (drop_uid is None or drop_uid == "auto"
                # a YAML `true` is an int to Python (uid 1): refuse it, as any typo
                or (isinstance(drop_uid, int) and not isinstance(drop_uid, bool)
                    and 0 < drop_uid < 2**32 - 1)):
            from appo.errors import AppoError

            raise AppoError(f"bad sandbox_uid {drop_uid!r} (auto, null or a uid > 0)")
        self.limits = limits or SandboxLimits()
        self.spares = max(1, int(spares))
        self.config = {
            "preload": list(preload),
            "isolation": isolation,
            "network": network,
            "drop_uid": drop_uid,
            "spares": self.spares,
            "limits": asdict(self.limits),
        }
        self.python = python or sys.executable
        self.start_timeout = start_timeout
        self._cond = threading.Condition()
        self._state: dict = {"zygote": None}
        self._finalizer = weakref.finalize(self, _shutdown, self._state)
        self._waiting = 0
        self.restarts = -1
        # A forked copy of the host (e.g. a data-loader worker) must not share our idle
        # sandboxes or our receiver thread (which did not survive the fork): it starts its
        # own zygote on first use.
        ref = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: _forget_after_fork(ref))

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> dict:
        """Start the zygote (if needed) and wait until it is ready; return its capabilities."""
        with self._cond:
            return self._ready_zygote().capabilities

    @property
    def capabilities(self) -> dict:
        return self.start()

    def _ready_zygote(self) -> _Zygote:
        """The live zygote, started if needed (caller holds the condition)."""
        z = self._state["zygote"]
        if z is not None and not z.alive:
            # Keep the sandboxes it already handed over: they do not need the zygote.
            pool = list(z.pool)
            z.pool.clear()
            _shutdown(self._state)
            z = None
        else:
            pool = []
        if z is None:
            z = self._spawn()
            z.pool.extend(pool)
            self._state["zygote"] = z
        deadline = time.monotonic() + self.start_timeout
        while z.capabilities is None:
            if not z.alive or time.monotonic() > deadline:
                detail = z.error_detail()
                _shutdown(self._state)
                raise RuntimeError(f"python sandbox failed to start: {detail}")
            self._cond.wait(0.1)
        return z

    def _spawn(self) -> _Zygote:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        log = tempfile.TemporaryFile()
        try:
            proc = subprocess.Popen(
                [self.python, "-I", "-B", str(ZYGOTE_MAIN), str(theirs.fileno()),
                 json.dumps(self.config)],
                pass_fds=[theirs.fileno()],
                env=_ZYGOTE_ENV,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=log,
                start_new_session=True,  # Ctrl-C in the terminal is the host's business
            )
        finally:
            theirs.close()
        self.restarts += 1
        return _Zygote(proc, ours, log, self._cond)

    def close(self) -> None:
        with self._cond:
            z, self._state["zygote"] = self._state["zygote"], None
        if z is not None:
            z.shutdown()

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- running ----------------------------------------------------------------------------

    def _acquire(self) -> socket.socket:
        """An idle worker: one whose next code process is ready if any, else the one idle
        longest; if all are busy, a new one (a few ms)."""
        with self._cond:
            self._waiting += 1
            try:
                deadline = time.monotonic() + self.start_timeout
                while True:
                    z = self._ready_zygote()
                    if z.pool:
                        ready, _, _ = select.select(list(z.pool), [], [], 0)
                        worker = ready[0] if ready else z.pool[0]
                        z.pool.remove(worker)
                        return worker
                    if self._waiting > z.pending:
                        z.request(self._waiting - z.pending)
                    if time.monotonic() > deadline:
                        raise RuntimeError("no sandbox worker became available")
                    self._cond.wait(0.5)
            finally:
                self._waiting -= 1

    def _release(self, worker: socket.socket, healthy: bool) -> None:
        with self._cond:
            z = self._state["zygote"]
            if healthy and z is not None and z.alive:
                z.pool.append(worker)
                self._cond.notify_all()
                return
        if healthy:
            _retire(worker)  # the sandbox is closing
        else:
            worker.close()

    def run(self, code: str) -> RunOutcome:
        """Run `code` under `self.limits`; never raises for anything the code does. Sandbox
        failures (no worker, no answer) come back as `RunOutcome(infra_error=...)`."""
        start = time.monotonic()
        for _attempt in range(3):
            try:
                worker = self._acquire()
            except (OSError, RuntimeError) as e:
                return RunOutcome(infra_error=f"sandbox unavailable: {e}")
            outcome, healthy = _Call(worker, self.limits).run(code)
            self._release(worker, healthy)
            if outcome is not None:
                if outcome.infra_error is not None:
                    outcome.wall_s = time.monotonic() - start
                return outcome
            # None: that idle worker had died before taking the code; take another.
        return RunOutcome(infra_error="no live sandbox worker could take the code")

    @property
    def pid(self) -> int | None:
        z = self._state["zygote"]
        return z.proc.pid if z is not None else None


def describe_capabilities(caps: dict) -> str:
    """One line saying which isolation layers are active."""
    layers = []
    layers.append("network namespace" if caps.get("netns") else
                  ("seccomp socket filter" if caps.get("seccomp_net") else "network allowed"))
    layers.append("read-only fs + tmpfs workdir" if caps.get("readonly_fs") else "temp workdir")
    layers.append("pid namespace" if caps.get("pidns") else "subreaper cleanup")
    layers.append(f"{caps.get('spares', 0)} pre-forked workers")
    if caps.get("uid_per_worker"):
        layers.append("a uid per worker")
    elif caps.get("uid_drop") is not None:
        layers.append(f"uid {caps['uid_drop']}")
    elif caps.get("userns"):
        layers.append("user namespace")
    else:
        layers.append(f"runs as uid {os.geteuid()}")
    return ", ".join(layers)
