"""Two jobs compared: both summaries and their differences."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from tests.api.conftest import JOB, OTHER, Api


def test_compare_gives_both_summaries_and_their_differences(api: Api) -> None:
    body = api.client.get("/compare", params={"baseline": JOB, "candidate": OTHER}).json()
    base = api.client.get(f"/jobs/{JOB}").json()
    cand = api.client.get(f"/jobs/{OTHER}").json()

    assert body["baseline"] == base
    assert body["candidate"] == cand
    assert body["same_benchmark_key"] is True
    metrics = {m["name"]: m for m in body["metrics"]}
    assert set(metrics) == {"step_p50_s", "step_p90_s", "tokens_per_s", "samples_per_s", "mfu"}
    step = metrics["step_p50_s"]
    assert (step["baseline"], step["candidate"]) == (base["step_p50_s"], cand["step_p50_s"])
    assert step["difference"] == pytest.approx(cand["step_p50_s"] - base["step_p50_s"])
    assert step["relative"] == pytest.approx(cand["step_p50_s"] / base["step_p50_s"] - 1)
    assert step["relative"] < -0.1  # no straggler and a faster clean step
    assert step["higher_is_better"] is False
    assert metrics["tokens_per_s"]["higher_is_better"] is True


def test_compare_time_components_in_seconds_and_shares(api: Api) -> None:
    body = api.client.get("/compare", params={"baseline": JOB, "candidate": OTHER}).json()
    components = {c["component"]: c for c in body["components"]}
    typical = api.steps.group_by("step").agg(pl.col("compute_s").median())["compute_s"].median()

    assert set(components) == {"data", "compute", "comm_wait"}
    compute = components["compute"]
    assert compute["seconds"]["baseline"] == pytest.approx(typical, rel=1e-9)
    assert compute["share"]["baseline"] == body["baseline"]["compute_share"]
    assert compute["share"]["higher_is_better"] is None
    assert np.isclose(
        compute["seconds"]["difference"],
        compute["seconds"]["candidate"] - compute["seconds"]["baseline"],
    )


def test_compare_needs_both_jobs(api: Api) -> None:
    missing = api.client.get("/compare", params={"baseline": JOB})
    unknown = api.client.get("/compare", params={"baseline": "gone", "candidate": JOB})

    assert missing.status_code == 422
    assert missing.json()["errors"][0]["parameter"] == "candidate"
    assert unknown.status_code == 404
    assert "'gone'" in unknown.json()["detail"]
