"""The `stepscope` command line.

`main` needs only the standard library: `stepscope run` works on a training node with the
base install, and the other commands (stepscope.cli.app, typer) ask for the server extra.
"""

from __future__ import annotations

import os
import sys
from importlib.util import find_spec

SERVER_EXTRA = "pip install 'stepscope[server]'"


def main() -> None:
    """The `stepscope` script."""
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    argv = sys.argv[1:]
    if argv[:1] == ["run"]:
        from stepscope.cli import run

        raise SystemExit(run.main(argv[1:]))
    missing = [name for name in ("typer", "rich") if find_spec(name) is None]
    if missing:
        command = f"stepscope {argv[0]}" if argv else "stepscope"
        sys.stderr.write(
            f"error: `{command}` needs the server extra ({', '.join(missing)} not installed): "
            f"{SERVER_EXTRA}; only `stepscope run` works without it\n"
        )
        raise SystemExit(2)
    from stepscope.cli.app import app

    app()
