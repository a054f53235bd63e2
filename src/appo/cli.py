"""The `appo` command line: a thin dispatcher; nothing heavy runs at import.

Each area registers its own sub-commands from a light module (`appo.<area>.commands`) that
imports its heavy dependencies only inside the handler, so `appo --help` and
`appo tool python ...` start fast. Handlers raise `AppoError` for user mistakes; it is
printed as one line (`--debug` shows the traceback) with exit status 2.

This is also the one place where the operating system's file errors become messages: an
`OSError` naming a file (permission denied, not a directory, disk full) is printed as one
line naming the file, and a closed stdout (`appo ... | head`) ends the command quietly, as
unix tools do. Bad command-line syntax is one line too (`AppoArgumentParser.error`), and
options may come anywhere among the positional arguments (`appo train k=v --config f k=v`).

`--plugin MODULE` (on every command that reads a config) imports user code before the
handler runs (`appo.plugins`). Every sub-command's `--help` ends with examples (`appo.cli_examples`); `appo --version` prints
the installed package's version.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import os
import sys
import textwrap
import traceback

from appo.cli_examples import epilog
from appo.errors import AppoError

# Modules with a `register(subparsers)` function, and the top-level commands each registers
# (a test checks the names against what `register` adds). Order = order in `appo --help`.
# `appo CMD ...` builds the parser of CMD's module only, so a command imports no other
# area's code: `appo search` stays free of torch, which the rollout package imports.
COMMANDS: dict[str, tuple[str, ...]] = {
    "appo.commands": ("config", "models", "generate"),
    "appo.tools.commands": ("search", "tool"),
    "appo.data.commands": ("data",),
    "appo.rollout.commands": ("rollout",),
    "appo.trainer.commands": ("plan", "export", "sft", "train", "demo"),
    "appo.eval.commands": ("eval", "view"),
    "appo.compare.commands": ("compare",),
    "appo.reference.commands": ("reference",),
}
COMMAND_MODULES = list(COMMANDS)

# Sub-commands that read a config (`add_config_args`) and take `--model SPEC` for
# `model.path`, as `appo generate`, `rollout` and `eval` do. TODO(lead): the owners of
# appo.trainer.commands may call `add_model_option` in its `register` instead of this table.
MODEL_OPTION_COMMANDS = ("train", "sft")


class AppoHelpFormatter(argparse.HelpFormatter):
    """argparse's formatter, except that indented lines of a description or epilog (the
    examples) stay as written instead of being joined into the paragraph."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        out: list[str] = []
        for block in text.split("\n"):
            if block.startswith("  ") or not block.strip():
                out.append(indent + block)
            else:
                out.append(textwrap.fill(" ".join(block.split()), width,
                                         initial_indent=indent, subsequent_indent=indent))
        return "\n".join(out)


