from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.live_server import RunningServer, run_server
from tests.support import fresh_postgres_database

STARTED_FIRST = (
    "tests/parallel/test_parallelisms.py",
    "tests/profiler/test_hangs_torchrun.py",
    "tests/demo/test_demo.py",
    "tests/cli/test_check.py",
    "tests/parallel/test_pipeline_stages.py",
)
"""The files whose torchrun jobs take longest (1-3 minutes), longest first: `make test` runs
files on two workers (pytest-xdist, `--dist loadfile`), and these started last would finish
alone."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        path = item.nodeid.split("::")[0]
        return STARTED_FIRST.index(path) if path in STARTED_FIRST else len(STARTED_FIRST)

    items.sort(key=rank)  # stable: the files' tests, and the other files, keep their order


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
