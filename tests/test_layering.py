"""DESIGN §1 dependency rules, checked in fresh interpreters."""

from __future__ import annotations

import subprocess
import sys

SERVER_MODULES = (
    "fastapi",
    "sqlalchemy",
    "dash",
    "polars",
    "plotly",
    "uvicorn",
    "alembic",
    "pydantic",
)


def _loaded_after(statement: str, candidates: tuple[str, ...]) -> list[str]:
    code = (
        f"import sys\n{statement}\nprint(' '.join(m for m in {candidates!r} if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return out.stdout.split()


def test_profiler_import_pulls_in_no_server_dependency() -> None:
    assert (
        _loaded_after("import stepscope, stepscope.profiler, stepscope.schema", SERVER_MODULES)
        == []
    )


def test_analysis_imports_no_web_db_or_torch() -> None:
    banned = (
        "fastapi",
        "sqlalchemy",
        "dash",
        "plotly",
        "torch",
        "stepscope.store",
        "stepscope.api",
    )
    assert _loaded_after("import stepscope.analysis", banned) == []
