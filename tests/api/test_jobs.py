"""The jobs list, summaries, findings, re-analysis and deletion, through real HTTP."""

from __future__ import annotations

import httpx
import polars as pl
import pytest

from stepscope.synthetic.generate import JobSpec, generate
from stepscope.synthetic.stream import stream_job
from tests.api.conftest import JOB, OTHER, Api
from tests.jobs import NUM_RANKS, NUM_STEPS, STRAGGLER, STRAGGLER_FROM
from tests.live_server import read_rows

WARMUP_STEPS = 10


def test_jobs_list_newest_first_with_summary_figures(api: Api) -> None:
    page = api.client.get("/jobs").json()
    jobs = {j["job_id"]: j for j in page["jobs"]}

    assert [j["job_id"] for j in page["jobs"]] == [JOB, OTHER]  # JOB started later
    assert page["next_cursor"] is None
    main = jobs[JOB]
    assert main["status"] == "finished"
    assert (main["world_size"], main["num_nodes"]) == (NUM_RANKS, 2)
    assert main["num_critical"] + main["num_warning"] >= 1
    assert jobs[OTHER]["num_critical"] == jobs[OTHER]["num_warning"] == 0


def test_jobs_filters_and_cursor_pages(api: Api) -> None:
    def ids(**params: object) -> list[str]:
        return [j["job_id"] for j in api.client.get("/jobs", params=params).json()["jobs"]]

    assert ids(min_severity="warning") == [JOB]
    assert ids(status="running") == []
    assert ids(status=["finished", "failed"]) == [JOB, OTHER]
    assert ids(benchmark_key="synth/8") == [JOB, OTHER]
    assert ids(name="8X400") == [JOB]  # case-insensitive substring
    assert ids(sort="step_p50_s") == [OTHER, JOB]
    assert ids(started_after="2000-01-01T00:00:00Z", started_before=4e9) == [JOB, OTHER]
    assert ids(started_after="2999-01-01") == []

    first = api.client.get("/jobs", params={"limit": 1, "sort": "-started_at"}).json()
    second = api.client.get(
        "/jobs", params={"limit": 1, "sort": "-started_at", "cursor": first["next_cursor"]}
    ).json()
    assert [j["job_id"] for j in first["jobs"] + second["jobs"]] == [JOB, OTHER]
    assert second["next_cursor"] is None


def test_summary_figures_equal_polars_over_the_ingested_rows(api: Api) -> None:
    summary = api.client.get(f"/jobs/{JOB}").json()
    per_step = (
        api.steps.filter(pl.col("step") >= WARMUP_STEPS)
        .group_by("step")
        .agg(
            pl.col("step_s").max().alias("job_step_s"),
            (pl.col("tokens").sum() / pl.col("step_s").max()).alias("tokens_per_s"),
        )
    )

    assert summary["status"] == "finished"
    assert (summary["world_size"], summary["num_nodes"], summary["num_ranks_seen"]) == (8, 2, 8)
    assert (summary["num_steps"], summary["first_step"], summary["last_step"]) == (
        NUM_STEPS,
        0,
        NUM_STEPS - 1,
    )
    assert summary["device_name"] == api.job.job["device_name"]
    assert summary["peak_flops"] == api.job.job["peak_flops"]
    assert summary["step_p50_s"] == pytest.approx(per_step["job_step_s"].median(), rel=0.01)
    assert summary["tokens_per_s"] == pytest.approx(per_step["tokens_per_s"].median(), rel=0.01)
    shares = [summary[f"{c}_share"] for c in ("data", "compute", "comm_wait")]
    assert sum(shares) == pytest.approx(1.0, abs=0.01)
    assert 0 < summary["mfu"] < 1
    assert summary["num_critical"] + summary["num_warning"] >= 1


def test_findings_name_the_straggler_in_one_line(api: Api) -> None:
    found = api.client.get(f"/jobs/{JOB}/findings").json()
    straggler = next(f for f in found if f["kind"] == "straggler_rank")

    assert straggler["ranks"] == [STRAGGLER]
    assert straggler["node"] == "node-0001"
    assert straggler["cause"] == "compute"
    assert abs(straggler["first_step"] - STRAGGLER_FROM) <= 30
    assert straggler["last_step"] is None  # it goes on to the end
    assert straggler["text"].startswith(straggler["severity"])
    assert f"rank {STRAGGLER}" in straggler["text"]
    assert "straggler since step" in straggler["text"]
    assert 0.05 < straggler["job_cost"] < 0.3
    assert all(len(f["text"]) <= 80 for f in found)
    assert api.client.get(f"/jobs/{OTHER}/findings").json() == []


