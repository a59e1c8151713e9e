"""Frames the detectors read: dense (steps × ranks) grids, a job's steady state, findings as a
table.
"""
