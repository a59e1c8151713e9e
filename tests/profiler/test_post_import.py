"""Zero-code's post-import hooks: a callback runs once its module has finished importing."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from stepscope.profiler.auto.imports import when_imported


@pytest.fixture
def module_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in [n for n in sys.modules if n.startswith("stepscope_probe")]:
        del sys.modules[name]


def test_the_callback_runs_after_the_module_body_and_only_then(module_dir: Path) -> None:
    (module_dir / "stepscope_probe_a.py").write_text("VALUE = 41\nVALUE += 1\n")
    seen: list[int] = []
    when_imported("stepscope_probe_a", lambda module: seen.append(module.VALUE))
    assert seen == []  # registering imports nothing

    import stepscope_probe_a  # type: ignore[import-not-found]

    assert seen == [42]
    assert stepscope_probe_a.VALUE == 42


def test_a_module_already_imported_gets_its_callback_at_once(module_dir: Path) -> None:
    (module_dir / "stepscope_probe_b.py").write_text("NAME = 'b'\n")
    import stepscope_probe_b  # type: ignore[import-not-found]  # noqa: F401

    seen: list[str] = []
    when_imported("stepscope_probe_b", lambda module: seen.append(module.NAME))
    assert seen == ["b"]


def test_a_failing_callback_is_logged_and_the_import_goes_on(
    module_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (module_dir / "stepscope_probe_c.py").write_text("NAME = 'c'\n")

    def broken(module: ModuleType) -> None:
        raise RuntimeError("hook bug")

    when_imported("stepscope_probe_c", broken)
    with caplog.at_level(logging.WARNING):
        import stepscope_probe_c  # type: ignore[import-not-found]

    assert stepscope_probe_c.NAME == "c"
    assert "a hook on stepscope_probe_c failed" in caplog.text
