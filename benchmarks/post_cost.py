"""The posting thread's CPU per POST: urllib's urlopen (a connection per request, what the
shipper and the watchdog used) against `stepscope.profiler.shipping.transport.Poster` (one
kept-alive connection), to a loopback HTTP/1.1 sink that keeps connections open as `stepscope serve`
(uvicorn) does.

Rounds alternate the two in a random order, each posting `--posts` bodies of about the size
of a 2-second DDP batch; the figure is the median over rounds of the thread CPU per post.

    flock /tmp/stepscope-bench.lock .venv/bin/python benchmarks/post_cost.py
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import statistics
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from http.server import ThreadingHTTPServer
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from profiler_cost import _Sink, host_speed_text  # noqa: E402

from stepscope.profiler.shipping.transport import Poster  # noqa: E402

HEADERS = {"Content-Type": "application/json", "Content-Encoding": "gzip"}


def body_of(steps: int) -> bytes:
    """A gzipped columnar batch of `steps` step rows, as the shipper sends."""
    rng = random.Random(0)
    columns = {
        name: [round(rng.uniform(0.0, 0.01), 7) for _ in range(steps)]
        for name in ("step_s", "data_s", "forward_s", "backward_s", "optimizer_s", "compute_s")
    }
    columns["step"] = list(range(steps))
    return gzip.compress(json.dumps({"steps": columns}).encode(), compresslevel=1)


def thread_cpu_per_post_us(post: Callable[[], object], posts: int) -> float:
    start = time.thread_time()
    for _ in range(posts):
        post()
    return (time.thread_time() - start) / posts * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--posts", type=int, default=200, help="posts per method and round")
    p.add_argument("--steps", type=int, default=200, help="step rows in each body")
    args = p.parse_args()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Sink)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/v1/ingest"
    body = body_of(args.steps)
    poster = Poster(url, timeout_s=10.0)

    def via_urlopen() -> None:
        request = urllib.request.Request(url, data=body, headers=HEADERS, method="POST")
        with urllib.request.urlopen(request, timeout=10.0) as response:
            response.read()

    methods = {"urlopen": via_urlopen, "Poster": lambda: poster.post(body, HEADERS)}
    for post in methods.values():  # warm both up
        thread_cpu_per_post_us(post, 20)
    rng = random.Random(0)
    figures: dict[str, list[float]] = {name: [] for name in methods}
    for _ in range(args.rounds):
        for name in rng.sample(list(methods), len(methods)):
            figures[name].append(thread_cpu_per_post_us(methods[name], args.posts))
    print(
        f"Thread CPU per POST of a {len(body):,}-byte body to a loopback HTTP/1.1 sink, median "
        f"of {args.rounds} rounds of {args.posts} posts; {host_speed_text()}:"
    )
    for name, values in figures.items():
        print(
            f"  {name:8} {statistics.median(values):6.1f} µs (rounds {min(values):.1f} .. "
            f"{max(values):.1f})"
        )
    poster.close()
    server.shutdown()


if __name__ == "__main__":
    main()
