"""The job page of a large job in headless Chromium, beside the framework's floor (DESIGN §7).

A job (steps, collectives and GPU samples as synthetic.generate makes them, with stragglers
and a slow node; benchmarks/query_scale.py's make_job) is stored through the bulk writer
and analysed; `stepscope serve`'s app then runs on a loopback port with one extra page,
/floor, holding a single empty graph: what any Dash page with a graph costs on this
machine. Chromium (Debian's, driven by Playwright) opens each page in a fresh context
(cold cache) and again in the same context (warm cache); printed per page: the time until
every graph has rendered and the bytes transferred (encoded, as on the wire). Goals: the
job page ≤ 1.5 × the floor, ≤ 3 MB. While one more job page loads (not timed: the poller
would take CPU from the page it runs beside), /healthz is polled: its latency shows whether
dashboard work blocks the event loop that serves ingest. Then a live
refresh: the job's last 100 steps are stored and analysed while a job page is open, its
refresh is fired, and the bytes it transferred are printed (goal ≤ 200 KB).

    python benchmarks/dashboard_load.py [--ranks 1024] [--steps 10000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from query_scale import JOB_ID, make_job, store_batches  # noqa: E402

from stepscope.pipeline.job_pass import JobAnalyzer  # noqa: E402
from stepscope.store.engine import make_engine  # noqa: E402
from stepscope.store.migrate import upgrade  # noqa: E402
from tests.live_server import free_port, wait_healthy  # noqa: E402

CHROMIUM = os.environ.get("STEPSCOPE_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]
RATIO_GOAL = 1.5
BYTES_GOAL = 3_000_000
REFRESH_GOAL_BYTES = 200_000
NEW_STEPS = 100
"""Steps stored while a job page is open, for its live refresh."""
SERVER = """
import sys, uvicorn, dash, plotly.graph_objects as go
from dash import dcc
from stepscope.server.app import create_app
from stepscope.server.settings import Settings
app = create_app(Settings(database_url=sys.argv[1], analyze_interval_s=0))
dash.register_page("floor", path="/floor", layout=lambda **_: dcc.Graph(figure=go.Figure()))
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[2]), log_level="warning")
"""
SETTLED = """() => {
    if (document.querySelector('[data-dash-is-loading="true"]')) return false;
    const graphs = [...document.querySelectorAll('.dash-graph')];
    return graphs.length > 0 && graphs.every(g => {
        const plot = g.querySelector('.js-plotly-plot');
        return plot && plot._fullLayout && !plot.classList.contains('dash-graph--pending');
    });
}"""


def verdict(ok: bool) -> str:
    return "ok" if ok else "MISSED"


def load(context: Any, url: str) -> tuple[float, int, int]:
    """(seconds until every graph rendered, bytes transferred, graphs) of one page load."""
    page = context.new_page()
    cdp = context.new_cdp_session(page)
    cdp.send("Network.enable")
    sizes: list[int] = []
    cdp.on("Network.loadingFinished", lambda e: sizes.append(int(e["encodedDataLength"])))
    t0 = time.perf_counter()
    page.goto(url)
    page.wait_for_function(SETTLED, timeout=120_000, polling=20)
    elapsed = time.perf_counter() - t0
    page.wait_for_timeout(300)  # let the last responses report their sizes
    graphs = page.evaluate("() => document.querySelectorAll('.dash-graph').length")
    page.close()
    return elapsed, sum(sizes), int(graphs)


def live_refresh(context: Any, url: str, add_steps: Any) -> tuple[int, int, int]:
    """(bytes the refresh transferred, last step on the band before, after) of a job page
    whose job gets new steps while it is open."""
    page = context.new_page()
    cdp = context.new_cdp_session(page)
    cdp.send("Network.enable")
    sizes: list[int] = []
    cdp.on("Network.loadingFinished", lambda e: sizes.append(int(e["encodedDataLength"])))
    page.goto(url)
    page.wait_for_function(SETTLED, timeout=120_000, polling=20)
    page.wait_for_timeout(300)
    last_step = """() => Math.max(...document.querySelector('#job-band .js-plotly-plot')._fullData
        .map(t => (t.x && t.x.length ? Math.max(...Array.from(t.x)) : -Infinity)))"""
    before = int(page.evaluate(last_step))
    add_steps()
    sizes.clear()
    with page.expect_response(lambda r: "_dash-update-component" in r.url, timeout=60_000):
        page.evaluate("() => window.dash_clientside.set_props('job-live', {n_intervals: 1})")
    page.wait_for_function(SETTLED, timeout=120_000, polling=20)
    page.wait_for_timeout(500)
    after = int(page.evaluate(last_step))
    page.close()
    return sum(sizes), before, after


def measure(browser: Any, url: str, repeat: int) -> dict[str, tuple[float, int, int]]:
    """Median cold and warm loads of a page."""
    cold, warm = [], []
    for _ in range(repeat):
        context = browser.new_context(viewport={"width": 1400, "height": 1000})
        cold.append(load(context, url))
        warm.append(load(context, url))
        context.close()

    def median(runs: list[tuple[float, int, int]]) -> tuple[float, int, int]:
        return (
            statistics.median(r[0] for r in runs),
            int(statistics.median(r[1] for r in runs)),
            runs[0][2],
        )

    return {"cold": median(cold), "warm": median(warm)}


def poll_health(url: str, stop: threading.Event, out: list[float]) -> None:
    with httpx.Client(timeout=10) as client:
        while not stop.is_set():
            t0 = time.perf_counter()
            client.get(f"{url}/healthz")
            out.append((time.perf_counter() - t0) * 1e3)
            time.sleep(0.02)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory() as tmp:
        db_url = f"sqlite:///{tmp}/dashboard.db"
        engine = make_engine(db_url)
        upgrade(engine)
        job = make_job(args.ranks, args.steps)
        last_old = args.steps - NEW_STEPS - 1
        rows, seconds = store_batches(engine, job, 0, last_old)
        t0 = time.perf_counter()
        JobAnalyzer(engine, JOB_ID, grace_s=0.0).run(full=True)
        print(
            f"job {args.ranks} ranks x {last_old + 1:,} steps: {rows:,} rows stored in "
            f"{seconds:.1f} s, analysed in {time.perf_counter() - t0:.1f} s"
        )

        def add_steps() -> None:
            store_batches(engine, job, last_old + 1, args.steps - 1)
            JobAnalyzer(engine, JOB_ID, grace_s=0.0).run()

        port = free_port()
        server = subprocess.Popen(
            [sys.executable, "-c", SERVER, db_url, str(port)], cwd=tmp, stderr=subprocess.PIPE
        )
        url = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(url, proc=server)
            with sync_playwright() as p:
                browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
                measure(browser, f"{url}/floor", 1)  # first requests warm the server
                floor = measure(browser, f"{url}/floor", args.repeat)
                job_page = measure(browser, f"{url}/jobs/{JOB_ID}", args.repeat)
                # apart from the timed loads: on 2 cores the poller would slow the page it
                # runs beside
                health: list[float] = []
                stop = threading.Event()
                poller = threading.Thread(target=poll_health, args=(url, stop, health))
                poller.start()
                measure(browser, f"{url}/jobs/{JOB_ID}", 1)
                stop.set()
                poller.join()
                context = browser.new_context(viewport={"width": 1400, "height": 1000})
                refresh = live_refresh(context, f"{url}/jobs/{JOB_ID}", add_steps)
                context.close()
                browser.close()
        finally:
            server.terminate()
            server.wait(timeout=10)
            engine.dispose()

    print(f"\nmedian of {args.repeat} loads in headless Chromium (time until every graph drew)")
    print(f"{'':22s}{'cold cache':>26s}{'warm cache':>26s}")
    for label, result in (("floor (1 empty graph)", floor), ("job page", job_page)):
        cells = "".join(
            f"{result[c][0] * 1e3:10.0f} ms {result[c][1] / 1e6:8.2f} MB  "
            for c in ("cold", "warm")
        )
        print(f"{label:22s}{cells}  ({result['cold'][2]} graphs)")
    for cache in ("cold", "warm"):
        ratio = job_page[cache][0] / floor[cache][0]
        size = job_page[cache][1]
        print(
            f"{cache} cache: job page / floor = {ratio:.2f} [goal <= {RATIO_GOAL}: "
            f"{verdict(ratio <= RATIO_GOAL)}]; {size / 1e6:.2f} MB "
            f"[goal <= {BYTES_GOAL / 1e6:.0f} MB: {verdict(size <= BYTES_GOAL)}]"
        )
    size, before, after = refresh
    print(
        f"live refresh after {NEW_STEPS} new steps: {size / 1e3:.1f} KB, band to step {before:,} "
        f"then {after:,} [goal <= {REFRESH_GOAL_BYTES / 1e3:.0f} KB: "
        f"{verdict(size <= REFRESH_GOAL_BYTES and after > before)}]"
    )
    health.sort()
    print(
        f"/healthz while the job page loads: p50 {statistics.median(health):.1f} ms, "
        f"max {health[-1]:.1f} ms over {len(health)} requests (Dash runs in a2wsgi threads)"
    )


if __name__ == "__main__":
    main()
