"""Shared fixtures: the real-data location (the CLI runner is in cli_runner.py), and the
thread budget of a pytest-xdist worker."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"


def pytest_configure(config: pytest.Config) -> None:
    """Under `pytest -n N` each worker gets cores / N threads, so the workers do not
    oversubscribe the machine (OpenMP threads that spin-wait on a busy core can make a run
    several times slower). Set in the environment too, so the subprocesses a test starts
    (the CLI, `accelerate launch`) inherit it; a test that sets its own thread count wins."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not workers:
        return
    threads = str(max(1, (os.cpu_count() or 1) // int(workers)))
    os.environ.setdefault("OMP_NUM_THREADS", threads)
    os.environ.setdefault("MKL_NUM_THREADS", threads)
    os.environ.setdefault("NUMBA_NUM_THREADS", threads)
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture
def shared_data() -> Path:
    """`../shared/data` beside the repo; absent on a user's fresh clone, so skip then."""
    if not (SHARED_DATA / "arpo").is_dir():
        pytest.skip(f"real data not available at {SHARED_DATA}")
    return SHARED_DATA
