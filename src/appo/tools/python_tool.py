"""The `python` tool: run model-written code in the sandbox, return what it printed.

As in the original (ARPO's PythonTool): a trailing bare expression is printed, stdout is the
result on success, and a failing program shows the model its error. Deviations: on a
non-zero exit the result is what the program printed plus the last `error_lines` lines of
the traceback (the original returned the whole stderr and dropped stdout); a program that
prints nothing returns `empty_output_text` once (the original's empty string made its rollout
re-run the code, `retry_count` runs in all, then say "Tool(python) returned empty output.");
code runs sandboxed in a pre-forked worker (`appo.tools.sandbox`) instead of a fresh
`python -c`; output is truncated to `max_output_chars` with a visible marker; a Markdown code
fence around the code is removed.
"""

from __future__ import annotations

import re
import signal as _signal
import time

from appo.config_ranges import COUNT, above, at_least, check_value
from appo.tools.base import ToolResult
from appo.tools.sandbox import DEFAULT_PRELOAD, RunOutcome, Sandbox, SandboxLimits

_FENCE = re.compile(r"^\s*```[\w+-]*[ \t]*\n(.*?)\n?```\s*$", re.DOTALL)

_SIGNAL_TEXT = {
    _signal.SIGSEGV: "Segmentation fault",
    _signal.SIGBUS: "Bus error",
    _signal.SIGABRT: "Aborted",
    _signal.SIGFPE: "Floating point exception",
    _signal.SIGILL: "Illegal instruction",
    _signal.SIGKILL: "Killed",
}


def strip_code_fence(code: str) -> str:
    match = _FENCE.match(code)
    return match.group(1) if match else code


def truncate_middle(text: str, limit: int) -> str:
    """Keep the head and the tail of `text` (the end often holds the answer or the error)."""
    if limit <= 0 or len(text) <= limit:
        return text
    head = limit * 2 // 3
    tail = limit - head
    cut = len(text) - head - tail
    return f"{text[:head]}\n... [{cut} characters truncated] ...\n{text[len(text) - tail:]}"


def tail_lines(text: str, n: int) -> str:
    lines = text.rstrip("\n").splitlines()
    return "\n".join(lines[-n:]) if n > 0 else ""


