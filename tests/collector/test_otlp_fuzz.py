"""Property-based fuzzing of the OTLP/HTTP metrics receiver through a real server: each
generated export (a valid OTLP JSON document, then random replacements and deletions at any
depth) is answered 200 with every point stored or counted as rejected, or a 4xx that says
why with nothing stored; never a 5xx, never a partial write."""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
import sqlalchemy as sa
from google.protobuf import json_format
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)

from stepscope.store.engine import make_engine
from tests.collector.test_fuzz import json_values, places
from tests.live_server import RunningServer, server_on

NUM_EXAMPLES = {"sqlite": 1000, "postgresql": 250}
"""Exports per engine (each is an HTTP request and two counts: about 0.1 s)."""
JOB_ID = "fz-otlp"


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def server(request: pytest.FixtureRequest) -> Iterator[RunningServer]:
    with server_on(request.param) as running:
        yield running


def _attribute(key: str, value: Any) -> dict[str, Any]:
    typed = {"intValue": str(value)} if isinstance(value, int) else {"stringValue": value}
    return {"key": key, "value": typed}


@st.composite
def exports(draw: st.DrawFn) -> dict[str, Any]:
    """An OTLP JSON export of gauges and sums placed by job and rank attributes, then up to
    three random replacements or deletions."""
    metrics = []
    for i in range(draw(st.integers(1, 3))):
        points = [
            {
                "timeUnixNano": str(1_800_000_000_000_000_000 + draw(st.integers(0, 10**12))),
                "attributes": [_attribute("layer", draw(st.sampled_from(["a", "b"])))],
                **(
                    {"asDouble": draw(st.floats(-1e6, 1e6))}
                    if draw(st.booleans())
                    else {"asInt": str(draw(st.integers(-(2**40), 2**40)))}
                ),
            }
            for _ in range(draw(st.integers(1, 3)))
        ]
        kind = draw(st.sampled_from(["gauge", "sum"]))
        data: dict[str, Any] = {"dataPoints": points}
        if kind == "sum":
            data |= {"aggregationTemporality": 2, "isMonotonic": True}
        metrics.append({"name": f"fz.metric.{i}", "unit": "1", kind: data})
    resource = [_attribute("job.id", JOB_ID), _attribute("rank", draw(st.integers(0, 3)))]
    doc = {
        "resourceMetrics": [
            {"resource": {"attributes": resource}, "scopeMetrics": [{"metrics": metrics}]}
        ]
    }
    for _ in range(draw(st.integers(0, 3))):
        spots = list(places(doc))
        if not spots:  # everything deleted
            break
        container, key = draw(st.sampled_from(spots))
        if draw(st.booleans()) and isinstance(container, dict):
            del container[key]
        else:
            container[key] = draw(json_values)
    return doc


def _num_points(body: bytes) -> int:
    """Data points in an export, as the OpenTelemetry protobuf library reads it."""
    message = ExportMetricsServiceRequest()
    json_format.ParseDict(orjson.loads(body), message, ignore_unknown_fields=True)
    return sum(
        len(getattr(metric, metric.WhichOneof("data")).data_points)
        for resource in message.resource_metrics
        for scope in resource.scope_metrics
        for metric in scope.metrics
        if metric.WhichOneof("data") is not None
    )


def _counts(engine: sa.Engine) -> dict[str, int]:
    with engine.connect() as conn:
        return {
            name: conn.execute(sa.text(f'SELECT count(*) FROM "{name}"')).scalar_one()
            for name in ("ingest_batches", "otlp_metrics", "gpu_samples")
        }


def test_a_fuzzed_export_is_stored_or_counted_or_rejected_whole(server: RunningServer) -> None:
    outcomes = {"stored": 0, "partly rejected": 0, "rejected": 0}
    engine = make_engine(server.db_url)

    @settings(
        max_examples=NUM_EXAMPLES[server.db_url.split(":")[0].split("+")[0]],
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(doc=exports(), gzipped=st.booleans())
    def check(doc: dict[str, Any], gzipped: bool) -> None:
        # A job of its own per export: a point stored by an earlier export (the same series
        # at the same time) is not stored again, rightly, and would blur the count.
        job_id = f"{JOB_ID}-{sum(outcomes.values())}"
        body = json.dumps(doc).replace(f'"{JOB_ID}"', f'"{job_id}"').encode()
        headers = {"Content-Type": "application/json"}
        if gzipped:
            headers["Content-Encoding"] = "gzip"
        before = _counts(engine)
        response = httpx.post(
            f"{server.url}/v1/metrics",
            content=gzip.compress(body) if gzipped else body,
            headers=headers,
            timeout=30,
        )
        after = _counts(engine)
        assert response.status_code < 500, response.text
        if response.status_code != 200:
            assert response.status_code in (400, 413, 422), response.text
            assert response.json()["detail"]  # says what is wrong
            assert after == before
            outcomes["rejected"] += 1
            return
        rejected = int(response.json().get("partialSuccess", {}).get("rejectedDataPoints", 0))
        stored = sum(after[t] - before[t] for t in ("otlp_metrics", "gpu_samples"))
        assert stored + rejected == _num_points(body), response.text
        outcomes["partly rejected" if rejected else "stored"] += 1

    check()
    engine.dispose()
    # The generator reaches every outcome (the mutations are not all fatal, nor all harmless).
    assert all(outcomes.values()), outcomes
