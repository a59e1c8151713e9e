"""Alembic migrations, installed as the package stepscope.migrations (see setup.py)."""
