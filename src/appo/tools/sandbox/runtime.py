"""Inside the code process: the Python-level set-up done before the code arrives (output
streams, flush on SIGTERM, faulthandler), then the run itself: parse the code (`prepare_code`
shows a bare last expression, like a REPL), execute it, report the exit status on `STATUS_FD`.

Worker-side module: standard library only (see `zygote_main`). The host imports it for
`prepare_code` in tests.
"""

from __future__ import annotations

import ast
import json
import os
import signal
import sys
import time

CODE_FILENAME = "<python>"
SHOW_NAME = "__appo_show__"
STATUS_FD = 3  # the code process reports its exit status here (fast completion path)


def prepare_code(code: str) -> ast.Module:
    """Parse `code`; if its last statement is a bare expression that is not a `print(...)`
    call, show its value (like a REPL: `None` is not shown). Raises SyntaxError."""
    tree = ast.parse(code, filename=CODE_FILENAME)
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = tree.body[-1]
        value = last.value
        is_print = (
            isinstance(value, ast.Call)
            and isinstance(value.func, ast.Name)
            and value.func.id == "print"
        )
        if not is_print:
            call = ast.Call(func=ast.Name(id=SHOW_NAME, ctx=ast.Load()), args=[value], keywords=[])
            tree.body[-1] = ast.copy_location(ast.Expr(value=call), last)
            ast.fix_missing_locations(tree)
    return tree


def _show(value: object) -> None:
    if value is not None:
        print(value)


class Runtime:
    """The code process's Python-level set-up, done before the code arrives."""

    def __init__(self) -> None:
        import atexit
        import builtins
        import faulthandler
        import io
        import linecache
        import traceback

        self.atexit, self.builtins, self.linecache, self.traceback = (
            atexit, builtins, linecache, traceback)
        self.out = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8",
                                    errors="backslashreplace")
        self.err = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding="utf-8",
                                    errors="backslashreplace", line_buffering=True)
        sys.stdout, sys.stderr = self.out, self.err
        sys.__stdout__, sys.__stderr__ = self.out, self.err  # type: ignore[misc]
        signal.signal(signal.SIGTERM, self.flush_and_exit)  # sent at the time limit
        # RLIMIT_CPU's soft limit: flush what was printed, then die of SIGXCPU as before (the
        # host reports it as the CPU time limit; the hard limit a second later is SIGKILL).
        signal.signal(signal.SIGXCPU, self.flush_and_resignal)
        faulthandler.enable(file=self.err)
        sys.argv = [CODE_FILENAME]
        sys.path.insert(0, os.getcwd())

    def flush(self) -> None:
        for stream in (self.out, self.err):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - e.g. the output pipe was closed on overflow
                pass

    def flush_and_exit(self, signum, _frame) -> None:
        self.flush()
        os._exit(128 + signum)

    def flush_and_resignal(self, signum, _frame) -> None:
        self.flush()
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    def run(self, code: str) -> int:
        import io

        sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
        tb_mod, err = self.traceback, self.err
        self.linecache.cache[CODE_FILENAME] = (len(code), None, code.splitlines(True),
                                               CODE_FILENAME)
        start_cpu = time.process_time()
        status = 0
        try:
            tree = prepare_code(code)
            compiled = compile(tree, CODE_FILENAME, "exec")
            namespace = {"__name__": "__main__", "__builtins__": self.builtins,
                         SHOW_NAME: _show}
            exec(compiled, namespace)
        except SystemExit as e:
            status = _exit_status(e.code, err)
        except SyntaxError as e:
            err.write("".join(tb_mod.format_exception_only(type(e), e)))
            status = 1
        except BaseException as e:  # noqa: BLE001 - the model sees its exception
            tb = e.__traceback__.tb_next if e.__traceback__ is not None else None  # hide exec
            tb_mod.print_exception(type(e), e, tb, file=err)
            status = 1
        try:
            self.atexit._run_exitfuncs()
        except SystemExit as e:
            status = _exit_status(e.code, err)
        except BaseException:  # noqa: BLE001
            pass
        self.flush()
        # Done: close the output and say so, so the host has its answer without waiting for
        # this (large, copy-on-write) process to be torn down.
        for fd in (1, 2):
            try:
                os.close(fd)
            except OSError:
                pass
        report = {"exit": status, "cpu_s": time.process_time() - start_cpu}
        try:
            os.write(STATUS_FD, json.dumps(report).encode() + b"\n")
        except OSError:
            pass
        return status


def _exit_status(code: object, err) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    err.write(f"{code}\n")
    return 1
