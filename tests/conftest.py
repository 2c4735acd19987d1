from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from harness import WorkerPool  # noqa: E402


@pytest.fixture(scope="session")
def pool():
    """Persistent spawned workers shared by the whole session (start-up is paid once)."""
    p = WorkerPool(max_workers=8)
    yield p
    p.close()
