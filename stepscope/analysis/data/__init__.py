"""The input pipeline: data-bound jobs and ranks."""
