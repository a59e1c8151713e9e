"""POST /v1/metrics against a running server: the real OpenTelemetry SDK and its OTLP/HTTP
exporter, a Collector's relay of dcgm-exporter, bad bodies and unplaceable points."""

from __future__ import annotations

import gzip
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
from google.protobuf import json_format
from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics
from opentelemetry.exporter.otlp.proto.http import Compression
from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.metrics.v1.metrics_pb2 import Metric, NumberDataPoint
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource

from stepscope.synthetic.generate import JobSpec, generate
from stepscope.synthetic.stream import stream_job
from tests.live_server import RunningServer, read_rows, server_on

PROTOBUF = {"Content-Type": "application/x-protobuf"}


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def server(request: pytest.FixtureRequest) -> Iterator[RunningServer]:
    """A server on each engine (PostgreSQL writes the JSON columns through binary COPY)."""
    with server_on(request.param) as running:
        yield running


def _record(provider: MeterProvider) -> None:
    """A gauge, a sum, a histogram and two GPU gauges (OTel hw.gpu.* conventions)."""
    meter = provider.get_meter("stepscope-test")

    def loss(_options: CallbackOptions) -> list[Observation]:
        return [Observation(2.5, {"phase": "train"})]

    def gpu_util(_options: CallbackOptions) -> list[Observation]:
        return [Observation(0.75, {"gpu_index": 0}), Observation(0.25, {"gpu_index": 1})]

    def gpu_memory(_options: CallbackOptions) -> list[Observation]:
        return [Observation(40 * 2**30, {"gpu_index": 0}), Observation(2**30, {"gpu_index": 1})]

    meter.create_observable_gauge("train.loss", callbacks=[loss])
    meter.create_observable_gauge("hw.gpu.utilization", callbacks=[gpu_util], unit="1")
    meter.create_observable_gauge("hw.gpu.memory.usage", callbacks=[gpu_memory], unit="By")
    samples = meter.create_counter("train.samples", unit="{sample}")
    samples.add(10)
    samples.add(5)
    step = meter.create_histogram("train.step.duration", unit="s")
    for value in (0.1, 0.2, 0.4):
        step.record(value)


def _assert_stored(db_url: str, job_id: str) -> None:
    metrics = {r["name"]: r for r in read_rows(db_url, "otlp_metrics", job_id)}
    assert set(metrics) == {"train.loss", "train.samples", "train.step.duration"}
    assert all(r["rank"] == 1 for r in metrics.values())
    assert metrics["train.loss"]["kind"] == "gauge"
    assert metrics["train.loss"]["value"] == 2.5
    assert orjson.loads(metrics["train.loss"]["series"]) == {"phase": "train"}
    assert metrics["train.samples"]["kind"] == "sum"
    assert metrics["train.samples"]["value"] == 15.0
    histogram = metrics["train.step.duration"]
    assert histogram["kind"] == "histogram"
    assert histogram["count"] == 3
    assert histogram["value"] == pytest.approx(0.7)
    assert (histogram["min"], histogram["max"]) == (0.1, 0.4)
    counts = histogram["bucket_counts"]
    assert sum(orjson.loads(counts) if isinstance(counts, str) else counts) == 3
    gpu = sorted(read_rows(db_url, "gpu_samples", job_id), key=lambda r: r["gpu_index"])
    assert [(r["rank"], r["gpu_index"], r["util"]) for r in gpu] == [(1, 0, 75.0), (1, 1, 25.0)]
    assert [r["mem_used_bytes"] for r in gpu] == [40 * 2**30, 2**30]


def test_the_sdks_protobuf_exporter_stores_gauges_sums_histograms_and_gpu(
    server: RunningServer,
) -> None:
    exporter = OTLPMetricExporter(endpoint=f"{server.url}/v1/metrics", compression=Compression.Gzip)
    reader = PeriodicExportingMetricReader(exporter, export_interval_millis=3_600_000)
    resource = Resource.create({"stepscope.job_id": "otel-pb", "stepscope.rank": 1})
    provider = MeterProvider(resource=resource, metric_readers=[reader])
    _record(provider)
    provider.shutdown()  # one collection, exported once
    _assert_stored(server.db_url, "otel-pb")
    job = read_rows(server.db_url, "jobs", "otel-pb")
    assert [j["job_id"] for j in job] == ["otel-pb"]
    api = httpx.get(f"{server.url}/api/v1/jobs/otel-pb/metrics", params={"rank": 1}).json()
    by_name = {p["name"]: p for p in api}
    assert by_name["train.loss"]["attributes"] == {"phase": "train"}
    assert by_name["train.samples"]["value"] == 15.0
    histogram = by_name["train.step.duration"]
    assert (histogram["count"], histogram["min"], histogram["max"]) == (3, 0.1, 0.4)
    assert sum(histogram["bucket_counts"]) == 3
    assert len(histogram["bucket_counts"]) == len(histogram["bounds"]) + 1


