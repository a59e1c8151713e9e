"""The in-process profiler (runs inside every training rank; stdlib + torch only)."""

from .base import Profiler
from .config import Config, RunEnv, build_config, detect_env
from .setup import init

__all__ = ["Config", "Profiler", "RunEnv", "build_config", "detect_env", "init"]
