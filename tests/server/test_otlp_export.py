"""The server's OTLP log export: findings as they open and close, live jobs' summaries."""

from __future__ import annotations

import dataclasses
import logging
import time

import httpx
import pytest
from opentelemetry._logs import SeverityNumber
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.logs.v1.logs_pb2 import LogRecord

from stepscope.schema import Finding
from stepscope.server.otlp_export import OtlpEventExporter, logs_url
from stepscope.server.settings import Settings
from stepscope.store.availability import OUTAGES
from stepscope.store.engine import make_engine
from stepscope.synthetic.stream import stream_job
from tests.api.conftest import JOB, main_job
from tests.jobs import STRAGGLER
from tests.live_server import free_port, read_rows, run_server
from tests.server.webhook_receiver import Received, webhook_receiver
from tests.support import assert_one_outage_logged


def _value(value: AnyValue) -> object:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    return getattr(value, kind) if kind else None


def records(requests: list[Received]) -> list[tuple[str, LogRecord, dict[str, object]]]:
    """Each exported record as (service.name, record, attributes), decoded with the proto."""
    out = []
    for request in requests:
        export = ExportLogsServiceRequest.FromString(request.body)
        for resource_logs in export.resource_logs:
            resource = {a.key: _value(a.value) for a in resource_logs.resource.attributes}
            for scope_logs in resource_logs.scope_logs:
                for record in scope_logs.log_records:
                    attributes = {a.key: _value(a.value) for a in record.attributes}
                    out.append((str(resource["service.name"]), record, attributes))
    return out


def events(requests: list[Received], name: str) -> list[dict[str, object]]:
    return [a for _, r, a in records(requests) if r.event_name == name]


def test_the_server_exports_a_straggler_and_the_live_summary(db_url: str) -> None:
    with webhook_receiver() as sink:
        env = {
            "STEPSCOPE_OTLP_EXPORT_ENDPOINT": sink.url,
            "STEPSCOPE_OTLP_EXPORT_INTERVAL_S": "0.5",
        }
        with run_server(db_url, env=env) as server:
            assert not stream_job(main_job(), server.url, steps_per_batch=50).failures
            url = f"{server.url}/api/v1/jobs/{JOB}"
            found = httpx.post(f"{url}/analyze", timeout=120).json()
            alarming = [f for f in found if f["severity"] != "info"]
            summary = read_rows(db_url, "job_summaries", JOB)[0]
            sink.wait_for(
                lambda r: (
                    len(events(r, "stepscope.finding.opened")) >= len(alarming)
                    and bool(events(r, "stepscope.job.summary"))
                ),
                timeout_s=60,
            )
            httpx.post(f"{url}/analyze", params={"full": True}, timeout=120)

    assert {r.path for r in sink.requests} == {"/hook/v1/logs"}
    assert {r.headers["content-type"] for r in sink.requests} == {"application/x-protobuf"}
    exported = records(sink.requests)
    assert {service for service, _, _ in exported} == {"stepscope-server"}
    opened = [(r, a) for _, r, a in exported if r.event_name == "stepscope.finding.opened"]
    # The second pass found the same findings: nothing opened or closed again.
    assert sorted(str(a["stepscope.finding.kind"]) for _, a in opened) == sorted(
        f["kind"] for f in alarming
    )
    assert not events(sink.requests, "stepscope.finding.closed")
    (straggler,) = [(r, a) for r, a in opened if a["stepscope.finding.kind"] == "straggler_rank"]
    record, attributes = straggler
    (stored,) = [f for f in alarming if f["kind"] == "straggler_rank"]
    assert attributes["stepscope.job_id"] == JOB
    assert attributes["stepscope.finding.ranks"] == [STRAGGLER]
    assert attributes["stepscope.finding.node"] == "node-0001"
    assert attributes["stepscope.finding.severity"] == stored["severity"]
    assert attributes["stepscope.finding.cause"] == stored["cause"]
    assert attributes["stepscope.finding.effect"] == pytest.approx(stored["effect"])
    assert attributes["stepscope.finding.first_step"] == stored["first_step"]
    assert attributes.get("stepscope.finding.last_step") == stored["last_step"]
    assert f"rank {STRAGGLER} (node-0001)" in str(attributes["stepscope.finding.text"])
    assert record.body.string_value == attributes["stepscope.finding.text"]
    assert record.severity_text == stored["severity"]
    assert record.severity_number == {"warning": 13, "critical": 17}[stored["severity"]]
    latest = events(sink.requests, "stepscope.job.summary")[0]
    assert latest["stepscope.job_id"] == JOB
    assert latest["stepscope.job.step_time_p50_s"] == pytest.approx(summary["step_p50_s"])
    assert latest["stepscope.job.tokens_per_s"] == pytest.approx(summary["tokens_per_s"])
    assert latest["stepscope.job.mfu"] == pytest.approx(summary["mfu"])
    assert 0.5 < summary["goodput"] <= 1.0
    assert latest["stepscope.job.goodput"] == pytest.approx(summary["goodput"])
    assert latest["stepscope.job.findings.critical"] == summary["num_critical"]


