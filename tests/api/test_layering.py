"""DESIGN §1/§6: routers hold no SQL and no statistics; the collector does not import api."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import stepscope.api.routes

BANNED_IMPORTS = ("sqlalchemy", "numpy", "polars", "pyarrow", "stepscope.analysis")
SQL = re.compile(
    r"\bSELECT\b.+\bFROM\b|\bINSERT\s+INTO\b|\bDELETE\s+FROM\b|\bUPDATE\s+\S+\s+SET\b", re.I
)


def test_routers_import_no_sql_or_statistics_library() -> None:
    package = Path(stepscope.api.routes.__file__).parent
    offenders = []
    for path in sorted(package.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            offenders += [f"{path.name}: {n}" for n in names if n.startswith(BANNED_IMPORTS)]
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                if SQL.search(node.value):
                    offenders.append(f"{path.name}:{node.lineno} SQL text")
    assert offenders == []


def test_the_collector_does_not_import_the_api_layer() -> None:
    code = (
        "import sys, stepscope.collector.ingest, stepscope.collector.validate\n"
        "print(' '.join(m for m in sys.modules if m.startswith('stepscope.api')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == []
