"""`POST /v1/metrics`: the OTLP/HTTP metrics receiver (protobuf or JSON, gzip), spec-conformant.

Points are placed in a job and rank by their attributes (stepscope.otlp_points); GPU
telemetry goes to gpu_samples, the rest to otlp_metrics. Points that cannot be placed or
stored are counted and reported in `partial_success`, never dropped silently.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import threading
import time
from dataclasses import dataclass
from typing import Any

import orjson
import sqlalchemy as sa
from fastapi import HTTPException, Request
from google.protobuf import json_format
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response
from starlette.routing import Route

from stepscope.collector import otlp_points
from stepscope.collector.ingest import read_body_limited
from stepscope.collector.otlp_points import Point, RankOnNode
from stepscope.collector.validate import BatchError, inflate
from stepscope.store import jobs
from stepscope.store.writer import BatchWriter, WriteResult

PROTOBUF = "application/x-protobuf"
JSON = "application/json"
INCARNATION = "otlp"
"""The incarnation of relayed batches in ingest_batches (a rank's own batches carry a UUID)."""


def decode_request(body: bytes, content_type: str) -> ExportMetricsServiceRequest:
    """The request message of an OTLP/HTTP body; BatchError 400 when it does not decode."""
    request = ExportMetricsServiceRequest()
    try:
        if content_type == PROTOBUF:
            request.ParseFromString(body)
        else:
            doc = orjson.loads(body)
            _drop_exemplars(doc)
            json_format.ParseDict(doc, request, ignore_unknown_fields=True)
    except (
        DecodeError,
        json_format.ParseError,
        orjson.JSONDecodeError,
        UnicodeDecodeError,
        ValueError,
        TypeError,
        AttributeError,
    ) as exc:
        kind = "protobuf" if content_type == PROTOBUF else "OTLP JSON"
        raise BatchError(
            f"body is not a valid {kind} ExportMetricsServiceRequest: {exc}", status=400
        ) from exc
    return request


def _drop_exemplars(doc: Any) -> None:
    """Remove data points' exemplars, which are not stored: OTLP JSON writes their trace and
    span ids in hex, where protobuf's JSON mapping expects base64."""
    if not isinstance(doc, dict):
        return
    for resource in doc.get("resourceMetrics") or []:
        for scope in (resource or {}).get("scopeMetrics") or []:
            for metric in (scope or {}).get("metrics") or []:
                for kind in _DATA_KINDS:
                    data = (metric or {}).get(kind)
                    for point in (data or {}).get("dataPoints") or []:
                        if isinstance(point, dict):
                            point.pop("exemplars", None)


_DATA_KINDS = ("gauge", "sum", "histogram", "exponentialHistogram", "summary")


@dataclass(slots=True)
class Sorted:
    """A request's points by where they go."""

    batches: list[dict[str, object]]
    num_gpu: int
    num_metrics: int
    num_unplaced: int
    num_rejected: int
    message: str


class RankDirectory:
    """The names live ranks reported (node, pod, host) → those ranks; re-read every `ttl_s`."""

    def __init__(self, engine: sa.Engine, *, seen_within_s: float, ttl_s: float = 5.0) -> None:
        self._engine = engine
        self._seen_within_s = seen_within_s
        self._ttl_s = ttl_s
        self._read_at = -math.inf
        self._read_wall = -math.inf
        self._by_name: dict[str, list[RankOnNode]] = {}
        self._lock = threading.Lock()

    def _names(self, *, missed: bool = False) -> dict[str, list[RankOnNode]]:
        with self._lock:
            stale = time.monotonic() - self._read_at > self._ttl_s
            if not stale and missed:  # a name not known yet: has a rank appeared since?
                newest = jobs.newest_rank_seen(self._engine)
                # (less a second: a rank is stamped before its transaction commits)
                stale = newest is not None and newest >= self._read_wall - 1.0
            if stale:
                self._read_wall = time.time()
                by_name: dict[str, list[RankOnNode]] = {}
                for row in jobs.live_rank_names(self._engine, seen_within_s=self._seen_within_s):
                    attributes = row["attributes"]
                    uuid = attributes.get("gpu.uuid")
                    rank = RankOnNode(
                        row["job_id"],
                        row["rank"],
                        row["local_rank"],
                        uuid if isinstance(uuid, str) else None,
                    )
                    names = {row["node"]} | {attributes.get(k) for k in otlp_points.RANK_NAME_KEYS}
                    for name in names - {None, ""}:
                        by_name.setdefault(str(name), []).append(rank)
                self._by_name, self._read_at = by_name, time.monotonic()
            return self._by_name

    def lookup(self, hosts: set[str], job_id: str | None) -> dict[str, list[RankOnNode]]:
        """Each of `hosts` → the live ranks (of `job_id`, if given) that reported it."""
        by_name = self._names()
        if not hosts <= by_name.keys():
            by_name = self._names(missed=True)
        found = {
            host: [r for r in by_name.get(host, []) if job_id is None or r.job_id == job_id]
            for host in hosts
        }
        return {host: ranks for host, ranks in found.items() if ranks}


def sort_points(
    message: ExportMetricsServiceRequest, body: bytes, lookup: otlp_points.NodeLookup
) -> Sorted:
    """Flatten, place and turn the points into one relayed batch per (job, rank)."""
    flat = otlp_points.flatten(message)
    finite = [p for p in flat.points if otlp_points.is_finite(p)]
    num_nonfinite = len(flat.points) - len(finite)
    placed, unplaced = otlp_points.place(finite, lookup)
    digest = hashlib.sha256(body).digest()
    batches: list[dict[str, object]] = []
    num_gpu = num_metrics = num_repeated = 0
    for (job_id, rank), points in placed.items():
        gpu: list[Point] = [p for p in points if otlp_points.gpu_column(p) is not None]
        other = [p for p in points if otlp_points.gpu_column(p) is None]
        metrics = otlp_points.metric_rows(job_id, rank, other) if other else None
        num_gpu += len(gpu)
        num_stored = len(metrics["ts"]) if metrics else 0
        num_metrics += num_stored
        num_repeated += len(other) - num_stored
        key = hashlib.sha256(digest + f"{job_id}\0{rank}".encode()).digest()
        host = otlp_points.first(points[0].attributes, otlp_points.HOST_KEYS)
        batches.append(
            {
                "job": {"job_id": job_id},
                "source": {
                    "rank": rank,
                    "incarnation": INCARNATION,
                    "node": str(host) if host is not None else None,
                },
                # A resent body is the same batch: stored once (the idempotency key).
                "seq": int.from_bytes(key[:8], "big") >> 1,
                "sections": {"gpu": otlp_points.gpu_rows(job_id, rank, gpu)} if gpu else {},
                "metrics": metrics,
            }
        )
    problems = []
    if unplaced:
        problems.append(
            f"{len(unplaced)} point(s) could not be placed in a job and rank: give them "
            "stepscope.job_id (or job.id) and stepscope.rank (or rank) attributes, or a "
            "host.name / k8s.pod.name of a host whose ranks reported"
        )
    if flat.num_unsupported:
        problems.append(
            f"{flat.num_unsupported} point(s) of exponential histograms or summaries are not stored"
        )
    if num_nonfinite:
        problems.append(f"{num_nonfinite} point(s) without a time or with a NaN or infinite value")
    if num_repeated:
        problems.append(
            f"{num_repeated} point(s) repeated a series (metric and attributes) at one time: "
            "the last of each is stored"
        )
    return Sorted(
        batches=batches,
        num_gpu=num_gpu,
        num_metrics=num_metrics,
        num_unplaced=len(unplaced),
        num_rejected=len(unplaced) + flat.num_unsupported + num_nonfinite + num_repeated,
        message="; ".join(problems),
    )


def encode_response(response: ExportMetricsServiceResponse, content_type: str) -> bytes:
    if content_type == PROTOBUF:
        return response.SerializeToString()
    return json_format.MessageToJson(response, indent=None).encode()


async def receive_metrics(request: Request) -> Response:
    """Store an OTLP export's points; reject none silently."""
    request.app.state.authorize(request, "ingest")
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type not in (PROTOBUF, JSON):
        raise HTTPException(415, f"Content-Type must be {PROTOBUF} or {JSON}, got {content_type!r}")
    settings = request.app.state.settings
    body = await read_body_limited(request, settings.max_body_bytes)
    try:
        raw = inflate(
            body,
            content_encoding=request.headers.get("content-encoding"),
            max_bytes=settings.max_body_bytes,
        )
        message = await run_in_threadpool(decode_request, raw, content_type)
    except BatchError as exc:
        raise HTTPException(exc.status, str(exc)) from exc
    directory: RankDirectory = request.app.state.otlp_ranks
    sorted_points = await run_in_threadpool(sort_points, message, raw, directory.lookup)
    writer: BatchWriter = request.app.state.writer
    written = writer.submit([{**batch, "attach": True} for batch in sorted_points.batches])
    results: list[WriteResult] = await asyncio.wrap_future(written)
    metrics = request.app.state.metrics
    for batch, result in zip(sorted_points.batches, results, strict=True):
        points = batch["metrics"]
        num_points = len(points["job_id"]) if isinstance(points, dict) else 0
        rows = {**result.accepted, "otlp_metrics": num_points}
        metrics.batch_stored("/v1/metrics", rows, duplicate=result.duplicate)
    metrics.otlp_received(
        {
            "gpu": sorted_points.num_gpu,
            "metrics": sorted_points.num_metrics,
            "unplaced": sorted_points.num_unplaced,
            "rejected": sorted_points.num_rejected - sorted_points.num_unplaced,
        }
    )
    response = ExportMetricsServiceResponse()
    if sorted_points.num_rejected:
        response.partial_success.rejected_data_points = sorted_points.num_rejected
        response.partial_success.error_message = sorted_points.message
    return Response(encode_response(response, content_type), media_type=content_type)


route = Route("/v1/metrics", receive_metrics, methods=["POST"], include_in_schema=False)
