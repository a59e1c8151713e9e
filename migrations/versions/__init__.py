"""The migration scripts (Alembic skips this file)."""
