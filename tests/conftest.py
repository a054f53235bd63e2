"""Shared fixtures: the real-data location (the CLI runner is in cli_runner.py), the
thread budget of a pytest-xdist worker, and the order the files reach the workers."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"
# Seconds per test file, from a full run (benchmarks/suite_durations.py writes it).
DURATIONS = Path(__file__).resolve().parent / "durations.json"


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


def file_costs() -> dict[str, float]:
    """`tests/durations.json`: {repo-relative test file: seconds}; empty if unreadable (the
    order then stays pytest's: a missing table costs balance, never a test)."""
    try:
        return {str(k): float(v) for k, v in json.loads(DURATIONS.read_text()).items()}
    except (OSError, ValueError, AttributeError):
        return {}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Longest files first (tests/durations.json), each file's tests in their own order.

    `--dist loadfile` hands whole files to the workers in collection order (with
    `--no-loadscope-reorder`, which the Makefile passes; xdist's default reorder is by number
    of tests, not by time): a long file left for last would run alone while the other
    worker idles. A file not in the table (a new one) goes first: its cost is unknown."""
    costs = file_costs()
    if not costs:
        return
    unknown = max(costs.values()) + 1.0

    def cost(item: pytest.Item) -> float:
        try:
            rel = Path(item.path).resolve().relative_to(REPO).as_posix()
        except ValueError:
            return 0.0
        return costs.get(rel, unknown)

    items.sort(key=lambda item: -cost(item))  # stable: a file's tests keep their order
