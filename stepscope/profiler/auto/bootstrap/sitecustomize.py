"""stepscope's zero-code bootstrap: `site` imports it in every Python process that
`stepscope run` starts (its folder is first on PYTHONPATH, which children inherit).

It runs the `sitecustomize` it hides (the user's or the environment's), then, with
STEPSCOPE_AUTO=1, installs zero-code's import hooks; it imports nothing heavy. Any failure is
said once on stderr and the program runs unprofiled.
"""

import importlib.machinery
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


def _run_hidden_sitecustomize() -> None:
    """Run the next `sitecustomize` on sys.path, as if ours were not there."""
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


def _install_zero_code() -> None:
    if os.environ.get("STEPSCOPE_AUTO", "").strip().lower() not in ("1", "true", "yes", "on"):
        return
    from stepscope.integrations.auto import install as install_adapters
    from stepscope.profiler.auto.hooks import install

    install()
    install_adapters()


try:
    _run_hidden_sitecustomize()
finally:
    try:
        _install_zero_code()
    except Exception as exc:
        sys.stderr.write(
            f"stepscope: zero-code profiling is off in this process ({type(exc).__name__}: {exc})\n"
        )