class AppoArgumentParser(argparse.ArgumentParser):
    """argparse with options anywhere and one-line errors; sub-commands inherit the class."""

    _intermixing = False

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", AppoHelpFormatter)
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        # argparse fills a `nargs="*"` positional (the overrides) once: overrides on both
        # sides of an option left the second group "unrecognized". Intermixed parsing
        # collects them all; it refuses parsers with sub-commands, which keep the plain rule.
        plain = self._intermixing or any(
            a.nargs in (argparse.PARSER, argparse.REMAINDER)
            for a in self._get_positional_actions())
        if plain:
            return super().parse_known_args(args, namespace)
        self._intermixing = True
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._intermixing = False

    def error(self, message: str):
        print(f"error: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(2)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The `appo` parser; with `command` (a top-level command's name), only the module that
    registers it is imported and registered (`COMMANDS`)."""
    modules = [m for m, names in COMMANDS.items() if command in names] or COMMAND_MODULES
    parser = AppoArgumentParser(
        prog="appo",
        description="Train tool-using reasoning agents with ARPO / AEPO / APPO.",
    )
    parser.add_argument("--debug", action="store_true", help="show full tracebacks on errors")
    parser.add_argument("--version", action="version", version=f"appo {version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in modules:
        importlib.import_module(name).register(sub)
    from appo.cli_args import add_model_option

    for words, command in sub_commands(parser).items():
        if words in MODEL_OPTION_COMMANDS:
            add_model_option(command)
        if command.epilog is None:
            command.epilog = epilog(words)
    return parser


def sub_commands(parser: argparse.ArgumentParser, words: str = ""
                 ) -> dict[str, argparse.ArgumentParser]:
    """Every sub-command's parser under `parser`, by its words (`search cache stats`),
    parents before their children, in `--help` order."""
    out: dict[str, argparse.ArgumentParser] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                key = f"{words} {name}".strip()
                out[key] = child
                out.update(sub_commands(child, key))
    return out


def version() -> str:
    """The installed distribution's version; the package's own where it is not installed
    (a source tree on PYTHONPATH)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("appo")
    except PackageNotFoundError:
        import appo

        return getattr(appo, "__version__", "unknown")


def _command_word(argv: list[str] | None) -> str | None:
    """The top-level command of a command line: its first word that is not an option (the
    options before it, `--debug`, take no value)."""
    words = sys.argv[1:] if argv is None else argv
    return next((w for w in words if not w.startswith("-")), None)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser(_command_word(argv))
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, or a usage error already printed: a status, as below
        return e.code if isinstance(e.code, int) else 2
    if not getattr(args, "handler", None):
        parser.print_help()
        return 0
    try:
        from appo.cli_args import load_plugin_args

        # User code that registers strategies: before the handler loads a config.
        load_plugin_args(args)
        result = args.handler(args)
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit
    except BrokenPipeError:
        return _stdout_closed()
    except AppoError as e:
        # One line even when a message quotes multi-line text (a library's error, a file).
        return _fail(args, "error: " + " ".join(str(e).split("\n")), 2)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except OSError as e:
        if e.filename is None and e.errno != errno.ENOSPC:
            return _unexpected(args, e)
        return _fail(args, f"error: {_os_error_text(e)}", 2)
    except Exception as e:  # noqa: BLE001 - last resort: still one line unless --debug
        return _unexpected(args, e)
    return int(result or 0)


def _fail(args: argparse.Namespace, line: str, status: int) -> int:
    if args.debug:
        traceback.print_exc()
    _end_progress_bars()
    print(line, file=sys.stderr)
    return status


def _end_progress_bars() -> None:
    """Close the progress bars a failed step left open (tqdm), so that the error starts a line
    of its own instead of being appended to the bar's."""
    std = sys.modules.get("tqdm.std")
    for bar in list(getattr(getattr(std, "tqdm", None), "_instances", None) or ()):
        bar.close()


def _unexpected(args: argparse.Namespace, e: BaseException) -> int:
    first = str(e).splitlines()[0] if str(e) else ""
    return _fail(args, f"error: unexpected {type(e).__name__}: {first} "
                       "(run with --debug for the traceback)", 1)


def _os_error_text(e: OSError) -> str:
    """`cannot write runs/x: Permission denied` rather than `[Errno 13] ...`."""
    what = e.strerror or type(e).__name__
    if e.filename is None:
        return what
    where = str(e.filename) + (f" -> {e.filename2}" if e.filename2 else "")
    return f"{where}: {what}"


def _stdout_closed() -> int:
    """The reader of our stdout went away (`appo ... | head`): stop without a message, and
    point stdout at /dev/null so the interpreter's final flush does not complain either."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    return 128 + 13  # what a shell reports for a process ended by SIGPIPE


def entry() -> None:
    """The process entry point (`appo`, `python -m appo.cli`): `main`, then exit.

    Before the interpreter exits: one collection, then `gc.freeze()`. The interpreter's
    finalisation otherwise runs further full collections over the ~400k objects torch and
    transformers leave behind: 0.5 CPU-seconds at the end of `appo config show`, 2.2 at the
    end of a tiny `appo train` (`benchmarks/RESULTS.md`, "CLI exit"). The collection keeps
    what the usual exit does for what is garbage by now (its finalisers run); what differs
    is only that objects still alive and in reference cycles are not finalised at exit (no
    `__del__`), while everything else is freed by reference counting as before. appo's
    outputs do not depend on it: files are closed explicitly, temporary directories and
    process groups are cleaned by `atexit` handlers, which still run. Only here, not in
    `main`: tests call `main` in-process, where freezing would keep the test process's
    cycles for the rest of the session.
    """
    import gc

    code = main()
    gc.collect()
    gc.freeze()
    sys.exit(code)


if __name__ == "__main__":
    entry()
