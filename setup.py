"""Packages: stepscope/, plus migrations/ (at the root, for Alembic and the Dockerfile) shipped
in the wheel as stepscope.migrations. Everything else is in pyproject.toml."""

from setuptools import find_packages, setup

setup(
    packages=[
        *find_packages(include=["stepscope", "stepscope.*"]),
        "stepscope.migrations",
        "stepscope.migrations.versions",
    ],
    package_dir={"stepscope.migrations": "migrations"},
)
