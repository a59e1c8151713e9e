"""DESIGN §1 rules that import-linter's contracts (pyproject.toml, `make lint`) cannot check.

The contracts check which package imports which; these check what `import stepscope` loads
at run time and where SQL is written.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import stepscope

PACKAGE = Path(stepscope.__file__).parent
SQL = re.compile(
    r"\bSELECT\b.+\bFROM\b|\bINSERT\s+INTO\b|\bDELETE\s+FROM\b|\bUPDATE\s+\S+\s+SET\b", re.I
)
SA_ALLOWED = {"Engine", "Connection", "exc", "make_url"}
"""What a module outside store/ may use of SQLAlchemy: what it passes on, what it catches."""

SERVER_MODULES = (
    "fastapi",
    "sqlalchemy",
    "dash",
    "polars",
    "plotly",
    "uvicorn",
    "alembic",
    "pydantic",
    "prometheus_client",
    "opentelemetry",
    "google",
)
"""Server packages, and the OpenTelemetry SDK that only the optional OTLP export loads."""


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


def test_profiler_works_with_server_packages_uninstalled() -> None:
    """`pip install stepscope` has none of the server extras: the profiler must not need them."""
    blocked = (*SERVER_MODULES, "torch", "numpy", "orjson", "httpx", "typer", "rich", "pynvml")
    code = f"""
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ImportError(f"{{name}} is not installed")
sys.meta_path.insert(0, Block())
import stepscope
prof = stepscope.init(job_id="j")  # no URL: a disabled, no-op profiler
with prof.step():
    with prof.section("forward"):
        pass
prof.close()
print(type(prof).__name__)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "Profiler"


def test_only_the_store_writes_sql() -> None:
    """No SQL text and no SQLAlchemy query building outside stepscope/store/."""
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE)
        if relative.parts[0] == "store":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                if SQL.search(node.value):
                    offenders.append(f"{relative}:{node.lineno} SQL text")
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                if node.value.id == "sa" and node.attr not in SA_ALLOWED:
                    offenders.append(f"{relative}:{node.lineno} sa.{node.attr}")
    assert offenders == []
