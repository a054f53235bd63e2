"""The shared argparse helpers live apart from the sub-commands (`appo.cli_args`, issue 42),
and `appo CMD` builds only CMD's module's parser, so a torch-free command (`appo search`)
does not import torch, while every command's parser is the one the full `appo` parser has.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from appo.cli import COMMANDS, AppoArgumentParser, build_parser, sub_commands

REPO = Path(__file__).resolve().parents[1]


def fresh_python(code: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={"PYTHONPATH": str(REPO / "src")}, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.split()


def test_appo_search_help_imports_no_torch():
    code = ("import sys\nfrom appo.cli import main\n"
            "try:\n    main(['search', '--help'])\nexcept SystemExit:\n    pass\n"
            "print('torch' in sys.modules, 'appo.commands' in sys.modules, "
            "'appo.rollout' in sys.modules)")
    assert fresh_python(code)[-3:] == ["False", "False", "False"]


def test_the_helpers_import_only_the_standard_library():
    code = ("import sys; before = set(sys.modules); import appo.cli_args; "
            "new = set(sys.modules) - before; "
            "print(','.join(sorted(m for m in new if m.startswith('appo') or m.split('.')[0] "
            "in ('torch', 'omegaconf', 'transformers', 'yaml'))))")
    assert fresh_python(code) == ["appo,appo.cli_args"]


@pytest.mark.parametrize("module", list(COMMANDS))
def test_the_command_table_is_what_each_module_registers(module):
    parser = AppoArgumentParser(prog="appo")
    sub = parser.add_subparsers(dest="command")
    importlib.import_module(module).register(sub)
    assert tuple(sub.choices) == COMMANDS[module]


def test_a_command_alone_parses_as_in_the_full_parser():
    full = sub_commands(build_parser())
    names = [name for names in COMMANDS.values() for name in names]
    assert [w for w in full if " " not in w] == names
    for name in names:
        module = next(names for names in COMMANDS.values() if name in names)
        alone = sub_commands(build_parser(name))
        assert set(alone) == {w for w in full if w.split()[0] in module}
        for words, parser in alone.items():
            assert parser.format_help() == full[words].format_help(), words
    # An unknown word gets the full parser, whose error lists every command.
    assert set(sub_commands(build_parser("nonsense"))) == set(full)
