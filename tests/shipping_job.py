"""A simulated multi-rank job whose ranks ship through the real profiler Shipper, in threads."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any

from stepscope.profiler.config import Config
from stepscope.profiler.shipping.shipper import Shipper


class ShippingJob:
    """`num_ranks` ranks, each a thread with its own Shipper, adding one step row each
    `1 / steps_per_s` s; rank r ships to `urls[r % len(urls)]`. The job counts what it made."""

    def __init__(
        self,
        urls: Sequence[str],
        *,
        job_id: str,
        num_ranks: int,
        num_steps: int,
        steps_per_s: float,
        **config: Any,
    ) -> None:
        self.job_id = job_id
        self.urls = list(urls)
        self.num_steps = num_steps
        self._interval_s = 1.0 / steps_per_s
        settings = {"flush_interval_s": 0.2, "backoff_max_s": 2.0, **config}
        job = {"job_id": job_id, "world_size": num_ranks, "device_name": "cpu", "attributes": {}}
        self.shippers = [
            Shipper(
                config=Config(url=urls[rank % len(urls)], **settings),
                job=dict(job),
                source={
                    "rank": rank,
                    "local_rank": rank % 8,
                    "node": f"node-{rank // 8}",
                    "pid": 1000 + rank,
                    "incarnation": uuid.uuid4().hex,
                },
            )
            for rank in range(num_ranks)
        ]
        self.produced = [0] * num_ranks
        """Step rows each rank handed to its shipper."""
        self.steps_done = 0
        """Steps every rank has finished (rank 0's count, the ranks go in lockstep)."""
        self._start_s = 0.0
        self._threads = [
            threading.Thread(target=self._train, args=(rank,), daemon=True)
            for rank in range(num_ranks)
        ]

    def start(self) -> None:
        self._start_s = time.monotonic()
        for thread in self._threads:
            thread.start()

    def _train(self, rank: int) -> None:
        shipper = self.shippers[rank]
        for step in range(self.num_steps):
            delay_s = self._start_s + (step + 1) * self._interval_s - time.monotonic()
            if delay_s > 0:
                time.sleep(delay_s)
            row = {"step": step, "ts": 1.7e9 + step * self._interval_s, "step_s": 0.05}
            shipper.add("steps", {**row, "data_s": 0.001 * (rank % 3)})
            self.produced[rank] += 1
            if rank == 0:
                self.steps_done = step + 1

    def wait_for_step(self, step: int, timeout_s: float = 60.0) -> None:
        """Block until the ranks passed `step`."""
        deadline = time.monotonic() + timeout_s
        while self.steps_done < step:
            assert time.monotonic() < deadline, f"the job did not reach step {step}"
            time.sleep(0.02)

    def finish(self, close_timeout_s: float = 60.0) -> list[bool]:
        """Wait for the ranks' last step, then close every shipper; which acknowledged all."""
        for thread in self._threads:
            thread.join(timeout=self.num_steps * self._interval_s + 60)
        closers: list[threading.Thread] = []
        acknowledged = [False] * len(self.shippers)

        def close(rank: int) -> None:
            acknowledged[rank] = self.shippers[rank].close(timeout_s=close_timeout_s)

        for rank in range(len(self.shippers)):
            closers.append(threading.Thread(target=close, args=(rank,)))
            closers[-1].start()
        for closer in closers:
            closer.join()
        return acknowledged

    def batches_sent(self) -> list[int]:
        return [s.stats.num_batches_sent for s in self.shippers]

    def dropped(self) -> list[dict[str, int]]:
        return [dict(s.stats.num_dropped) for s in self.shippers]

    @staticmethod
    def expected_steps(num_ranks: int, num_steps: int) -> Sequence[tuple[int, int]]:
        return [(r, s) for r in range(num_ranks) for s in range(num_steps)]