def _sdk_request(job_id: str) -> ExportMetricsServiceRequest:
    """The SDK's own OTLP encoding of the same instruments."""
    reader = InMemoryMetricReader()
    resource = Resource.create({"job.id": job_id, "rank": "1"})
    provider = MeterProvider(resource=resource, metric_readers=[reader])
    _record(provider)
    data = reader.get_metrics_data()
    provider.shutdown()
    assert data is not None
    return encode_metrics(data)


def test_otlp_json_with_integer_enums_stores_the_same_values(server: RunningServer) -> None:
    request = _sdk_request("otel-json")
    body = json_format.MessageToJson(request, use_integers_for_enums=True).encode()
    assert b'"aggregationTemporality": 2' in body
    response = httpx.post(
        f"{server.url}/v1/metrics",
        content=gzip.compress(body),
        headers={"Content-Type": "application/json", "Content-Encoding": "gzip"},
    )
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("application/json")
    assert response.json() == {}  # nothing rejected: no partial_success
    _assert_stored(server.db_url, "otel-json")


def _kv(key: str, value: Any) -> KeyValue:
    if isinstance(value, str):
        return KeyValue(key=key, value=AnyValue(string_value=value))
    return KeyValue(key=key, value=AnyValue(int_value=value))


def _dcgm_request(host: str, ts_ns: int) -> ExportMetricsServiceRequest:
    """dcgm-exporter's gauges as an OpenTelemetry Collector's prometheus receiver relays them."""
    request = ExportMetricsServiceRequest()
    resource_metrics = request.resource_metrics.add()
    resource_metrics.resource.attributes.extend(
        [_kv("service.name", "dcgm"), _kv("service.instance.id", f"{host}:9400")]
    )
    scope = resource_metrics.scope_metrics.add()
    values = {
        "DCGM_FI_DEV_GPU_UTIL": (87, 34),
        "DCGM_FI_DEV_POWER_USAGE": (612.5, 301.25),
        "DCGM_FI_PROF_SM_ACTIVE": (0.5, 0.25),
        "DCGM_FI_DEV_FB_USED": (1024, 2048),
    }
    for name, per_gpu in values.items():
        metric = Metric(name=name)
        for gpu, value in enumerate(per_gpu):
            point = NumberDataPoint(time_unix_nano=ts_ns)
            if isinstance(value, int):
                point.as_int = value
            else:
                point.as_double = value
            point.attributes.extend(
                [
                    _kv("gpu", str(gpu)),
                    _kv("UUID", f"GPU-{gpu:08d}"),
                    _kv("device", f"nvidia{gpu}"),
                    _kv("modelName", "NVIDIA H100 80GB HBM3"),
                    _kv("Hostname", host),
                ]
            )
            metric.gauge.data_points.append(point)
        scope.metrics.append(metric)
    return request


def test_a_collectors_dcgm_relay_lands_in_the_gpu_table_by_host_and_gpu(
    server: RunningServer,
) -> None:
    job = generate(JobSpec(job_id="dcgm-job", num_ranks=2, num_steps=20, with_gpu=False))
    assert not stream_job(job, server.url).failures
    host = job.nodes[0]
    request = _dcgm_request(host, ts_ns=1_800_000_000 * 10**9)
    response = httpx.post(
        f"{server.url}/v1/metrics", content=request.SerializeToString(), headers=PROTOBUF
    )
    assert response.status_code == 200, response.text
    answer = ExportMetricsServiceResponse.FromString(response.content)
    assert not answer.HasField("partial_success")
    rows = sorted(read_rows(server.db_url, "gpu_samples", "dcgm-job"), key=lambda r: r["rank"])
    got = [
        (r["rank"], r["gpu_index"], r["util"], r["power_w"], r["sm_active"], r["mem_used_bytes"])
        for r in rows
    ]
    assert got == [
        (0, 0, 87.0, 612.5, 50.0, 1024 * 2**20),
        (1, 1, 34.0, 301.25, 25.0, 2048 * 2**20),
    ]
    assert all(r["ts"] == 1.8e9 for r in rows)
    ranks = {r["rank"]: r["node"] for r in read_rows(server.db_url, "ranks", "dcgm-job")}
    assert ranks == {0: host, 1: host}  # a relay names the rank, it does not rewrite it


def test_on_a_host_two_jobs_share_a_dcgm_gpu_point_goes_to_the_rank_with_its_uuid(
    server: RunningServer,
) -> None:
    for job_id, gpus in (
        ("shared-a", ["GPU-00000002", "GPU-00000003"]),
        # Rank 0 on host GPU 1 (CUDA_VISIBLE_DEVICES=1,0): the UUID, not the local rank, places.
        ("shared-b", ["GPU-00000001", "GPU-00000000"]),
    ):
        spec = JobSpec(
            job_id=job_id, num_ranks=2, num_steps=5, hosts=("shared-host",), with_gpu=False
        )
        job = generate(spec)
        job.gpus = gpus
        assert not stream_job(job, server.url).failures
    request = _dcgm_request("shared-host", ts_ns=1_800_000_000 * 10**9)
    response = httpx.post(
        f"{server.url}/v1/metrics", content=request.SerializeToString(), headers=PROTOBUF
    )
    assert response.status_code == 200, response.text
    assert not read_rows(server.db_url, "gpu_samples", "shared-a")
    rows = read_rows(server.db_url, "gpu_samples", "shared-b")
    got = sorted((r["rank"], r["gpu_index"], r["util"]) for r in rows)
    assert got == [(0, 1, 34.0), (1, 0, 87.0)]


