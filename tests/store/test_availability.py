"""Which database errors are an outage (503, retry) and which are bugs (500)."""

from __future__ import annotations

import logging
import sqlite3

import adbc_driver_postgresql.dbapi
import psycopg
import pytest
import sqlalchemy as sa

from stepscope.store.availability import OutageLog, is_unavailable
from tests.live_server import free_port


def test_refused_connections_are_an_outage_for_the_writer_and_the_arrow_reader() -> None:
    uri = f"postgresql://postgres@127.0.0.1:{free_port()}/test"
    with pytest.raises(psycopg.OperationalError) as by_psycopg:
        psycopg.connect(uri, connect_timeout=5)
    with pytest.raises(adbc_driver_postgresql.dbapi.OperationalError) as by_adbc:
        adbc_driver_postgresql.dbapi.connect(uri)
    assert is_unavailable(by_psycopg.value)
    assert is_unavailable(by_adbc.value)
    assert is_unavailable(sa.exc.OperationalError("SELECT 1", {}, by_psycopg.value))


def test_sql_errors_and_other_exceptions_are_bugs(empty_db_url: str) -> None:
    engine = sa.create_engine(empty_db_url)
    with pytest.raises(sa.exc.DBAPIError) as bad_sql, engine.connect() as conn:
        conn.exec_driver_sql("SELECT no_such_column FROM no_such_table")
    engine.dispose()
    assert not is_unavailable(bad_sql.value)
    assert not is_unavailable(ValueError("not a database error"))
    assert is_unavailable(sqlite3.OperationalError("database is locked"))
    assert not is_unavailable(sqlite3.OperationalError("no such table: steps"))


def test_a_failure_is_the_outage_line_when_unavailable_else_a_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    outages, logger = OutageLog(), logging.getLogger("stepscope.test")
    with caplog.at_level(logging.WARNING):
        outages.failed(sqlite3.OperationalError("database is locked"), logger, "pass of %s", "a")
        outages.failed(sqlite3.OperationalError("database is locked"), logger, "pass of %s", "b")
        outages.failed(ValueError("a bug"), logger, "pass of %s", "c")
    assert outages.ongoing
    assert caplog.messages == [
        "database unavailable (database is locked): answering 503 and retrying until it is back",
        "pass of c",
    ]
    assert caplog.records[0].exc_info is None
    traceback = caplog.records[1].exc_info
    assert traceback is not None
    assert isinstance(traceback[1], ValueError)
