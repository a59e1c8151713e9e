"""Fleet health: each node's own effect on step time, separated from its jobs'."""
