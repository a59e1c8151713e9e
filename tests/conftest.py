from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.live_server import RunningServer, run_server
from tests.support import fresh_postgres_database


@pytest.fixture
def live_server() -> Iterator[RunningServer]:
    """A running `stepscope serve` on a fresh SQLite database."""
    with run_server() as server:
        yield server


@pytest.fixture(params=["sqlite", "postgresql"])
def empty_db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """An empty database on each engine: a new SQLite file, a new PostgreSQL database."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'stepscope.db'}"
        return
    with fresh_postgres_database() as url:
        yield url


@pytest.fixture
def db_url(empty_db_url: str) -> str:
    """A migrated, empty database on each engine."""
    from stepscope.store.engine import make_engine
    from stepscope.store.migrate import upgrade

    engine = make_engine(empty_db_url)
    upgrade(engine)
    engine.dispose()
    return empty_db_url
