"""A restarted job's goodput over time in a real browser: the stacked chart's traces hold the
windows the API computes, and the restart is marked where its processes began."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from stepscope.pipeline.job_pass import analyze_stored_job
from stepscope.query.goodput import job_goodput
from stepscope.synthetic.goodput_timelines import Failure, Scenario, generate
from stepscope.text.labels import goodput_category
from tests.dashboard.conftest import Site
from tests.dashboard.test_pages import tab
from tests.goodput_jobs import store_timeline

pytestmark = pytest.mark.browser

RESTARTED = "dash-restarted"

SHAPES_OF = """id => {
    const gd = plotOf(id);
    return {
        shapes: gd._fullLayout.shapes.map(s => ({x0: s.x0, dash: s.line.dash})),
        annotations: gd._fullLayout.annotations.map(a => a.text),
    };
}"""


def test_the_chart_over_time_stacks_the_windows_and_marks_the_restart(
    browser: Any, site: Site, artifacts: Path
) -> None:
    timeline = generate(
        Scenario(
            world_size=4,
            num_steps=120,
            seed=12,
            failures=[Failure(at_step=50, downtime_s=60.0)],
            rank_rows=True,
        )
    )
    store_timeline(site.engine, timeline, RESTARTED)
    analyze_stored_job(site.engine, RESTARTED, grace_s=0.0)
    answer = job_goodput(site.engine, RESTARTED)
    assert answer.windows is not None
    assert answer.window_s is not None
    restart_at = answer.result.incarnations[1].started_at
    with tab(browser, site) as t:
        t.open(f"/jobs/{RESTARTED}")
        t.screenshot(artifacts, "goodput-restarted")
        for category in ("productive", "restart_downtime", "lost_progress"):
            trace = t.trace("job-goodput-time", goodput_category(category))
            assert trace is not None, category
            expected = (answer.windows[category] / answer.window_s).to_list()
            assert trace["y"] == pytest.approx(expected, rel=1e-6, abs=1e-9)
        drawn = t.page.evaluate(f"() => ({SHAPES_OF})('job-goodput-time')")
        assert drawn["annotations"] == ["restart 1"]
        (shape,) = drawn["shapes"]
        assert shape["dash"] == "dash"
        drawn_at = datetime.fromisoformat(shape["x0"]).replace(tzinfo=UTC).timestamp()
        assert drawn_at == pytest.approx(restart_at, abs=1e-3)
        causes = t.page.locator("#job-goodput-causes").inner_text()
        assert causes.startswith("Top badput: restart ")  # 60 s down, rank 0 raised
        assert "(rank 0)" in causes
        assert t.errors == []
