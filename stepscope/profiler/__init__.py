"""The in-process profiler (runs inside every training rank; stdlib + torch only)."""

from .api import Profiler, init
from .config import Config, RunEnv, build_config, detect_env

__all__ = ["Config", "Profiler", "RunEnv", "build_config", "detect_env", "init"]
