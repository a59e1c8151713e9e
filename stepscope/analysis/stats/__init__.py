"""Statistics the detectors share: robust spreads, change points, Student's t, runs of flagged
steps.
"""
