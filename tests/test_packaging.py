"""The wheel as users install it: `pip install stepscope` gives a `stepscope run` that works
without the server extra, and the server's install migrates a database from the wheel's
own migrations (not the source tree's)."""

from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from stepscope import __version__
from stepscope.store.migrate import head_revision

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("pyproject.toml", "setup.py", "README.md", "stepscope", "migrations")
"""What the Dockerfile copies: the wheel is built from these alone."""


def _run(*args: str | Path, cwd: Path, env: dict[str, str] | None = None) -> str:
    out = subprocess.run(
        list(map(str, args)),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
        env={**os.environ, **(env or {})},
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel of a copy of the sources (the build leaves nothing in the worktree)."""
    src = tmp_path_factory.mktemp("src")
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(ROOT / name, src / name)
    dist = tmp_path_factory.mktemp("dist")
    _run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", dist, src, cwd=src)  # fmt: skip
    (built,) = dist.glob("stepscope-*.whl")
    return built


def test_the_base_install_runs_a_training_command_and_asks_for_the_extra_otherwise(
    wheel: Path, tmp_path: Path
) -> None:
    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", "--without-pip", venv, cwd=tmp_path)
    python, stepscope = venv / "bin" / "python", venv / "bin" / "stepscope"
    _run(sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-index", wheel,
         cwd=tmp_path)  # fmt: skip

    assert "usage: stepscope run [--job-id ID]" in _run(stepscope, "run", "--help", cwd=tmp_path)
    # Zero-code's bootstrap ships in the wheel and imports nothing heavy (no torch here).
    child = (
        "import os, sys; print(os.environ['STEPSCOPE_JOB_ID'], os.environ['STEPSCOPE_URL'], "
        "'stepscope.profiler.auto.hooks' in sys.modules, 'torch' in sys.modules)"
    )
    launched = _run(stepscope, "run", "--job-id", "llm-7", "--url", "http://collector:8000",
                    "--", python, "-c", child, cwd=tmp_path)  # fmt: skip
    assert launched.split() == ["llm-7", "http://collector:8000", "True", "False"]
    show = "import stepscope; print(stepscope.__version__, stepscope.__file__)"
    imported = _run(python, "-c", show, cwd=tmp_path)
    version, where = imported.split()
    assert version == __version__
    assert Path(where).is_relative_to(venv)

    other = subprocess.run(
        [stepscope, "jobs"], capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    assert other.returncode == 2
    assert other.stderr.startswith("error: `stepscope jobs` needs the server extra")
    assert "pip install 'stepscope[server]'" in other.stderr
    assert len(other.stderr.splitlines()) == 1


def test_the_installed_wheel_migrates_a_fresh_database_with_its_own_migrations(
    wheel: Path, tmp_path: Path
) -> None:
    target = tmp_path / "site"
    _run(sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
         "--target", target, wheel, cwd=tmp_path)  # fmt: skip
    db = tmp_path / "fresh.db"
    # -I: neither the source tree, PYTHONPATH nor the user's site; the server extra comes from
    # this interpreter's site-packages, stepscope from the installed wheel.
    code = (
        "import sys\n"
        f"sys.path.insert(0, {str(target)!r})\n"
        "import stepscope, stepscope.migrations\n"
        "print(stepscope.__file__)\n"
        "print(stepscope.migrations.__file__)\n"
        "from stepscope.cli import main\n"
        f"sys.argv = ['stepscope', 'db', 'upgrade', '--db', 'sqlite:///{db}']\n"
        "main()\n"
    )
    out = _run(sys.executable, "-I", "-c", code, cwd=tmp_path, env={"COLUMNS": "200"})
    package, migrations = out.splitlines()[:2]
    assert Path(package).is_relative_to(target)
    assert Path(migrations).is_relative_to(target / "stepscope" / "migrations")
    with sqlite3.connect(db) as conn:
        tables = {name for (name,) in conn.execute("SELECT name FROM sqlite_master")}
        (revision,) = conn.execute("SELECT version_num FROM alembic_version").fetchone()
    assert {"jobs", "steps", "collectives", "step_rollups", "api_tokens"} <= tables
    assert revision == head_revision()
