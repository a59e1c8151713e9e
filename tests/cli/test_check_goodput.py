"""`stepscope check --metric goodput --metric badput_<category>`: the goodput shares as gate
metrics, on stored jobs (SQLite and PostgreSQL) with known timelines."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from stepscope.cli.app import app
from stepscope.pipeline.job_pass import JobAnalyzer
from stepscope.query.goodput import job_goodput
from stepscope.store.engine import make_engine
from stepscope.synthetic.goodput_timelines import Failure, Scenario, generate
from tests.goodput_jobs import store_timeline

BASELINES = [f"clean-{i}" for i in range(5)]
METRICS = ("goodput", "badput_restart_downtime", "badput_lost_progress")


def _store(db_url: str) -> dict[str, float]:
    """Five clean baselines, a clean candidate and one that crashed at step 60 and was down
    300 s; returns each candidate's goodput."""
    engine = make_engine(db_url)
    jobs = {job_id: Scenario(world_size=4, num_steps=120, seed=i, rank_rows=True) for i, job_id in
            enumerate([*BASELINES, "cand-clean"])}  # fmt: skip
    jobs["cand-crashed"] = Scenario(
        world_size=4,
        num_steps=120,
        seed=9,
        failures=[Failure(at_step=60, downtime_s=300.0)],
        rank_rows=True,
    )
    for job_id, scenario in jobs.items():
        store_timeline(engine, generate(scenario), job_id)
        JobAnalyzer(engine, job_id, grace_s=0).run()
    shares = {j: job_goodput(engine, j).result.goodput for j in ("cand-clean", "cand-crashed")}
    engine.dispose()
    return shares


def _check(db_url: str, candidate: str, out: Path) -> tuple[int, dict]:
    args = ["check", candidate, "--db", db_url, "--json", str(out)]
    args += [a for b in BASELINES for a in ("--baseline", b)]
    args += [a for m in METRICS for a in ("--metric", m)]
    result = CliRunner().invoke(app, args, env={"STEPSCOPE_DATABASE_URL": ""})
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    return result.exit_code, json.loads(out.read_text())


def test_more_badput_fails_the_gate_and_a_clean_job_passes(db_url: str, tmp_path: Path) -> None:
    goodput = _store(db_url)
    assert goodput["cand-crashed"] < goodput["cand-clean"] - 0.2

    code, doc = _check(db_url, "cand-clean", tmp_path / "clean.json")
    verdicts = {v["metric"]: v for v in doc["metrics"]}
    assert code == 0, doc
    assert sorted(verdicts) == sorted(METRICS)
    assert all(v["outcome"] == "pass" for v in verdicts.values())
    assert verdicts["goodput"]["candidate"] == pytest.approx(goodput["cand-clean"], rel=1e-9)
    assert verdicts["goodput"]["num_baselines"] == 5
    assert verdicts["badput_restart_downtime"]["candidate"] == 0.0

    code, doc = _check(db_url, "cand-crashed", tmp_path / "crashed.json")
    verdicts = {v["metric"]: v for v in doc["metrics"]}
    assert code == 1
    assert doc["outcome"] == "regression"
    for metric in METRICS:
        assert verdicts[metric]["outcome"] == "regression", verdicts[metric]
    g = verdicts["goodput"]
    assert g["candidate"] == pytest.approx(goodput["cand-crashed"], rel=1e-9)
    assert g["higher_is_better"] is True
    assert g["limit"] < g["baseline"]
    assert g["effect"] == pytest.approx(g["candidate"] - g["baseline"], rel=1e-9)
    assert "pp of the GPU-time" in g["reason"]


def test_an_unknown_goodput_metric_is_a_usage_error(db_url: str) -> None:
    result = CliRunner().invoke(
        app,
        ["check", "x", "--db", db_url, "--baseline", "y", "--metric", "badput_coffee"],
        env={"STEPSCOPE_DATABASE_URL": ""},
    )
    assert result.exit_code == 2
    assert "badput_restart_downtime" in result.output + str(result.stderr)
