"""What the passes of one owner (the server, a command) share across jobs and passes."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from stepscope.pipeline.recent_rows import RecentRowsCache


class PassResources:
    """What the passes run by one owner (the server's scheduler, a command) share: threads
    for their raw reads, and each live job's recent rows (stepscope.pipeline.recent_rows)."""

    def __init__(self, *, max_jobs: int = 16) -> None:
        self.reads = ThreadPoolExecutor(max_workers=2, thread_name_prefix="stepscope-read")
        """Reads of a pass's step and collective rows, side by side."""
        self.recent = RecentRowsCache(max_jobs)
        """The rows of each live job's last segment, from its previous pass."""

    def close(self) -> None:
        """Stop the read threads and drop the kept rows."""
        self.reads.shutdown(wait=True)
        self.recent.clear()

    def __enter__(self) -> PassResources:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()