def _stored_counts(db_url: str) -> tuple[int, int, int]:
    return (
        len(read_rows(db_url, "ingest_batches", None)),
        len(read_rows(db_url, "otlp_metrics", None)),
        len(read_rows(db_url, "gpu_samples", None)),
    )


def test_malformed_protobuf_is_a_400_and_nothing_is_stored(server: RunningServer) -> None:
    before = _stored_counts(server.db_url)
    good = _sdk_request("never").SerializeToString()
    response = httpx.post(
        f"{server.url}/v1/metrics", content=good[: len(good) // 2] + b"\xff\xff", headers=PROTOBUF
    )
    assert response.status_code == 400
    assert "protobuf" in response.json()["detail"]
    bad_json = httpx.post(
        f"{server.url}/v1/metrics",
        content=b'{"resourceMetrics": 3}',
        headers={"Content-Type": "application/json"},
    )
    assert bad_json.status_code == 400
    assert _stored_counts(server.db_url) == before


def test_other_content_types_are_a_415(server: RunningServer) -> None:
    response = httpx.post(
        f"{server.url}/v1/metrics", content=b"x", headers={"Content-Type": "text/plain"}
    )
    assert response.status_code == 415
    assert "application/x-protobuf" in response.json()["detail"]


def test_unplaceable_points_are_counted_and_reported(server: RunningServer) -> None:
    before = _stored_counts(server.db_url)
    request = _dcgm_request("no-such-host", ts_ns=1_800_000_001 * 10**9)
    response = httpx.post(
        f"{server.url}/v1/metrics", content=request.SerializeToString(), headers=PROTOBUF
    )
    assert response.status_code == 200
    answer = ExportMetricsServiceResponse.FromString(response.content)
    assert answer.partial_success.rejected_data_points == 8
    assert "8 point(s) could not be placed" in answer.partial_success.error_message
    assert _stored_counts(server.db_url) == before
    scrape = httpx.get(f"{server.url}/metrics").text
    assert 'stepscope_otlp_points_total{outcome="unplaced"} 8.0' in scrape


def test_a_resent_export_is_stored_once(server: RunningServer) -> None:
    body = _sdk_request("otel-resend").SerializeToString()
    for _ in range(2):
        response = httpx.post(f"{server.url}/v1/metrics", content=body, headers=PROTOBUF)
        assert response.status_code == 200
    assert len(read_rows(server.db_url, "otlp_metrics", "otel-resend")) == 3
    assert len(read_rows(server.db_url, "ingest_batches", "otel-resend")) == 1


def test_spec_json_with_hex_exemplar_ids_is_stored_and_a_timeless_point_is_rejected(
    server: RunningServer,
) -> None:
    def point(value: str, **extra: Any) -> dict[str, Any]:
        return {"asInt": value, "attributes": [], **extra}

    exemplar = {
        "timeUnixNano": "1800000000000000000",
        "asDouble": 1.5,
        "traceId": "5b8efff798038103d269b633813fc60c",
        "spanId": "eee19b7ec3c1b174",
    }
    doc = {
        "resourceMetrics": [
            {
                "resource": {
                    "attributes": [
                        {"key": "job.id", "value": {"stringValue": "otel-spec-json"}},
                        {"key": "rank", "value": {"intValue": "2"}},
                    ]
                },
                "scopeMetrics": [
                    {
                        "metrics": [
                            {
                                "name": "queue.depth",
                                "unit": "{item}",
                                "gauge": {
                                    "dataPoints": [
                                        point(
                                            "7",
                                            timeUnixNano="1800000000000000000",
                                            exemplars=[exemplar],
                                        ),
                                        point("9"),  # no time: rejected, counted
                                    ]
                                },
                            }
                        ]
                    }
                ],
            }
        ]
    }
    response = httpx.post(
        f"{server.url}/v1/metrics",
        content=orjson.dumps(doc),
        headers={"Content-Type": "application/json"},
    )
    assert response.status_code == 200, response.text
    partial = response.json()["partialSuccess"]
    assert partial["rejectedDataPoints"] == "1"  # int64 as a string, as OTLP JSON writes it
    assert "without a time" in partial["errorMessage"]
    [row] = read_rows(server.db_url, "otlp_metrics", "otel-spec-json")
    assert (row["rank"], row["name"], row["value"], row["ts"]) == (2, "queue.depth", 7.0, 1.8e9)
