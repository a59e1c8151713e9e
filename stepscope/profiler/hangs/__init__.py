"""Hangs: the progress watchdog, its reports, `stepscope run`'s dump watcher and on-hang action."""
