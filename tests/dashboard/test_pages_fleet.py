"""The fleet page in headless Chromium: a server holding a generated fleet (200 jobs over 64
nodes, three chronically slow) lists the three as suspects with links to their jobs, and
draws nodes × time with the suspects first."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from stepscope.store.engine import make_engine
from stepscope.store.migrate import upgrade
from stepscope.synthetic.fleet import FleetSpec, fleet_levels, slow_node_names, write_fleet
from stepscope.text.numbers import signed_share
from tests.dashboard.test_pages import Tab
from tests.live_server import RunningServer, run_server

pytestmark = pytest.mark.browser
SPEC = FleetSpec(num_nodes=64, num_jobs=200, seed=1)


@pytest.fixture(scope="module")
def fleet_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    url = f"sqlite:///{tmp_path_factory.mktemp('fleet') / 'stepscope.db'}"
    engine = make_engine(url)
    upgrade(engine)
    write_fleet(engine, fleet_levels(SPEC, with_gpus=True))
    engine.dispose()
    with run_server(url) as server:
        yield server


def test_fleet_page_lists_the_suspects_and_draws_nodes_by_time(
    browser: Any, fleet_server: RunningServer, artifacts: Path
) -> None:
    truth = slow_node_names(SPEC)
    by_effect = sorted(truth, key=truth.__getitem__, reverse=True)
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    try:
        t = Tab(context.new_page(), fleet_server.url)
        t.open("/fleet")
        assert t.page.locator("h1").inner_text() == "Fleet"
        rows = t.page.locator("#fleet-suspects tbody tr")
        assert rows.count() == 3
        cells = [rows.nth(i).locator("td").all_inner_texts() for i in range(3)]
        assert [c[0] for c in cells] == by_effect
        for c in cells:
            effect = float(c[1].strip("+%")) / 100
            assert effect == pytest.approx(truth[c[0]], abs=0.011)
            assert c[2] == "100%"
        heatmap = t.page.evaluate(
            """() => { const t = plotOf('fleet-heatmap')._fullData[0];
                       return {y: Array.from(t.y), z: Array.from(t.z, r => Array.from(r))}; }"""
        )
        assert heatmap["y"][:3] == by_effect
        slowest_row = [v for v in heatmap["z"][0] if v is not None and v == v]  # not NaN
        assert min(slowest_row) > 5.0  # percent: slow in every time bin it ran in
        t.screenshot(artifacts, "fleet")
        link = rows.nth(0).locator("td.evidence a").first
        assert signed_share(None) not in link.inner_text()
        href = link.get_attribute("href")
        assert href is not None
        assert re.fullmatch(r"/jobs/fleet-\d{5}", href)
        link.click()
        t.page.wait_for_url(re.compile(f"{href}$"), timeout=20_000)
        t.page.locator("h1, h2").first.wait_for(timeout=20_000)
        assert t.errors == []
    finally:
        context.close()
