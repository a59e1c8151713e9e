"""The dashboard in a real browser: headless Chromium against `stepscope serve`."""

from __future__ import annotations

import html
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pytest

from stepscope.pipeline.job_pass import analyze_stored_job
from stepscope.query.goodput import job_goodput
from tests.dashboard.conftest import HOSTILE_NAME, LIVE, MAIN, Site, send_rounds
from tests.jobs import STRAGGLER, STRAGGLER_FROM

pytestmark = pytest.mark.browser

SETTLED = """() => {
    if (document.querySelector('[data-dash-is-loading="true"]')) return false;
    if (!document.querySelector('h1, h2')) return false;
    return [...document.querySelectorAll('.dash-graph')].every(g => {
        const plot = g.querySelector('.js-plotly-plot');
        return plot && plot._fullLayout && !plot.classList.contains('dash-graph--pending');
    });
}"""


PLOT_OF = """() => { window.plotOf = id => {
    const el = document.getElementById(id);
    return el.classList.contains('js-plotly-plot') ? el : el.querySelector('.js-plotly-plot');
}; }"""


class Tab:
    """A browser tab that records console errors and uncaught exceptions."""

    def __init__(self, page: Any, base_url: str) -> None:
        self.page = page
        self.base_url = base_url
        self.errors: list[str] = []
        page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: self.errors.append(f"pageerror: {e}"))

    def open(self, path: str) -> None:
        self.page.goto(self.base_url + path)
        self.settle()
        self.page.evaluate(PLOT_OF)

    def settle(self) -> None:
        self.page.wait_for_function(SETTLED, timeout=60_000)

    def trace(self, graph_id: str, name: str) -> dict[str, Any]:
        """x, y (and z) of a drawn trace, read from plotly's full data."""
        return self.page.evaluate(
            """([id, name]) => {
                const gd = plotOf(id);
                const t = gd._fullData.find(t => t.name === name);
                const list = v => v == null ? null : Array.from(v, r =>
                    (r && r.length !== undefined && typeof r !== 'string') ? Array.from(r) : r);
                return t && {x: list(t.x), y: list(t.y), z: list(t.z)};
            }""",
            [graph_id, name],
        )

    def screenshot(self, artifacts: Path, name: str) -> None:
        self.page.screenshot(path=str(artifacts / f"{name}.png"), full_page=True)


@contextmanager
def tab(browser: Any, site: Site) -> Iterator[Tab]:
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    try:
        yield Tab(context.new_page(), site.server.url)
    finally:
        context.close()


def test_jobs_page_lists_jobs_and_a_row_opens_the_job(
    browser: Any, site: Site, artifacts: Path
) -> None:
    with tab(browser, site) as t:
        t.open("/")
        cell = t.page.locator(".ag-row [col-id=name]", has_text="llm").first
        cell.wait_for(timeout=20_000)
        assert cell.inner_text().startswith("<script>")  # the name is text, not markup
        job_id = t.page.locator(".ag-row [col-id=job_id]", has_text=MAIN).first
        assert job_id.inner_text() == MAIN  # the id beside the name
        t.screenshot(artifacts, "jobs")
        cell.click()
        t.page.wait_for_url(re.compile(f"/jobs/{MAIN}$"), timeout=20_000)
        t.page.locator("h1", has_text="llm").wait_for(timeout=20_000)
        t.settle()
        assert t.page.locator("h1").inner_text() == HOSTILE_NAME
        assert t.errors == []


