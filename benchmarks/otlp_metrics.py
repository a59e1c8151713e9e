"""OTLP ingest of GPU gauges against native ingest of the same samples; /metrics scrape time.

1. GPU telemetry of --ranks ranks × --samples sample times (six values a sample: util, power,
   temperature, SM clock, memory used, SM activity) goes to a real `stepscope serve` twice,
   each time into a fresh SQLite database: as native /v1/ingest batches (gzip JSON, a gpu
   section), and as OTLP/HTTP exports (gzip protobuf, dcgm-exporter's gauge names, one
   export per rank per batch of sample times). Values stored per second through HTTP,
   OTLP against native. Goal: OTLP >= 0.5 x native.
2. /metrics of a server with --jobs live jobs (each with a summary): the median and p95 of
   --scrapes sequential scrapes. Goal: <= 100 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import orjson
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.metrics.v1.metrics_pb2 import Metric, NumberDataPoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stepscope import schema  # noqa: E402
from stepscope.store import tables  # noqa: E402
from stepscope.store.engine import make_engine  # noqa: E402
from stepscope.store.migrate import upgrade  # noqa: E402
from stepscope.store.writer import BatchWriter, insert_ignoring_duplicates  # noqa: E402
from tests.live_server import run_server  # noqa: E402

COLUMNS = {  # gpu column → (dcgm-exporter name, factor from the DCGM unit)
    "util": ("DCGM_FI_DEV_GPU_UTIL", 1.0),
    "power_w": ("DCGM_FI_DEV_POWER_USAGE", 1.0),
    "temp_c": ("DCGM_FI_DEV_GPU_TEMP", 1.0),
    "sm_clock_mhz": ("DCGM_FI_DEV_SM_CLOCK", 1.0),
    "mem_used_bytes": ("DCGM_FI_DEV_FB_USED", 2**20),
    "sm_active": ("DCGM_FI_PROF_SM_ACTIVE", 0.01),
}


def _samples(rank: int, times: list[float]) -> dict[str, list[Any]]:
    n = len(times)
    return {
        "ts": times,
        "gpu_index": [rank % 8] * n,
        "util": [float(50 + (rank + i) % 50) for i in range(n)],
        "power_w": [300.0 + i % 7 for i in range(n)],
        "temp_c": [60.0 + i % 5 for i in range(n)],
        "sm_clock_mhz": [1980.0] * n,
        "mem_used_bytes": [(40_000 + i) * 2**20 for i in range(n)],
        "sm_active": [float(40 + i % 20) for i in range(n)],
    }


def native_bodies(job_id: str, ranks: int, times: list[list[float]]) -> list[bytes]:
    bodies = []
    for rank in range(ranks):
        incarnation = uuid.uuid4().hex
        for seq, chunk in enumerate(times):
            doc = {
                "schema": schema.WIRE_SCHEMA_VERSION,
                "job": {"job_id": job_id},
                "source": {"rank": rank, "local_rank": rank % 8, "incarnation": incarnation},
                "seq": seq,
                "gpu": _samples(rank, chunk),
            }
            bodies.append(gzip.compress(orjson.dumps(doc), compresslevel=1))
    return bodies


def _kv(key: str, value: Any) -> KeyValue:
    if isinstance(value, int):
        return KeyValue(key=key, value=AnyValue(int_value=value))
    return KeyValue(key=key, value=AnyValue(string_value=value))


def otlp_bodies(job_id: str, ranks: int, times: list[list[float]]) -> list[bytes]:
    bodies = []
    for rank in range(ranks):
        for chunk in times:
            samples = _samples(rank, chunk)
            request = ExportMetricsServiceRequest()
            resource = request.resource_metrics.add()
            resource.resource.attributes.extend(
                [_kv("stepscope.job_id", job_id), _kv("stepscope.rank", rank)]
            )
            scope = resource.scope_metrics.add()
            for column, (name, factor) in COLUMNS.items():
                metric = Metric(name=name)
                for ts, value in zip(chunk, samples[column], strict=True):
                    point = NumberDataPoint(time_unix_nano=int(ts * 1e9), as_double=value / factor)
                    point.attributes.append(_kv("gpu", str(rank % 8)))
                    metric.gauge.data_points.append(point)
                scope.metrics.append(metric)
            bodies.append(gzip.compress(request.SerializeToString(), compresslevel=1))
    return bodies


async def post_all(url: str, path: str, content_type: str, bodies: list[bytes]) -> float:
    """Seconds to POST every body, `concurrency` at a time; raises on a non-200."""
    headers = {"Content-Type": content_type, "Content-Encoding": "gzip"}
    gate = asyncio.Semaphore(8)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=120) as client:

        async def send(body: bytes) -> None:
            async with gate:
                response = await client.post(path, content=body)
                if response.status_code != 200:
                    raise RuntimeError(f"{path}: HTTP {response.status_code} {response.text}")
                if path == "/v1/metrics" and response.content not in (b"{}", b""):
                    raise RuntimeError(f"{path}: partial success {response.text}")

        start = time.perf_counter()
        await asyncio.gather(*(send(b) for b in bodies))
        return time.perf_counter() - start


def bench_ingest(args: argparse.Namespace) -> None:
    start_ts = time.time() - args.samples
    all_times = [start_ts + i for i in range(args.samples)]
    times = [all_times[i : i + args.batch] for i in range(0, args.samples, args.batch)]
    values = args.ranks * args.samples * len(COLUMNS)
    rates = {}
    for arm, path, content_type, build in (
        ("native /v1/ingest", "/v1/ingest", "application/json", native_bodies),
        ("OTLP /v1/metrics", "/v1/metrics", "application/x-protobuf", otlp_bodies),
    ):
        bodies = build("bench", args.ranks, times)
        with run_server() as server:
            elapsed_s = asyncio.run(post_all(server.url, path, content_type, bodies))
            engine = make_engine(server.db_url)
            with engine.connect() as conn:
                stored = conn.execute(
                    tables.gpu_samples.select().with_only_columns(tables.gpu_samples.c.ts)
                ).all()
            engine.dispose()
        if len(stored) != args.ranks * args.samples:
            raise RuntimeError(f"{arm}: {len(stored)} samples stored")
        rates[arm] = values / elapsed_s
        print(
            f"{arm:>18}: {len(bodies)} requests, {values:,} values in {elapsed_s:.2f} s "
            f"= {rates[arm]:,.0f} values/s"
        )
    ratio = rates["OTLP /v1/metrics"] / rates["native /v1/ingest"]
    print(f"OTLP / native = {ratio:.2f}  (goal >= 0.50: {'met' if ratio >= 0.5 else 'NOT met'})")


def bench_scrape(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="stepscope-bench-") as tmp:
        db_url = f"sqlite:///{Path(tmp) / 'stepscope.db'}"
        engine = make_engine(db_url)
        upgrade(engine)
        writer = BatchWriter(engine)
        now = time.time()
        writer.submit(
            [
                {
                    "job": {"job_id": f"job-{j:04d}"},
                    "source": {"rank": 0, "incarnation": "bench", "node": f"node-{j:04d}"},
                    "seq": 0,
                    "sections": {},
                }
                for j in range(args.jobs)
            ]
        ).result()
        writer.close()
        summaries: dict[str, list[Any]] = {
            "job_id": [f"job-{j:04d}" for j in range(args.jobs)],
            "num_steps": [1000] * args.jobs,
            "step_p50_s": [0.5 + j * 1e-4 for j in range(args.jobs)],
            "tokens_per_s": [1e5] * args.jobs,
            "mfu": [0.4] * args.jobs,
            "num_info": [1] * args.jobs,
            "num_warning": [0] * args.jobs,
            "num_critical": [0] * args.jobs,
            "updated_at": [now] * args.jobs,
        }
        with engine.begin() as conn:
            insert_ignoring_duplicates(conn, tables.job_summaries, summaries)
        engine.dispose()
        with run_server(db_url) as server, httpx.Client(base_url=server.url) as client:
            body = client.get("/metrics").text  # warm
            num_series = body.count("stepscope_job_step_p50_seconds{")
            if num_series != args.jobs:
                raise RuntimeError(f"{num_series} job series, expected {args.jobs}")
            times_ms = []
            for _ in range(args.scrapes):
                start = time.perf_counter()
                response = client.get("/metrics")
                times_ms.append((time.perf_counter() - start) * 1e3)
                response.raise_for_status()
        p50 = statistics.median(times_ms)
        p95 = statistics.quantiles(times_ms, n=20)[-1]
        print(
            f"/metrics with {args.jobs} live jobs: {len(body) / 1024:.0f} KiB, "
            f"median {p50:.1f} ms, p95 {p95:.1f} ms over {args.scrapes} scrapes "
            f"(goal <= 100 ms: {'met' if p50 <= 100 else 'NOT met'})"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=32)
    parser.add_argument("--samples", type=int, default=120, help="sample times per rank")
    parser.add_argument("--batch", type=int, default=10, help="sample times per request")
    parser.add_argument("--jobs", type=int, default=1000)
    parser.add_argument("--scrapes", type=int, default=30)
    args = parser.parse_args()
    bench_ingest(args)
    bench_scrape(args)


if __name__ == "__main__":
    main()
