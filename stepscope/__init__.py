"""stepscope: performance observability for distributed training (training-side API)."""

from stepscope._version import __version__
from stepscope.profiler.base import Profiler
from stepscope.profiler.config import Config
from stepscope.profiler.setup import current, init

__all__ = ["Config", "Profiler", "__version__", "current", "init"]