def test_job_page_draws_the_ingested_values(browser: Any, site: Site, artifacts: Path) -> None:
    with tab(browser, site) as t:
        requests: list[str] = []
        t.page.on("request", lambda r: requests.append(r.url))
        t.open(f"/jobs/{MAIN}")
        t.screenshot(artifacts, "job")
        plotly_loads = [url for url in requests if "plotly.min.js" in url]
        assert len(plotly_loads) == 1  # started with the page, and the graphs waited for it
        per_step = (
            site.steps.group_by("step")
            .agg(pl.col("step_s").min().alias("lo"), pl.col("step_s").max().alias("hi"))
            .sort("step")
        )
        band = t.trace("job-band", "min–max across ranks")
        low = t.trace("job-band", "min")
        assert band["x"] == per_step["step"].to_list()  # 400 steps: none dropped
        np.testing.assert_allclose(band["y"], per_step["hi"].to_numpy(), rtol=1e-6)
        np.testing.assert_allclose(low["y"], per_step["lo"].to_numpy(), rtol=1e-6)

        (heat,) = t.page.evaluate(
            """() => plotOf('job-heatmap')._fullData
                   .map(t => ({y: Array.from(t.y), z: Array.from(t.z, r => Array.from(r)),
                               x: Array.from(t.x)}))"""
        )
        row = heat["y"].index(f"{STRAGGLER} · node-0001")
        mine = site.steps.filter(pl.col("rank") == STRAGGLER).sort("step")["compute_s"]
        edges = heat["x"]
        assert edges[0] == 0
        cells = np.array(heat["z"][row], dtype=np.float64)
        width = edges[1] - edges[0]
        expected = mine.to_numpy()[: len(cells) * width].reshape(-1, width).mean(axis=1)
        np.testing.assert_allclose(cells[: expected.size], expected, rtol=3e-3)
        slow = cells[STRAGGLER_FROM // width + 5 :].mean()
        assert slow > 1.2 * np.nanmean(np.array(heat["z"][0], dtype=np.float64)[5:])

        findings = t.page.locator("#job-findings").inner_text()
        assert f"rank {STRAGGLER} on node-0001" in findings
        since = re.search(rf"rank {STRAGGLER} on node-0001, since step (\d+)", findings)
        assert since is not None
        assert abs(int(since.group(1)) - STRAGGLER_FROM) <= 5
        compute = t.trace("job-breakdown", "compute")
        assert compute["y"][0] == f"{STRAGGLER} · node-0001"  # tops the breakdown

        # Goodput: a job without lifecycle events is one incarnation from its first step.
        answer = job_goodput(site.engine, MAIN)
        productive = t.trace("job-goodput", "productive")
        assert productive["y"] == ["incarnation 0"]
        assert productive["x"][0] == pytest.approx(
            answer.result.categories["productive"] / 3600, rel=1e-6
        )
        over_time = t.trace("job-goodput-time", "productive")
        assert answer.windows is not None
        assert answer.window_s is not None
        assert len(over_time["y"]) == answer.windows.height
        assert sum(over_time["y"]) * answer.window_s == pytest.approx(
            answer.result.categories["productive"], rel=1e-6
        )
        assert t.trace("job-goodput-time", "straggler wait")["y"]
        causes = t.page.locator("#job-goodput-causes").inner_text()
        assert causes.startswith("Top badput: ")
        assert "straggler wait" in causes
        assert t.errors == []


def test_a_finding_opens_its_rank(browser: Any, site: Site, artifacts: Path) -> None:
    with tab(browser, site) as t:
        t.open(f"/jobs/{MAIN}")
        t.page.locator("#job-findings a.rank", has_text=f"rank {STRAGGLER}").first.click()
        t.page.wait_for_url(re.compile(f"/jobs/{MAIN}/ranks/{STRAGGLER}$"), timeout=20_000)
        t.page.locator("h1", has_text="Rank").wait_for(timeout=20_000)
        t.settle()
        assert t.page.locator("h1").inner_text() == f"Rank {STRAGGLER} on node-0001"
        mine = t.trace("rank-metrics", f"rank {STRAGGLER}")
        assert len(mine["x"]) == 400
        assert "Other ranks on node-0001" in t.page.inner_text("main")
        t.screenshot(artifacts, "rank")
        assert t.errors == []


def test_unknown_job_reads_as_an_error(browser: Any, site: Site) -> None:
    with tab(browser, site) as t:
        t.open("/jobs/no-such-job")
        assert "No job 'no-such-job' is stored" in t.page.inner_text("main")
        assert t.errors == []


def test_a_job_name_with_markup_is_shown_as_text(browser: Any, site: Site) -> None:
    with tab(browser, site) as t:
        t.open(f"/jobs/{MAIN}")
        assert t.page.locator("h1").inner_text() == HOSTILE_NAME
        assert t.page.evaluate("() => window.__pwned") is None
        assert t.page.locator("main script, main b").count() == 0


def test_compare_page_overlays_both_jobs(browser: Any, site: Site, artifacts: Path) -> None:
    with tab(browser, site) as t:
        t.open(f"/compare?baseline={LIVE}&candidate={MAIN}")
        text = t.page.inner_text("main")
        assert "step time p50" in text
        # plotly renders a subset of HTML: names reach it escaped
        name = html.escape(f"candidate {HOSTILE_NAME}", quote=False)
        assert len(t.trace("compare-step", name)["x"]) == 400
        t.screenshot(artifacts, "compare")
        assert t.errors == []


def test_live_refresh_picks_up_new_steps(browser: Any, site: Site, artifacts: Path) -> None:
    with tab(browser, site) as t:
        t.open(f"/jobs/{LIVE}")
        before = t.page.locator("#job-last-update").inner_text()
        last = max(t.trace("job-band", "median rank")["x"])
        send_rounds(site.server.url, site.live_rounds)
        analyze_stored_job(site.engine, LIVE, grace_s=0.0)
        t.page.wait_for_function(
            """(last) => {
                const gd = plotOf('job-band');
                return gd._fullData.some(t => t.x && Math.max(...t.x) > last);
            }""",
            arg=last,
            timeout=40_000,
        )
        assert t.page.locator("#job-last-update").inner_text() != before
        t.screenshot(artifacts, "live")
        assert t.errors == []
