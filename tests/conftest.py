from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.server import RunningServer, run_server


@pytest.fixture
def live_server() -> Iterator[RunningServer]:
    """A running `stepscope serve` on a fresh SQLite database."""
    with run_server() as server:
        yield server
