"""Zero-code profiling: `stepscope run` profiles a script that never imports stepscope.

`bootstrap/sitecustomize.py` (on PYTHONPATH) calls `install()` in every Python process of the
job; nothing happens until torch is imported, and no profiler starts until the process
builds an optimizer, wraps a model in DDP, iterates a DataLoader or runs a backward
(`hooks.py`); `steps.py` turns what the loop does into steps.
"""
