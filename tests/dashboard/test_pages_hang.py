"""A hanging job in a real browser (#19): the banner on the jobs list and the job page, and
the job page's panel (ranks by state, the stacks with the culprit's first). The hang comes in
as every rank's reports on POST /v1/hangs; the server's hang monitor stores the finding."""

from __future__ import annotations

import gzip
import random
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from stepscope.synthetic.hangs import DATA_STACK, Injected, Layout, heartbeats, inject
from tests.dashboard.conftest import Site
from tests.dashboard.test_pages import tab
from tests.jobs import mesh_job, store_mesh_job

pytestmark = pytest.mark.browser

HANGING = "dash-hang"
LAYOUT = Layout(dp=2, tp=2, pp=2, ranks_per_node=4)
"""8 ranks, as the mesh job has."""


def post_reports(url: str, docs: list[dict[str, Any]]) -> None:
    headers = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
    with httpx.Client(base_url=url, headers=headers) as client:
        for doc in docs:
            answer = client.post("/v1/hangs", content=gzip.compress(orjson.dumps(doc)))
            assert answer.status_code == 200, answer.text


@pytest.fixture(scope="module")
def hang(site: Site) -> Iterator[Injected]:
    """The mesh job, stored and hanging: rank culprit never entered the collective its peers
    wait in."""
    store_mesh_job(site.engine, mesh_job(HANGING))
    now = time.time()
    injected = inject(
        LAYOUT,
        HANGING,
        "never_entered",
        1,
        ts=now - 12.0,
        step=40,
        base_seq=80,
        rng=random.Random(3),
        hang_after_s=2.0,
    )
    post_reports(site.server.url, heartbeats(LAYOUT, HANGING, ts=now - 13.0, step=40, base_seq=80))
    post_reports(site.server.url, injected.reports)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        state = httpx.get(f"{site.server.url}/api/v1/jobs/{HANGING}/hang").json()
        if state["hang"] is not None:
            break
        time.sleep(0.2)
    assert state["hang"]["ranks"] == injected.culprits
    yield injected
    assert httpx.delete(f"{site.server.url}/api/v1/jobs/{HANGING}").status_code == 200


def test_the_jobs_list_and_the_job_page_show_the_hang_and_its_panel(
    browser: Any, site: Site, hang: Injected, artifacts: Path
) -> None:
    [culprit] = hang.culprits
    with tab(browser, site) as t:
        t.open("/")
        banner = t.page.locator("#jobs-hangs")
        assert banner.get_attribute("role") == "alert"
        text = banner.inner_text()
        assert HANGING in text
        assert f"rank {culprit}" in text
        assert "never entered" in text
        assert f"{hang.op} #{hang.seq}" in text
        t.screenshot(artifacts, "jobs-hang")
        banner.get_by_role("link", name=HANGING).click()
        t.page.wait_for_url(re.compile(f"/jobs/{HANGING}$"), timeout=20_000)
        t.settle()

        page_banner = t.page.locator("#job-hang-banner").inner_text()
        assert page_banner.startswith("Hanging now")
        assert f"Hang: rank {culprit}" in page_banner
        panel = t.page.locator("#job-hang")
        assert panel.is_visible()
        rows = [
            [cell.strip() for cell in row.split("\t")]
            for row in panel.locator("tbody tr").all_inner_texts()
        ]
        by_state: dict[str, list[list[str]]] = {}
        for row in rows:
            by_state.setdefault(row[0], []).append(row[1:])
        # The culprit's tp peer waits in tp all_reduce #seq; the culprit is elsewhere.
        waiting = {collective: (ranks, count) for collective, ranks, count in by_state["waiting"]}
        assert f"tp {hang.op} #{hang.seq}" in waiting
        num_waiting = sum(int(count) for _, count in waiting.values())
        assert by_state["elsewhere"] == [["", str(culprit), "1"]]
        assert num_waiting == LAYOUT.world_size - 1
        assert "silent" not in by_state
        # The stacks: the culprit's first, innermost call last (its data loader).
        stacks = panel.locator(".hang-stack")
        first = stacks.nth(0)
        assert first.get_attribute("id") == "hang-stack-culprit"
        assert f"rank {culprit}" in first.locator(".hang-stack-title").inner_text()
        lines = first.locator("pre").inner_text().splitlines()
        assert [line.split()[0] for line in lines] == [f["function"] for f in DATA_STACK]
        assert stacks.nth(1).get_attribute("id") == "hang-stack-majority"
        t.screenshot(artifacts, "job-hang")
        assert t.errors == []


def test_a_job_that_does_not_hang_has_no_banner_nor_panel(browser: Any, site: Site) -> None:
    with tab(browser, site) as t:
        t.open("/jobs/dash-main")
        assert t.page.locator("#job-hang-banner").inner_text() == ""
        assert not t.page.locator("#job-hang").is_visible()
