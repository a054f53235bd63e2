"""`accelerate launch` of 2 CPU processes for the two-process tests, and `launch_runs`: several
`appo` command lines in one launch.

A free port per launch, not the config's fixed one: other launches (another test run, or
the other pytest-xdist worker) may hold it.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def accelerate_launch(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """`accelerate launch ARGS` on 2 CPU processes (gloo), one thread each."""
    cmd = [str(Path(sys.executable).parent / "accelerate"), "launch", "--config_file",
           str(REPO / "configs" / "accelerate" / "cpu_2proc.yaml"),
           "--main_process_port", str(free_port()), *args]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def launch_runs(runs: list[list[str]], where: Path, timeout: float = 600) -> None:
    """`appo` command lines (argument lists) one after the other in one 2-process launch
    (cli_runs_worker.py): one interpreter start and one set of imports per rank for all of
    them. Fails with the launch's stderr. `where`: a directory for the list of runs."""
    spec = where / f"runs_{len(list(where.glob('runs_*.json')))}.json"
    spec.write_text(json.dumps(runs))
    r = accelerate_launch(str(HERE / "cli_runs_worker.py"), str(spec), timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]
