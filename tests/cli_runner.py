"""`run_cli`: the `appo` command line in a subprocess, for tests.

A module of its own, not a name in tests/conftest.py: `from conftest import ...` finds
whichever conftest.py pytest imported last under that name, which in a full run is a
subfolder's (tests/with_vllm/conftest.py), not the root one.
"""

from __future__ import annotations

import subprocess
import sys


def run_cli(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run `python -m appo.cli ARGS` in a subprocess, capturing text output."""
    return subprocess.run(
        [sys.executable, "-m", "appo.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )
