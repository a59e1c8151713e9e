"""The job page of a job on a 2 × 2 × 2 (pp, dp, tp) mesh in a real browser: the heatmap and
the breakdown grouped by a mesh dimension or by node, the collectives per group."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from stepscope.pipeline.job_pass import analyze_stored_job
from tests.dashboard.conftest import Site
from tests.dashboard.test_pages import tab
from tests.jobs import STRAGGLER, mesh_job, store_mesh_job

pytestmark = pytest.mark.browser

MESH = "dash-mesh"


@pytest.fixture(scope="module")
def mesh_site(site: Site) -> Iterator[Site]:
    """The site, also holding the mesh job while this module runs."""
    store_mesh_job(site.engine, mesh_job(MESH))
    analyze_stored_job(site.engine, MESH, grace_s=0.0)
    yield site
    assert httpx.delete(f"{site.server.url}/api/v1/jobs/{MESH}").status_code == 200


def choose(t: Any, dropdown_id: str, label: str) -> None:
    """Pick the option `label` of a dcc.Dropdown and wait for the page to settle."""
    t.page.locator(f"#{dropdown_id}").click()
    t.page.get_by_role("option", name=label).click()
    t.settle()


def rows_of(t: Any, graph_id: str) -> list[str]:
    return t.page.evaluate(f"() => Array.from(plotOf('{graph_id}')._fullData[0].y)")


def test_the_heatmap_and_breakdown_group_by_stage_and_node(
    browser: Any, mesh_site: Site, artifacts: Path
) -> None:
    with tab(browser, mesh_site) as t:
        t.open(f"/jobs/{MESH}")
        assert len(rows_of(t, "job-heatmap")) == 8

        choose(t, "job-heatmap-group-by", "by pipeline stage (pp)")
        t.page.wait_for_function("() => plotOf('job-heatmap')._fullData[0].y.length === 2")
        assert rows_of(t, "job-heatmap") == ["stage 0 · 4 ranks", "stage 1 · 4 ranks"]
        z = t.page.evaluate(
            "() => Array.from(plotOf('job-heatmap')._fullData[0].z, r => Array.from(r))"
        )
        assert np.isfinite(np.array(z, dtype=np.float64)).all()

        choose(t, "job-breakdown-group-by", "by node")
        t.page.wait_for_function(
            "() => plotOf('job-breakdown')._fullData[1].y.every(y => y.includes('ranks'))"
        )
        compute = t.trace("job-breakdown", "compute")
        assert sorted(compute["y"]) == ["node-0000 · 4 ranks", "node-0001 · 4 ranks"]
        slowest = t.page.evaluate(
            "() => Array.from(plotOf('job-breakdown')._fullData[1].customdata)"
        )
        assert STRAGGLER in slowest

        names = t.page.evaluate("() => plotOf('job-collectives')._fullData.map(t => t.name)")
        assert "dp all_reduce" in names
        assert "tp all_gather" in names
        t.screenshot(artifacts, "job-mesh")
        assert t.errors == []
