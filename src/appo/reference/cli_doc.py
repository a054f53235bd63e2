"""The command-line reference: every `appo` sub-command's `--help`, rendered from the argparse
parser at a fixed width so that the page does not depend on the terminal it was made in.
The parser is passed in (`appo.cli.build_parser()`): library modules never import the
command line. `render_markdown(parser)` is docs/reference/cli.md.
"""

from __future__ import annotations

import argparse

# Columns of the rendered help (argparse would otherwise take the terminal's width).
WIDTH = 100

HEADER = """\
# Command-line reference

Generated from the argparse parser by `appo reference --out docs/reference`
(`appo.reference.cli_doc`); do not edit by hand. `tests/test_reference.py` fails when this
file and the code differ. Every command also prints its own page with `--help`. Config
keys (the `key=value` overrides): [config.md](config.md).
"""


def help_text(parser: argparse.ArgumentParser) -> str:
    """`parser.format_help()` at `WIDTH` columns."""
    parser._get_formatter = lambda: parser.formatter_class(prog=parser.prog, width=WIDTH)
    try:
        return parser.format_help()
    finally:
        del parser._get_formatter


def _children(parser: argparse.ArgumentParser, words: str
              ) -> list[tuple[str, argparse.ArgumentParser]]:
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                key = f"{words} {name}".strip()
                out.append((key, child))
                out.extend(_children(child, key))
    return out


def render_markdown(parser: argparse.ArgumentParser) -> str:
    commands = _children(parser, "")
    index = "\n".join(f"- [`appo {words}`](#appo-{words.replace(' ', '-')})"
                      for words, _ in commands)
    parts = [HEADER, "\n", index, "\n\n## `appo`\n\n```text\n", help_text(parser), "```\n"]
    for words, child in commands:
        parts += [f"\n## `appo {words}`\n\n```text\n", help_text(child), "```\n"]
    return "".join(parts)
