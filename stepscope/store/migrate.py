"""Schema migrations with Alembic: the package stepscope.migrations (`migrations/` at the
project root, mapped into the package by setup.py, in editable installs and wheels alike)."""

from __future__ import annotations

from importlib.resources import files

import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory

MIGRATIONS_PACKAGE = "stepscope.migrations"


class SchemaOutdatedError(RuntimeError):
    """The database is not at the latest migration."""


def _config() -> Config:
    cfg = Config()
    # Alembic reads a folder: the package's files are plain files in an installed package.
    cfg.set_main_option("script_location", str(files(MIGRATIONS_PACKAGE)))
    cfg.set_main_option("path_separator", "os")
    return cfg


def upgrade(engine: sa.Engine, revision: str = "head") -> None:
    """Apply migrations up to `revision`."""
    cfg = _config()
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, revision)


def downgrade(engine: sa.Engine, revision: str) -> None:
    """Revert migrations down to `revision`."""
    cfg = _config()
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, revision)


def head_revision() -> str | None:
    return ScriptDirectory.from_config(_config()).get_current_head()


def current_revision(engine: sa.Engine) -> str | None:
    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def ensure_current(engine: sa.Engine, *, auto_upgrade: bool) -> None:
    """Upgrade (embedded SQLite) or refuse to start on an outdated schema (PostgreSQL)."""
    if current_revision(engine) == head_revision():
        return
    if auto_upgrade:
        upgrade(engine)
        return
    raise SchemaOutdatedError(
        f"database schema is at {current_revision(engine)!r}, expected {head_revision()!r}: "
        "run `stepscope db upgrade --db URL` first"
    )
