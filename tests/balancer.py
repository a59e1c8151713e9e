"""A round-robin TCP load balancer on a loopback port, in a thread, for replica tests: each
new connection goes to the next backend that accepts it (a dead one is skipped)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while chunk := await reader.read(65536):
            writer.write(chunk)
            await writer.drain()
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            writer.close()


@contextmanager
def round_robin(backend_ports: Sequence[int]) -> Iterator[str]:
    """Balance connections over the backends on 127.0.0.1; the balancer's URL."""
    turns = itertools.cycle(range(len(backend_ports)))
    loop = asyncio.new_event_loop()
    started = threading.Event()
    url: list[str] = []

    async def handle(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        for _ in backend_ports:
            port = backend_ports[next(turns)]
            try:
                backend_r, backend_w = await asyncio.open_connection("127.0.0.1", port)
            except OSError:
                continue
            await asyncio.gather(_pipe(client_r, backend_w), _pipe(backend_r, client_w))
            return
        client_w.close()  # no backend alive: the client sees a reset and retries

    async def serve() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        url.append(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}")
        started.set()
        async with server:
            await server.serve_forever()

    task: list[asyncio.Task[None]] = []

    def run() -> None:
        asyncio.set_event_loop(loop)
        task.append(loop.create_task(serve()))
        with contextlib.suppress(asyncio.CancelledError):
            loop.run_until_complete(task[0])

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    started.wait(10)
    try:
        yield url[0]
    finally:
        loop.call_soon_threadsafe(task[0].cancel)
        thread.join(timeout=10)
        loop.close()
