"""The shared argparse helpers of every `appo` sub-command: bounded number types, `[--config
FILE] [--plugin MODULE] [key=value ...]`, `--model SPEC`, and the config they give.

Apart from the sub-commands themselves (`appo/commands.py` holds `appo generate`, whose
handler loads models), so that a command module imports these without pulling in another
area's code; only the standard library at import (the config is imported inside
`config_from_args`), which `tests/test_cli_args.py` checks.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable


def _bounded(kind: type, low: float, inclusive: bool, what: str) -> Callable[[str], float]:
    """An argparse `type=` that parses `kind` and refuses values below `low`, so a bad
    number is one line naming the option (`argument --max-new-tokens: must be >= 1, got
    -4`) before any work, not an exception from deep inside the model code."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if value < low or (value == low and not inclusive) or value != value:  # NaN too
            bound = f">= {low:g}" if inclusive else f"> {low:g}"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {text}")
        return value

    parse.__name__ = what  # argparse names the type in some messages
    return parse


positive_int = _bounded(int, 1, True, "an integer")
nonneg_int = _bounded(int, 0, True, "an integer")
positive_float = _bounded(float, 0.0, False, "a number")
nonneg_float = _bounded(float, 0.0, True, "a number")


def probability(text: str) -> float:
    """A nucleus mass for --top-p: in (0, 1]."""
    value = positive_float(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def add_config_args(parser: argparse.ArgumentParser) -> None:
    """`--config FILE`, `--plugin MODULE` plus trailing dotted overrides (`rollout.n=16`)."""
    parser.add_argument("--config", "-c", metavar="FILE", help="YAML config file")
    add_plugin_option(parser)
    parser.add_argument(
        "overrides", nargs="*", metavar="key=value", help="dotted config overrides"
    )


def add_plugin_option(parser: argparse.ArgumentParser) -> None:
    """`--plugin MODULE|FILE.py`, repeatable: user code imported before the config is
    validated (`appo.plugins`), e.g. a module that registers a rollout strategy."""
    parser.add_argument("--plugin", action="append", metavar="MODULE", default=None,
                        help="import a module or .py file first (it may register strategies, "
                             "rewards, advantage estimators or policy losses: "
                             "docs/extending.md); repeatable")


def load_plugin_args(args: argparse.Namespace) -> None:
    """Import the `--plugin`s of `args` (`appo.cli.main` does, before the handler runs, so
    before any config is loaded and validated)."""
    plugins = getattr(args, "plugin", None)
    if plugins:
        from appo.plugins import load_plugins

        load_plugins(plugins)


def add_model_option(parser: argparse.ArgumentParser) -> None:
    """`--model SPEC` on a config-reading command: the same as the override `model.path=SPEC`
    (given after the config file and before the dotted overrides, which still win)."""
    parser.add_argument("--model", "-m", dest="model_path", metavar="SPEC", default=None,
                        help="model spec: an alias (tiny-test, smollm2-135m), a HF directory, "
                             "a .gguf file or a cached hub id (model.path)")


def split_overrides(items: list[str]) -> tuple[list[str], list[str]]:
    """Separate `key=value` overrides from free positional text (e.g. a question)."""
    overrides = [i for i in items if "=" in i and " " not in i.split("=", 1)[0]]
    rest = [i for i in items if i not in overrides]
    return overrides, rest


def config_from_args(args: argparse.Namespace, extra_overrides: list[str] | None = None):
    from appo.config import load_config

    overrides, _ = split_overrides(list(getattr(args, "overrides", []) or []))
    model = getattr(args, "model_path", None)
    first = [f"model.path={model}"] if model else []
    return load_config(getattr(args, "config", None),
                       first + overrides + (extra_overrides or []))
