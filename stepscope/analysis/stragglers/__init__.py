"""Stragglers: ranks slower than their peers, the test that finds them, segments of long jobs, and
the evidence.
"""