@pytest.mark.parametrize(
    "path",
    [
        "/jobs/nope",
        "/jobs/nope/findings",
        "/jobs/nope/timeseries",
        "/jobs/nope/ranks",
        "/jobs/nope/heatmap",
        "/jobs/nope/collectives",
        "/jobs/nope/gpu",
        "/jobs/nope/export",
        f"/compare?baseline={JOB}&candidate=nope",
    ],
)
def test_an_unknown_job_is_a_404_naming_it(api: Api, path: str) -> None:
    response = api.client.get(path)
    assert response.status_code == 404
    assert "'nope'" in response.json()["detail"]


def test_analyze_reruns_and_returns_the_same_findings(api: Api) -> None:
    before = api.client.get(f"/jobs/{JOB}/findings").json()
    again = api.client.post(f"/jobs/{JOB}/analyze")
    full = api.client.post(f"/jobs/{JOB}/analyze", params={"full": True})

    def key(f: dict[str, object]) -> tuple[object, ...]:
        return (f["kind"], f["ranks"], f["first_step"], f["severity"])

    assert again.status_code == full.status_code == 200
    assert sorted(map(key, again.json())) == sorted(map(key, before))
    assert sorted(map(key, full.json())) == sorted(map(key, before))
    assert api.client.post("/jobs/nope/analyze").status_code == 404


def test_delete_removes_the_job_and_everything_derived(api: Api) -> None:
    doomed = generate(JobSpec(job_id="api-doomed", num_ranks=2, num_steps=60, spike_prob=0.0))
    assert not stream_job(doomed, api.server.url, steps_per_batch=30).failures
    assert api.client.post("/jobs/api-doomed/analyze").status_code == 200

    response = api.client.delete("/jobs/api-doomed")

    assert response.status_code == 200
    deleted = response.json()["deleted_rows"]
    assert deleted["jobs"] == 1
    assert deleted["steps"] == 2 * 60
    assert deleted["step_rollups"] == 60
    for table in ("steps", "collectives", "gpu_samples", "step_rollups", "findings", "ranks"):
        assert read_rows(api.server.db_url, table, "api-doomed") == []
    assert api.client.get("/jobs/api-doomed").status_code == 404
    assert api.client.delete("/jobs/api-doomed").status_code == 404
    assert api.client.get(f"/jobs/{JOB}").status_code == 200


def test_bad_parameters_are_422s_naming_the_parameter(api: Api) -> None:
    cases = {
        "limit": ("/jobs", {"limit": 0}),
        "sort": ("/jobs", {"sort": "speed"}),
        "status": ("/jobs", {"status": "paused"}),
        "cursor": ("/jobs", {"cursor": "not-a-cursor"}),
        "started_after": ("/jobs", {"started_after": "yesterday"}),
        "min_severity": ("/jobs", {"min_severity": "fatal"}),
    }
    for parameter, (path, params) in cases.items():
        response = api.client.get(path, params=params)
        assert response.status_code == 422, parameter
        body = response.json()
        assert [e["parameter"] for e in body["errors"]] == [parameter]
        assert parameter in body["detail"]


def test_analyze_needs_post(api: Api) -> None:
    assert api.client.get(f"/jobs/{JOB}/analyze").status_code == 405
    assert isinstance(api.client, httpx.Client)


@pytest.mark.parametrize(
    "params",
    [
        {"name": "' OR 1=1 --"},
        {"name": "%"},
        {"name": "_"},
        {"name": "8x400'; DROP TABLE jobs; --"},
        {"benchmark_key": "synth/8' OR '1'='1"},
        {"benchmark_key": "%"},
    ],
)
def test_filters_with_sql_fragments_match_literally(api: Api, params: dict[str, str]) -> None:
    response = api.client.get("/jobs", params=params)
    assert response.status_code == 200
    assert response.json()["jobs"] == []
    assert [j["job_id"] for j in api.client.get("/jobs").json()["jobs"]] == [JOB, OTHER]


def test_a_cursor_that_is_not_ours_is_a_422(api: Api) -> None:
    response = api.client.get("/jobs", params={"cursor": "' OR 1=1 --"})
    assert response.status_code == 422
    assert "cursor" in response.text
