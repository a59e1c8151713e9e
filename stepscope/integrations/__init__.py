"""Adapters for training frameworks (Lightning, the Hugging Face Trainer, torchtitan).

Each imports the profiler and, only when used, its framework: `pip install stepscope` imports
none of them. Under `stepscope run` they attach by themselves; without it, one line each
(docs/integrations.md).
"""
