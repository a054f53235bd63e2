"""`appo.cli.entry`, the process entry point: `main`'s status becomes the exit status, and
the objects alive at exit are frozen (`gc.freeze`) after one last collection, which spares
the interpreter's finalisation its full collections (benchmarks/cli_exit.py)."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys

import pytest

PROBE = """
import atexit, gc, sys
from appo import cli

class Cycle:
    def __init__(self):
        self.me = self

    def __del__(self):
        print("garbage finalised", flush=True)

def fake_main():
    Cycle()  # garbage by the time main returns: the last collection still finalises it
    return 3

cli.main = fake_main
atexit.register(lambda: print("frozen at exit:", gc.get_freeze_count() > 0, flush=True))
cli.entry()
"""


def test_entry_exits_with_mains_status_after_collecting_and_freezing():
    r = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 3, r.stderr
    assert r.stdout.splitlines() == ["garbage finalised", "frozen at exit: True"]


def test_the_appo_script_runs_entry():
    script = importlib.metadata.entry_points(group="console_scripts", name="appo")
    if not script:
        pytest.skip("appo's console script is not installed in this environment")
    assert [e.value for e in script] == ["appo.cli:entry"]
