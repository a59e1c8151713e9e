"""The in-process profiler (runs inside every training rank; stdlib + torch only)."""

from stepscope.profiler.base import Profiler
from stepscope.profiler.config import Config, RunEnv, build_config, detect_env
from stepscope.profiler.setup import current, init

__all__ = ["Config", "Profiler", "RunEnv", "build_config", "detect_env", "current", "init"]
