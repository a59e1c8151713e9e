"""stepscope: performance observability for distributed training (training-side API)."""

__version__ = "0.1.0"
