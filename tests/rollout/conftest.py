"""Fixtures of the rollout tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def onednn_dropped():
    """No oneDNN packed copy from another test before or after this one (the tests count
    the copies they make)."""
    from appo.rollout.cpu import onednn

    onednn.drop()
    yield
    onednn.drop()
