"""stepscope: performance observability for distributed training (training-side API)."""

__version__ = "0.1.0"

from stepscope.profiler.api import Profiler, init  # noqa: E402
from stepscope.profiler.config import Config  # noqa: E402

__all__ = ["Config", "Profiler", "__version__", "init"]
