"""Under `stepscope run`: attach each framework's adapter once the framework is imported.

Lightning needs nothing here (its callbacks entry point, in pyproject.toml, asks
`stepscope.integrations.lightning`); torchtitan's handler is named in
TITAN_STRUCT_LOGGER_HANDLERS by the launcher.
"""

from __future__ import annotations

from types import ModuleType

from stepscope.profiler.auto.imports import when_imported


def install() -> None:
    """Attach the Hugging Face Trainer's callback when `transformers.trainer` is imported."""
    when_imported("transformers.trainer", _attach_transformers)


def _attach_transformers(module: ModuleType) -> None:
    from stepscope.integrations.transformers import attach

    attach(module)
