"""DESIGN §1/§6: the query package composes store reads and holds no SQL."""

from __future__ import annotations

import ast
from pathlib import Path

import stepscope.query


def test_query_modules_use_sqlalchemy_only_for_the_engine_type_and_hold_no_sql() -> None:
    package = Path(stepscope.query.__file__).parent
    offenders = []
    for path in sorted(package.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                if node.value.id == "sa" and node.attr != "Engine":
                    offenders.append(f"{path.name}:{node.lineno} sa.{node.attr}")
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                if node.value.lstrip().upper().startswith(("SELECT ", "INSERT ", "DELETE ")):
                    offenders.append(f"{path.name}:{node.lineno} SQL text")
    assert offenders == []