def straggler(rank: int, **evidence: object) -> Finding:
    return Finding(
        job_id="job-x",
        kind="straggler_rank",
        severity="warning",
        ranks=[rank],
        node="node-0000",
        first_step=10,
        metric="compute_s",
        cause="compute",
        effect=0.2,
        evidence=dict(evidence),
    )


def test_findings_no_longer_reported_or_ended_are_closed(db_url: str) -> None:
    engine = make_engine(db_url)
    with webhook_receiver() as sink:
        exporter = OtlpEventExporter(engine, sink.url, interval_s=60)
        exporter.pass_findings("job-x", [straggler(1), straggler(2)])
        exporter.pass_findings("job-x", [straggler(1), straggler(2)])
        exporter.pass_findings("job-x", [straggler(1)])
        exporter.offered("job-x", [straggler(3)])  # a partial set closes nothing
        exporter.offered("job-x", [straggler(3, closed_at=1.0)])
        exporter.stop()  # flushes
    engine.dispose()
    states = [
        (a["stepscope.finding.state"], a["stepscope.finding.ranks"])
        for _, _, a in records(sink.requests)
    ]
    assert states == [
        ("opened", [1]),
        ("opened", [2]),
        ("closed", [2]),
        ("opened", [3]),
        ("closed", [3]),
    ]


def test_info_findings_are_exported_at_info_severity_and_not_sent_to_webhooks(
    db_url: str,
) -> None:
    engine = make_engine(db_url)
    info = dataclasses.replace(straggler(4), severity="info")
    with webhook_receiver() as sink:
        exporter = OtlpEventExporter(engine, sink.url, interval_s=60)
        exporter.pass_findings("job-x", [info])
        exporter.stop()
    engine.dispose()
    [(_, record, attributes)] = records(sink.requests)
    assert (record.severity_number, record.severity_text) == (SeverityNumber.INFO.value, "info")
    assert attributes["stepscope.finding.ranks"] == [4]


def test_an_unreachable_endpoint_breaks_neither_ingest_nor_analysis(db_url: str) -> None:
    env = {
        "STEPSCOPE_OTLP_EXPORT_ENDPOINT": f"http://127.0.0.1:{free_port()}",
        "STEPSCOPE_OTLP_EXPORT_INTERVAL_S": "0.2",
        "STEPSCOPE_OTLP_EXPORT_TIMEOUT_S": "1",
    }
    with run_server(db_url, env=env) as server:
        assert not stream_job(main_job(), server.url, steps_per_batch=50).failures
        response = httpx.post(f"{server.url}/api/v1/jobs/{JOB}/analyze", timeout=120)
        assert response.status_code == 200
        kinds = {f["kind"] for f in response.json()}
        assert "straggler_rank" in kinds
        assert httpx.get(f"{server.url}/healthz", timeout=30).status_code == 200


def test_the_export_is_off_unless_an_http_endpoint_is_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STEPSCOPE_OTLP_EXPORT_ENDPOINT", "")  # compose's unset variable
    assert Settings().otlp_export_endpoint is None
    monkeypatch.setenv("STEPSCOPE_OTLP_EXPORT_ENDPOINT", "otel-collector:4318")
    with pytest.raises(ValueError, match="must start with http"):
        Settings()
    assert logs_url("http://c:4318") == "http://c:4318/v1/logs"
    assert logs_url("http://c:4318/v1/logs") == "http://c:4318/v1/logs"


def test_a_database_outage_is_one_outage_line_not_a_traceback_every_interval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    engine = make_engine(f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/down")
    with webhook_receiver() as sink, caplog.at_level(logging.WARNING):
        exporter = OtlpEventExporter(engine, sink.url, interval_s=0.05)
        exporter.start()
        deadline = time.monotonic() + 30
        while not OUTAGES.ongoing and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)  # several more intervals meet the outage
        exporter.stop()
    engine.dispose()
    assert_one_outage_logged(caplog)
