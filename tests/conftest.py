"""Shared fixtures: the real-data location (the CLI runner is in cli_runner.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"


@pytest.fixture
def shared_data() -> Path:
    """`../shared/data` beside the repo; absent on a user's fresh clone, so skip then."""
    if not (SHARED_DATA / "arpo").is_dir():
        pytest.skip(f"real data not available at {SHARED_DATA}")
    return SHARED_DATA
