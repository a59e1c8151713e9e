"""Deep captures on the job page in a real browser (#21): asked from the form, followed until
both traces are stored, the two ranks' operators side by side, the traces downloadable."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.collector.test_captures import SLOW_FUNCTION, trace
from tests.dashboard.conftest import LIVE, Site
from tests.dashboard.test_pages import tab

pytestmark = pytest.mark.browser


def upload(url: str, capture_id: int, doc: dict[str, Any]) -> None:
    headers = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
    body = gzip.compress(json.dumps(doc).encode())
    response = httpx.post(f"{url}/v1/captures/{capture_id}", content=body, headers=headers)
    assert response.status_code == 200, response.text


def test_a_capture_asked_on_the_job_page_shows_both_ranks_side_by_side(
    browser: Any, site: Site, artifacts: Path
) -> None:
    url = site.server.url
    with tab(browser, site) as t:
        t.open(f"/jobs/{LIVE}")
        panel = t.page.locator("#job-captures")
        assert panel.inner_text() == "No deep capture of this job yet."
        t.page.fill("#job-capture-rank", "9")
        t.page.click("#job-capture-go")
        message = t.page.locator("#job-capture-message")
        message.get_by_text("rank 9 has sent no batch").wait_for(timeout=20_000)

        t.page.fill("#job-capture-rank", "3")
        t.page.fill("#job-capture-steps", "2")
        t.page.click("#job-capture-go")
        message.get_by_text("asked").wait_for(timeout=20_000)
        panel.get_by_text("rank 3 (culprit): requested").wait_for(timeout=20_000)
        assert "rank 0 (reference): requested" in panel.inner_text()

        [request] = httpx.get(f"{url}/api/v1/jobs/{LIVE}/captures").json()
        assert request["num_steps"] == 2
        by_role = {c["role"]: c["id"] for c in request["captures"]}
        upload(url, by_role["culprit"], trace(50_000))
        upload(url, by_role["reference"], trace(2_000))

        # The panel follows by itself until both are stored.
        row = panel.locator("tr", has_text=SLOW_FUNCTION)
        row.wait_for(timeout=30_000)
        cells = row.locator("td").all_inner_texts()
        assert cells == [SLOW_FUNCTION, "50 ms", "2 ms", "+48 ms"]
        t.screenshot(artifacts, "job-captures")
        links = panel.locator("a", has_text="trace")
        assert links.count() == 2
        culprit_href = links.first.get_attribute("href")
        assert culprit_href == f"/jobs/{LIVE}/captures/{by_role['culprit']}/trace"
        downloaded = t.page.request.get(url + culprit_href)
        assert downloaded.status == 200
        assert json.loads(gzip.decompress(downloaded.body())) == trace(50_000)
        other_job = t.page.request.get(url + f"/jobs/dash-main/captures/{by_role['culprit']}/trace")
        assert other_job.status == 404
        assert t.errors == []
