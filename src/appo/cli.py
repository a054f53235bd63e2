"""The `appo` command line: a thin dispatcher; nothing heavy runs at import.

Each area registers its own sub-commands from a light module (`appo.<area>.commands`) that
imports its heavy dependencies only inside the handler, so `appo --help` and
`appo tool python ...` start fast. Handlers raise `AppoError` for user mistakes; it is
printed as one line (`--debug` shows the traceback) with exit status 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import traceback

from appo.errors import AppoError

# Modules with a `register(subparsers)` function. Order = order in `appo --help`.
COMMAND_MODULES = [
    "appo.commands",
    "appo.tools.commands",
    "appo.data.commands",
    "appo.rollout.commands",
    "appo.trainer.commands",
    "appo.eval.commands",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="appo",
        description="Train tool-using reasoning agents with ARPO / AEPO / APPO.",
    )
    parser.add_argument("--debug", action="store_true", help="show full tracebacks on errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "handler", None):
        parser.print_help()
        return 0
    try:
        result = args.handler(args)
    except AppoError as e:
        if args.debug:
            traceback.print_exc()
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - last resort: still one line unless --debug
        if args.debug:
            traceback.print_exc()
        else:
            print(
                f"error: unexpected {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                " (run with --debug for the traceback)",
                file=sys.stderr,
            )
        return 1
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
