"""The README and docs/ as a newcomer reads them: every block marked runnable runs against a
real server, every relative link and anchor resolves, and every profiler option, server
setting, OpenAPI route and CLI command is documented.

A block runs when its fence says so: ```` ```bash runnable ```` or ```` ```python runnable ````.
The blocks of one file run in order, in one temporary directory that links the repository's
examples/ (the docs run them "from the repository root"), with STEPSCOPE_URL set to a
`stepscope serve` on SQLite and STEPSCOPE_DATABASE_URL to its database.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from stepscope.profiler.config import ENV_PREFIX, Config
from stepscope.server.settings import Settings
from tests.live_server import RunningServer, run_server
from tests.support import require, require_torchrun

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\S*)(.*)$")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
BLOCK_TIMEOUT_S = 120.0


@dataclass(frozen=True, slots=True)
class Block:
    path: Path
    line: int
    """1-based line of the opening fence."""
    language: str
    runnable: bool
    text: str

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks(path: Path) -> list[Block]:
    """The fenced code blocks of a Markdown file, in order."""
    found: list[Block] = []
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i].strip())
        if opening is None:
            i += 1
            continue
        language, rest = opening.group(1), opening.group(2).split()
        body: list[str] = []
        j = i + 1
        while j < len(lines) and lines[j].strip() != "```":
            body.append(lines[j])
            j += 1
        found.append(Block(path, i + 1, language, "runnable" in rest, "\n".join(body) + "\n"))
        i = j + 1
    return found


def prose(path: Path) -> str:
    """The file without its code blocks (links inside code are not links)."""
    return re.sub(r"^\s*```.*?^\s*```", "", path.read_text(), flags=re.S | re.M)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    headings = re.findall(r"^#{1,6}\s+(.*?)\s*#*$", prose(path), flags=re.M)
    return {slug(h) for h in headings}


def test_blocks_and_anchors_are_read_as_github_does(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "# The `serve` command\n## 1. Install\n\n```bash runnable\necho hi\n```\n\n"
        "```python\n# not a heading\n```\n"
    )
    assert anchors(page) == {"the-serve-command", "1-install"}
    first, second = blocks(page)
    assert (first.line, first.language, first.runnable) == (4, "bash", True)
    assert first.text == "echo hi\n"
    assert (second.language, second.runnable) == ("python", False)


def test_the_docs_mark_runnable_blocks() -> None:
    """The convention is used (a typo in the fence would silently run nothing)."""
    runnable = [b for path in DOCS for b in blocks(path) if b.runnable]
    assert {b.path.name for b in runnable} >= {"README.md", "getting-started.md", "profiler.md"}
    assert {b.language for b in runnable} == {"bash", "python"}


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_and_anchors_resolve(path: Path) -> None:
    broken: list[str] = []
    for match in LINK.finditer(prose(path)):
        target = match.group(1) or match.group(2)
        if re.match(r"^[a-z]+:", target):
            continue
        file_part, _, anchor = target.partition("#")
        resolved = (path.parent / file_part).resolve() if file_part else path
        if not resolved.exists():
            broken.append(f"{target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target}: no heading #{anchor}")
    assert broken == []


def test_every_doc_is_linked_from_the_index() -> None:
    index = prose(ROOT / "docs" / "README.md")
    linked = {m.group(1) for m in LINK.finditer(index) if m.group(1)}
    missing = [p.name for p in DOCS[1:] if p.name != "README.md" and p.name not in linked]
    assert missing == []


def test_every_profiler_option_and_variable_is_in_profiler_md() -> None:
    text = (ROOT / "docs" / "profiler.md").read_text()
    missing = [
        name
        for field in dataclasses.fields(Config)
        for name in (f"`{field.name}`", f"`{ENV_PREFIX}{field.name.upper()}`")
        if name not in text
    ]
    for extra in ("STEPSCOPE_SUBMITTED_AT", "STEPSCOPE_SCHEDULED_AT", "STEPSCOPE_K8S_LABELS_FILE"):
        if f"`{extra}`" not in text:
            missing.append(extra)
    assert missing == []


def test_every_server_setting_is_in_deployment_md() -> None:
    text = (ROOT / "docs" / "deployment.md").read_text()
    missing = [f"STEPSCOPE_{n.upper()}" for n in Settings.model_fields]
    assert [name for name in missing if f"`{name}`" not in text] == []


def test_every_openapi_route_is_in_api_md() -> None:
    from stepscope.server.app import create_app

    text = (ROOT / "docs" / "api.md").read_text()
    routes = [
        f"`{method.upper()} {path}`"
        for path, item in create_app().openapi()["paths"].items()
        for method in item
    ]
    assert len(routes) > 20
    assert [route for route in routes if route not in text] == []


def test_every_cli_command_is_in_the_readme_table() -> None:
    from typer.main import get_command

    from stepscope.cli.app import app

    text = (ROOT / "README.md").read_text()
    commands = sorted(get_command(app).commands)  # type: ignore[attr-defined]
    assert "demo" in commands
    assert [c for c in commands if f"| `stepscope {c}" not in text] == []


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    with run_server() as running:
        yield running


def block_env(server: RunningServer) -> dict[str, str]:
    bin_dir = str(Path(sys.executable).parent)
    return {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "STEPSCOPE_URL": server.url,
        "STEPSCOPE_DATABASE_URL": server.db_url,
    }


def run_block(block: Block, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    if block.language == "python":
        command = [sys.executable, "-c", block.text]
    else:
        command = ["bash", "-euo", "pipefail", "-c", block.text]
    return subprocess.run(
        command,
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=BLOCK_TIMEOUT_S,
        check=False,
    )


RUNNABLE = [p for p in DOCS if any(b.runnable for b in blocks(p))]


@pytest.mark.parametrize("path", RUNNABLE, ids=lambda p: str(p.relative_to(ROOT)))
def test_runnable_blocks_run(path: Path, server: RunningServer, tmp_path: Path) -> None:
    env = block_env(server)
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    for block in blocks(path):
        if not block.runnable:
            continue
        assert block.language in ("bash", "python"), block.where
        if "torchrun" in block.text:
            require_torchrun()
        if "curl " in block.text:
            require(shutil.which("curl") is not None, "curl (apt-get install curl)")
        done = run_block(block, tmp_path, env)
        assert done.returncode == 0, f"{block.where}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert httpx.get(f"{server.url}/healthz").status_code == 200
