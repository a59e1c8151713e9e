"""Communication: per-rank collective finish times, slow collectives, and who waited for whom per
group.
"""
