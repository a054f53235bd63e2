"""`run_cli`: the `appo` command line for tests, in this process or in a subprocess.

In-process by default: `appo.cli.main(argv)` runs here, as `python -m appo.cli ARGS` would,
and the result has the subprocess's shape (`.returncode`, `.stdout`, `.stderr`). A
subprocess pays interpreter start-up and the torch / transformers imports (seconds each
time, ~70 call sites); the suite paid that on every call. `subprocess=True` keeps a real
child for the tests whose property is the process boundary (the `entry()` wiring, exit by
signal, a child's environment, kills). `APPO_TEST_CLI_SUBPROCESS=1` runs every call in a
subprocess, the old way: to check that a test's outcome is the same both ways.

What the child would have had and this process might not, re-created around the call:
- output: file descriptors 1 and 2 point at temporary files for the call and `sys.stdout`
  / `sys.stderr` write to them, so output written by C code, by child processes (the
  python sandbox) and by handlers that resolve `sys.stderr` at write time (tqdm, logging's
  last resort, warnings) is all captured, in order;
- warnings: the interpreter's default filters, shown on stderr (pytest records them
  instead) and shown again even when an earlier test already triggered them;
- logging: the root logger without pytest's capturing handlers, so appo's warnings reach
  stderr through logging's last-resort handler as in a fresh process;
- `env` replaces `os.environ` for the call, as it replaces a child's environment, and its
  PYTHONPATH goes first on `sys.path`.
Restored afterwards, so nothing leaks into later tests: the environment, the working
directory, `sys.path`, signal handlers, torch's thread count, default dtype and RNG states, Python's
and numpy's RNG states, the logging levels and handlers, stdin.

A module of its own, not a name in tests/conftest.py: `from conftest import ...` finds
whichever conftest.py pytest imported last under that name, which in a full run is a
subfolder's (tests/with_vllm/conftest.py), not the root one.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import random
import signal
import subprocess as _subprocess
import sys
import tempfile
import warnings
from collections.abc import Iterator

# A fresh interpreter's filters (no -W, no PYTHONWARNINGS), most specific first, as
# `warnings.filters` lists them.
_DEFAULT_FILTERS = [
    ("default", DeprecationWarning, "__main__"),
    ("ignore", DeprecationWarning, None),
    ("ignore", PendingDeprecationWarning, None),
    ("ignore", ImportWarning, None),
    ("ignore", ResourceWarning, None),
]
_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2,
            signal.SIGCHLD, signal.SIGPIPE, signal.SIGALRM)


def run_cli(*args: str, env: dict | None = None, timeout: float = 300,
            subprocess: bool = False) -> _subprocess.CompletedProcess:
    """`appo ARGS`, capturing text output: in this process, or with `subprocess=True` as
    `python -m appo.cli ARGS` in a child (`timeout` applies to the child only)."""
    if subprocess or os.environ.get("APPO_TEST_CLI_SUBPROCESS") == "1":
        return _subprocess.run([sys.executable, "-m", "appo.cli", *args], capture_output=True,
                               text=True, env=env, timeout=timeout)
    from appo.cli import main

    with _isolated(env), _captured() as (out, err):
        try:
            code = main(list(args))
        except SystemExit as e:  # what the interpreter makes of it at a child's exit
            code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
            if not isinstance(e.code, int | None):
                print(e.code, file=sys.stderr)
    return _subprocess.CompletedProcess(["appo", *args], code, out.getvalue(), err.getvalue())


@contextlib.contextmanager
def _captured() -> Iterator[tuple[io.StringIO, io.StringIO]]:
    """fd 1/2 and sys.stdout/stderr into temporary files; their text lands in the two
    StringIO objects when the block ends."""
    texts = io.StringIO(), io.StringIO()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    saved_fds = os.dup(1), os.dup(2)
    saved_streams = sys.stdout, sys.stderr, sys.stdin
    files = tempfile.TemporaryFile(), tempfile.TemporaryFile()
    bound: list[tuple[logging.StreamHandler, object]] = []
    try:
        os.dup2(files[0].fileno(), 1)
        os.dup2(files[1].fileno(), 2)
        # As in a child writing to a pipe: UTF-8, not a terminal, stderr never raises on
        # encoding; write_through keeps Python's and C's writes in order.
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8",
                                      write_through=True)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding="utf-8",
                                      errors="backslashreplace", write_through=True)
        sys.stdin = io.StringIO("")
        bound = _point_stream_handlers(sys.stdout, sys.stderr)
        yield texts
    finally:
        for handler, stream in bound:
            _set_stream(handler, stream)
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        sys.stdout, sys.stderr, sys.stdin = saved_streams
        os.dup2(saved_fds[0], 1)
        os.dup2(saved_fds[1], 2)
        for fd in saved_fds:
            os.close(fd)
        for file, text in zip(files, texts, strict=True):
            file.seek(0)
            text.write(file.read().decode("utf-8", errors="backslashreplace"))
            file.close()


@contextlib.contextmanager
def _isolated(env: dict | None) -> Iterator[None]:
    """The call sees a fresh process's warnings, logging and environment; the process's
    global state is put back afterwards."""
    import numpy as np
    import torch

    from appo import errors

    # appo's warn_once: a fresh process has warned nothing yet (in this one another test may
    # have printed the same warning already, which the call would then not show).
    warned = set(errors._warned)
    errors._warned.clear()
    saved_env, saved_path = dict(os.environ), sys.path[:]
    cwd = os.getcwd()
    handlers = {s: signal.getsignal(s) for s in _SIGNALS}
    threads, dtype = torch.get_num_threads(), torch.get_default_dtype()
    rng = torch.random.get_rng_state(), random.getstate(), np.random.get_state()
    root = logging.getLogger()
    root_state = root.handlers[:], root.level
    levels = {name: lg.level for name, lg in logging.root.manager.loggerDict.items()
              if isinstance(lg, logging.Logger)}
    try:
        if env is not None:
            os.environ.clear()
            os.environ.update(env)
            # A child's PYTHONPATH comes first on its sys.path (a user's tool module).
            extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
            sys.path[:0] = [p for p in extra if p not in sys.path]
        root.handlers = []  # pytest's capture handlers; logging.lastResort writes to stderr
        root.setLevel(logging.WARNING)
        with warnings.catch_warnings():
            warnings.resetwarnings()  # also forgets which warnings were shown already
            for action, category, module in reversed(_DEFAULT_FILTERS):
                warnings.filterwarnings(action, category=category, module=module or "")
            warnings.showwarning = _show_on_stderr
            yield
    finally:
        errors._warned.clear()
        errors._warned.update(warned)
        os.environ.clear()
        os.environ.update(saved_env)
        sys.path[:] = saved_path
        os.chdir(cwd)
        for s, h in handlers.items():
            if h is not None:
                signal.signal(s, h)
        torch.set_num_threads(threads)
        torch.set_default_dtype(dtype)
        torch.random.set_rng_state(rng[0])
        random.setstate(rng[1])
        np.random.set_state(rng[2])
        root.handlers, root.level = root_state
        for name, level in levels.items():
            lg = logging.root.manager.loggerDict.get(name)
            if isinstance(lg, logging.Logger):
                lg.setLevel(level)


def _point_stream_handlers(out, err) -> list[tuple[logging.StreamHandler, object]]:
    """Point the console handlers of every logger (bound to the streams of their creation
    time: transformers' own handler) at `out` / `err`; return what to put back."""
    bound = []
    loggers = [logging.root, *(lg for lg in logging.root.manager.loggerDict.values()
                               if isinstance(lg, logging.Logger))]
    for lg in loggers:
        for h in lg.handlers:
            if type(h) is not logging.StreamHandler:  # a file's handler writes to its file
                continue
            if any(h is seen for seen, _ in bound):  # one handler on several loggers: once,
                continue  # or the second entry would "restore" it to `out`
            try:
                fd = h.stream.fileno()
            except (AttributeError, OSError, ValueError):
                fd = 2  # pytest's capture streams have none; a StreamHandler's default
            if fd in (1, 2):
                bound.append((h, h.stream))
                _set_stream(h, out if fd == 1 else err)
    return bound


def _set_stream(handler: logging.StreamHandler, stream) -> None:
    """`handler.setStream`, which flushes the old stream first: that raises when the old one
    is closed (a capture stream of a test that has ended), which then is only replaced."""
    try:
        handler.setStream(stream)
    except ValueError:
        handler.stream = stream


def _show_on_stderr(message, category, filename, lineno, file=None, line=None) -> None:
    """What `warnings.showwarning` does in a fresh process (pytest records warnings)."""
    sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))
