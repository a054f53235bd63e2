"""One sandbox call, host side: write the code into a worker's waiting code process, read
its output (capped) and exit status, and tell the worker about the time limit, kills and the
end of the call. Also the call's limits and result types.
"""

from __future__ import annotations

import json
import os
import select
import socket
import time
from dataclasses import dataclass

from appo.tools.sandbox.supervisor import SETUP_FAILED


@dataclass
class SandboxLimits:
    timeout: float = 10.0  # wall seconds
    cpu_s: float | None = None  # CPU seconds (default: the wall timeout)
    memory_mb: int = 1024  # address space on top of the preloaded interpreter
    max_processes: int = 64
    max_file_mb: int = 16  # largest file the code may write
    disk_mb: int = 64  # size of the per-call tmpfs (working dir)
    max_output_bytes: int = 1 << 20  # stdout+stderr; more stops the run


@dataclass
class RunOutcome:
    stdout: str = ""
    stderr: str = ""
    exit_code: int | None = None
    signal: int | None = None
    timed_out: bool = False
    output_overflow: bool = False
    output_bytes: int = 0
    wall_s: float = 0.0
    cpu_s: float | None = None
    infra_error: str | None = None



def _exit_fields(code: int) -> dict:
    return {"exit_code": code if code >= 0 else None, "signal": -code if code < 0 else None}


class _Call:
    """One call on one worker: write the code into its code process's stdin, read that
    process's stdout/stderr (capped) and exit status; tell the worker about the time
    limit, kills, and the end of the call."""

    def __init__(self, conn: socket.socket, limits: SandboxLimits):
        self.conn = conn
        self.limits = limits

    def run(self, code: str) -> tuple[RunOutcome | None, bool]:
        """(outcome, worker still usable). Outcome None: the worker was dead before it got
        the code (the code did not run; try another)."""
        conn, limits = self.conn, self.limits
        conn.settimeout(limits.timeout + 30.0)  # only if the worker itself hangs
        try:
            while True:  # skip what is left of the previous call (its exit report)
                msg, fds, _, _ = socket.recv_fds(conn, 4096, 4)
                if not msg.startswith(b"X"):
                    break
        except OSError:
            return None, False
        if msg != b"r" or len(fds) != 4:
            for fd in fds:
                os.close(fd)
            if msg.startswith(b"E"):
                return RunOutcome(infra_error=msg[1:].decode(errors="replace")), False
            return None, False  # died while idle
        code_w, out_r, err_r, status_r = fds
        healthy = True
        try:
            data = code.encode("utf-8", "surrogatepass")
            try:
                with os.fdopen(code_w, "wb") as f:  # EOF tells the code process to start
                    code_w = -1
                    f.write(data)
            except BrokenPipeError:
                pass  # it died during set-up; its stderr says why
            outcome = self.collect(out_r, err_r, status_r, time.monotonic())
            healthy = outcome.infra_error is None
            return outcome, healthy
        finally:
            for fd in (code_w, out_r, err_r, status_r):
                if fd >= 0:
                    os.close(fd)
            try:
                conn.send(b"d")  # done: the worker kills what is left, prepares the next
            except OSError:
                healthy = False

    def collect(self, out_r: int, err_r: int, status_r: int, start: float) -> RunOutcome:
        """Read until the code is done. "Done" is the code process's own status line (it
        has flushed and closed its output: the fast path), or the worker's report that the
        code process exited (killed, crashed: its raw wait status)."""
        conn, cap = self.conn, self.limits.max_output_bytes
        buffers = {out_r: bytearray(), err_r: bytearray()}
        open_fds = [out_r, err_r]
        status_buf = bytearray()
        status_open = conn_open = True
        total = 0
        timed_out = overflow = killed = False
        final = None
        child_exit = None  # the worker's view: the code process's wait status
        child_exit_at = done_at = None
        deadline = start + self.limits.timeout
        guard = deadline + 30.0
        while True:
            now = time.monotonic()
            if final is None and not timed_out and now >= deadline:
                timed_out = True
                conn_send(conn, b"t")  # SIGTERM (the code flushes), SIGKILL 0.2 s later
            if final is None and child_exit is not None and (
                    not status_open or now - child_exit_at > 0.1):
                final = child_exit  # no status line came: use the wait status
            if final is not None:
                done_at = done_at or now
                if not open_fds:
                    break
                if now - done_at > 0.05 and not killed:
                    conn_send(conn, b"k")  # leftovers hold the output open: kill them
                    killed = True
                if now - done_at > 1.0:
                    break
            if now > guard or (not conn_open and final is None and not status_open):
                return RunOutcome(infra_error="sandbox stopped answering",
                                  stdout=buffers[out_r].decode("utf-8", "replace"))
            watched = list(open_fds)
            if status_open:
                watched.append(status_r)
            if conn_open:
                watched.append(conn)
            if final is not None or child_exit:
                wait = 0.01
            else:
                wait = max(0.0, (guard if timed_out else deadline) - now)
            ready, _, _ = select.select(watched, [], [], wait)
            for r in ready:
                if r is conn:
                    try:
                        msg = conn.recv(4096)
                    except OSError:
                        msg = b""
                    if not msg:
                        conn_open = False
                    elif msg.startswith(b"X"):
                        info = json.loads(msg[1:])
                        child_exit = _exit_fields(os.waitstatus_to_exitcode(info["status"]))
                        child_exit["cpu_s"] = info["cpu_s"]
                        child_exit_at = time.monotonic()
                    continue
                chunk = os.read(r, 1 << 16)
                if r == status_r:
                    if not chunk:
                        status_open = False
                    status_buf += chunk
                    final = final or _parse_status(status_buf)
                    continue
                if not chunk:
                    open_fds.remove(r)
                    continue
                total += len(chunk)
                room = cap - len(buffers[r])
                if room > 0:
                    buffers[r] += chunk[:room]
                if total > cap and not overflow:
                    overflow = True
                    conn_send(conn, b"k")
        final = final or {"exit_code": None, "signal": None, "cpu_s": None}
        stderr = buffers[err_r].decode("utf-8", "replace")
        if stderr.startswith(SETUP_FAILED):
            return RunOutcome(infra_error=stderr.strip())
        return RunOutcome(
            stdout=buffers[out_r].decode("utf-8", "replace"), stderr=stderr,
            timed_out=timed_out, output_overflow=overflow, output_bytes=total,
            wall_s=time.monotonic() - start, **final)


def conn_send(conn: socket.socket, data: bytes) -> None:
    try:
        conn.send(data)
    except OSError:
        pass


def _parse_status(buf: bytearray) -> dict | None:
    """First complete status line: the code's own report {"exit", "cpu_s"} or the init's
    relay {"status", "cpu_s"} (a raw wait status: the code may have died by a signal)."""
    line, sep, _ = bytes(buf).partition(b"\n")
    if not sep:
        return None
    info = json.loads(line)
    if "exit" in info:
        fields = _exit_fields(int(info["exit"]))
    else:
        fields = _exit_fields(os.waitstatus_to_exitcode(info["status"]))
    fields["cpu_s"] = info.get("cpu_s")
    return fields