class PythonTool:
    """`<python>code</python>` -> stdout (or the error). See the module docstring.

    Params (`tools.tool_instances.python.params`): `timeout` wall seconds (default: the
    `tools.timeout` config key), `cpu_time` (default: timeout), `memory_mb` (on top of the
    preloaded interpreter), `max_processes`, `max_file_mb`, `disk_mb` (tmpfs working dir),
    `max_output_chars` (what the model sees; middle cut with a marker), `max_output_bytes`
    (more stops the program), `error_lines` (traceback lines kept), `empty_output_text`,
    `preload` / `extra_preload` (modules imported once in the zygote), `isolation`
    (auto | rlimits), `network` (false), `sandbox_uid` (uid the code runs as when appo runs
    as root; "auto": one of its own per sandbox worker, so neither the run's other concurrent
    calls nor other sandboxes' processes count against `max_processes`), `spares` (workers kept ready), `strip_fences`, `eager_start`.
    """

    enforces_timeout = True  # the sandbox bounds every run; no executor watchdog needed
    # The function schema of native call formats (appo.tools.formats.function_schema).
    description = ("Run Python code in a sandbox and return what it prints (the value of a "
                   "final bare expression is printed too).")
    argument = "code"
    argument_description = "The Python code to run."

    def __init__(
        self,
        name: str = "python",
        tag: str | None = None,
        timeout: float = 10.0,
        cpu_time: float | None = None,
        memory_mb: int = 1024,
        max_processes: int = 64,
        max_file_mb: int = 16,
        disk_mb: int = 64,
        max_output_chars: int = 4000,
        max_output_bytes: int = 1 << 20,
        error_lines: int = 8,
        empty_output_text: str = "",
        preload: list[str] | None = None,
        extra_preload: list[str] | None = None,
        isolation: str = "auto",
        network: bool = False,
        sandbox_uid: int | str | None = "auto",
        spares: int = 2,
        strip_fences: bool = True,
        eager_start: bool = True,
    ):
        seconds = above(0.0, "seconds")
        for key, value, rng in [("timeout", timeout, seconds), ("cpu_time", cpu_time, seconds),
                                ("memory_mb", memory_mb, COUNT),
                                ("max_processes", max_processes, COUNT),
                                ("max_file_mb", max_file_mb, COUNT), ("disk_mb", disk_mb, COUNT),
                                ("max_output_chars", max_output_chars, COUNT),
                                ("max_output_bytes", max_output_bytes, COUNT),
                                ("error_lines", error_lines, at_least(0)),
                                ("spares", spares, at_least(0))]:
            check_value(f"tools.tool_instances.{name}.params.{key}", value, rng)
        self.name = name
        self.tag = tag or name
        self.limits = SandboxLimits(
            timeout=float(timeout), cpu_s=cpu_time, memory_mb=int(memory_mb),
            max_processes=int(max_processes), max_file_mb=int(max_file_mb),
            disk_mb=int(disk_mb), max_output_bytes=int(max_output_bytes),
        )
        self.max_output_chars = int(max_output_chars)
        self.error_lines = int(error_lines)
        self.empty_output_text = empty_output_text
        self.strip_fences = strip_fences
        modules = list(DEFAULT_PRELOAD if preload is None else preload) + list(extra_preload or [])
        self.sandbox = Sandbox(self.limits, preload=modules, isolation=isolation,
                               network=network, drop_uid=sandbox_uid, spares=spares)
        if eager_start:  # surface a sandbox that cannot start now, not at the first call
            self.sandbox.start()

    @property
    def capabilities(self) -> dict:
        return self.sandbox.capabilities

    def run(self, code: str) -> RunOutcome:
        """Run code as is (no fence stripping), returning the raw outcome."""
        return self.sandbox.run(code)

    def execute(self, content: str) -> ToolResult:
        start = time.monotonic()
        code = strip_code_fence(content) if self.strip_fences else content
        if not code.strip():
            return ToolResult("Error: no code to run.", ok=False, error_kind="error",
                              latency_s=time.monotonic() - start)
        outcome = self.run(code)
        result = self.format(outcome)
        result.latency_s = time.monotonic() - start
        return result

    def format(self, o: RunOutcome) -> ToolResult:
        """What the model sees inside <result>."""
        if o.infra_error is not None:
            return ToolResult(f"Error: python sandbox failure ({o.infra_error})", ok=False,
                              error_kind="infra")
        limit = self.max_output_chars
        stdout = o.stdout
        if o.output_overflow:
            note = (f"Error: output exceeded {self.limits.max_output_bytes} bytes; "
                    "the program was stopped.")
            return self._error(stdout, note, "error", limit)
        if o.timed_out:
            note = f"TimeoutError: execution exceeded the {self.limits.timeout:g} s time limit."
            return self._error(stdout, note, "timeout", limit)
        if o.signal is not None:
            if o.signal == _signal.SIGXCPU:
                return self._error(stdout, "TimeoutError: CPU time limit exceeded.", "timeout",
                                   limit)
            what = _SIGNAL_TEXT.get(o.signal, "Terminated")
            try:
                name = _signal.Signals(o.signal).name
            except ValueError:
                name = f"signal {o.signal}"
            note = f"{what} (the process was killed by {name})."
            trace = tail_lines(o.stderr, self.error_lines)
            return self._error(stdout, f"{trace}\n{note}" if trace else note, "error", limit)
        if o.exit_code != 0:
            trace = tail_lines(o.stderr, self.error_lines)
            note = trace or f"Error: the program exited with status {o.exit_code}."
            if trace and "Traceback" not in o.stderr and "Error" not in trace:
                note = f"{trace}\nError: the program exited with status {o.exit_code}."
            return self._error(stdout, note, "error", limit)
        text = stdout if stdout.strip() else self.empty_output_text
        return ToolResult(truncate_middle(text.rstrip("\n"), limit), ok=True)

    def _error(self, stdout: str, note: str, kind: str, limit: int) -> ToolResult:
        note = truncate_middle(note, max(limit // 2, 200))
        room = max(limit - len(note) - 1, 0)
        shown = truncate_middle(stdout.rstrip("\n"), room) if room else ""
        text = f"{shown}\n{note}" if shown else note
        return ToolResult(text, ok=False, error_kind=kind)

    def close(self) -> None:
        self.sandbox.close()
