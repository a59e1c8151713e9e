"""Hangs: who holds the job up, in which collective, and why."""
