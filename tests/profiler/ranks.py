"""Run a function on several spawned processes, one rank each, and collect what they report."""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


def run_ranks(
    target: Callable[[int, int, Any], None], world_size: int, *, timeout_s: float = 120
) -> list[dict[str, Any]]:
    """Run `target(rank, port, queue)` on `world_size` processes; what each put, by rank."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, port, queue)) for r in range(world_size)]
    for proc in procs:
        proc.start()
    results = sorted((queue.get(timeout=timeout_s) for _ in procs), key=lambda r: r["rank"])
    for proc in procs:
        proc.join(30)
    assert [r["rank"] for r in results] == list(range(world_size))
    return results
