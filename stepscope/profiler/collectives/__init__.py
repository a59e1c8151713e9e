"""The collective tap: every collective per process group, and DDP's all-reduce timing."""
