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
