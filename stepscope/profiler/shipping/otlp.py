"""The profiler's optional OTLP export: per-step metrics through the OpenTelemetry SDK.

Off unless `otlp_endpoint` is set, and needs `pip install 'stepscope[otel]'`. Rows reach it
from the shipper thread, never from the training loop; an error turns it off, once, quietly.
GPU telemetry uses the OTel `hw.gpu.*` semantic conventions; training metrics, for which
no convention exists, the `stepscope.` namespace.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

log = logging.getLogger(__name__)

STEP_BOUNDS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
"""Histogram buckets of the step time, in seconds (the SDK's defaults are for ms latencies)."""


class OtlpMetrics:
    """Meters the steps and GPU samples the shipper sends, and exports them over OTLP/HTTP."""

    def __init__(
        self,
        *,
        endpoint: str,
        resource: dict[str, Any],
        export_interval_s: float,
        headers: dict[str, str] | None = None,
        peak_flops: float | None = None,
    ) -> None:
        from opentelemetry.exporter.otlp.proto.http import Compression
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
        from opentelemetry.sdk.resources import Resource

        exporter = OTLPMetricExporter(
            endpoint=endpoint, headers=headers, compression=Compression.Gzip
        )
        reader = PeriodicExportingMetricReader(
            exporter, export_interval_millis=export_interval_s * 1000
        )
        self._provider = MeterProvider(resource=Resource.create(resource), metric_readers=[reader])
        self.peak_flops = peak_flops
        meter = self._provider.get_meter("stepscope.profiler")
        self._step = meter.create_histogram(
            "stepscope.step.duration",
            unit="s",
            description="Wall time of a training step on this rank",
            explicit_bucket_boundaries_advisory=STEP_BOUNDS_S,
        )
        self._steps = meter.create_counter("stepscope.steps", unit="{step}")
        self._tokens = meter.create_counter("stepscope.tokens", unit="{token}")
        self._tokens_per_s = meter.create_gauge(
            "stepscope.throughput.tokens_per_s", unit="{token}/s"
        )
        self._data_share = meter.create_gauge("stepscope.step.data_share", unit="1")
        self._comm_wait_share = meter.create_gauge("stepscope.step.comm_wait_share", unit="1")
        self._mfu = meter.create_gauge("stepscope.mfu", unit="1")
        self._gpu_util = meter.create_gauge("hw.gpu.utilization", unit="1")
        self._gpu_memory = meter.create_gauge("hw.gpu.memory.usage", unit="By")
        self._gpu_memory_limit = meter.create_gauge("hw.gpu.memory.limit", unit="By")
        self._gpu_power = meter.create_gauge("hw.power", unit="W")
        self._gpu_temperature = meter.create_gauge("hw.temperature", unit="Cel")
        self._broken = False

    def record(self, kind: str, rows: Sequence[dict[str, Any]]) -> None:
        """Meter a batch's rows (the shipper's tee); never raises."""
        if self._broken or not rows:
            return
        try:
            if kind == "steps":
                self._record_steps(rows)
            elif kind == "gpu":
                self._record_gpu(rows)
        except Exception:
            self._broken = True
            log.warning("stepscope: OTLP export failed and is now off", exc_info=True)

    def _record_steps(self, rows: Sequence[dict[str, Any]]) -> None:
        step_s = [r["step_s"] for r in rows if r.get("step_s") is not None]
        for value in step_s:
            self._step.record(value)
        self._steps.add(len(step_s))
        total_s = sum(step_s)
        if total_s <= 0:
            return
        tokens = [r["tokens"] for r in rows if r.get("tokens") is not None]
        if tokens:
            self._tokens.add(sum(tokens))
            self._tokens_per_s.set(sum(tokens) / total_s)
        for column, gauge in (("data_s", self._data_share), ("comm_wait_s", self._comm_wait_share)):
            parts = [r[column] for r in rows if r.get(column) is not None]
            if parts:
                gauge.set(sum(parts) / total_s)
        flops = [r["flops"] for r in rows if r.get("flops") is not None]
        if flops and self.peak_flops:
            self._mfu.set(sum(flops) / total_s / self.peak_flops)

    def _record_gpu(self, rows: Sequence[dict[str, Any]]) -> None:
        for row in rows:
            attrs = {"gpu_index": row.get("gpu_index", 0), "hw.type": "gpu"}
            for column, gauge, factor in (
                ("util", self._gpu_util, 0.01),
                ("mem_used_bytes", self._gpu_memory, 1),
                ("mem_total_bytes", self._gpu_memory_limit, 1),
                ("power_w", self._gpu_power, 1),
                ("temp_c", self._gpu_temperature, 1),
            ):
                if row.get(column) is not None:
                    gauge.set(row[column] * factor, attrs)

    def close(self, timeout_s: float = 10.0) -> None:
        """Export what is metered and stop the exporter thread."""
        try:  # shutdown collects and exports once more, then stops
            self._provider.shutdown(timeout_millis=int(max(timeout_s, 0.5) * 1000))
        except Exception:
            log.warning("stepscope: OTLP export could not be flushed", exc_info=True)


def build_otlp_metrics(
    *,
    endpoint: str,
    job: dict[str, Any],
    source: dict[str, Any],
    export_interval_s: float,
    token: str | None,
) -> OtlpMetrics | None:
    """The exporter, or None (said once) when the OpenTelemetry SDK is not installed."""
    try:
        import opentelemetry.exporter.otlp.proto.http  # noqa: F401
        import opentelemetry.sdk.metrics  # noqa: F401
    except ImportError:
        log.warning(
            "stepscope: otlp_endpoint is set but the OpenTelemetry SDK is not installed "
            "(pip install 'stepscope[otel]'); OTLP export is off"
        )
        return None
    resource = {
        "service.name": "stepscope-profiler",
        "stepscope.job_id": job["job_id"],
        "stepscope.rank": source["rank"],
        "host.name": source.get("node") or "",
    }
    return OtlpMetrics(
        endpoint=endpoint,
        resource=resource,
        export_interval_s=export_interval_s,
        headers={"Authorization": f"Bearer {token}"} if token else None,
        peak_flops=job.get("peak_flops"),
    )
