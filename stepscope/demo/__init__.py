"""`stepscope demo`: a real CPU training job with injected trouble, analysed by a local server.

`stepscope.demo.train` runs inside torchrun and uses the profiler side only; the other modules
drive it from the CLI (server, launch, what was found).
"""

PROGRESS_PREFIX = "stepscope-demo:"
"""Rank 0 of the demo's job starts its progress lines on stdout with this (the CLI reads them)."""
