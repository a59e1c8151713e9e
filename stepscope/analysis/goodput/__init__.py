"""Goodput (docs/goodput.md): where every GPU-second of a job went, across incarnations."""
