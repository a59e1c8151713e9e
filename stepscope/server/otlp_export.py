"""OTLP out from the server: findings and each live job's summary as OpenTelemetry log records.

With STEPSCOPE_OTLP_EXPORT_ENDPOINT set, a finding that an analysis pass (or the hang
monitor) reports for the first time is exported as a `stepscope.finding.opened` event, one
that a later pass no longer reports (or a hang that ended) as `stepscope.finding.closed`,
and every `interval_s` each live job's summary as a `stepscope.job.summary` event, through
the OpenTelemetry SDK's logs API and its OTLP/HTTP exporter. Records are queued and sent by
the SDK's batch processor thread: an unreachable endpoint costs dropped records and a
logged error, never an ingest request or an analysis pass. What was exported is remembered
in memory, so after a restart the open findings are exported as opened once more.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import sqlalchemy as sa
from opentelemetry._logs import SeverityNumber
from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter
from opentelemetry.sdk._logs import LoggerProvider
from opentelemetry.sdk._logs.export import BatchLogRecordProcessor
from opentelemetry.sdk.resources import Resource

from stepscope import __version__
from stepscope.schema import Finding
from stepscope.server.webhooks import finding_key
from stepscope.store import jobs
from stepscope.store.availability import OUTAGES
from stepscope.text.findings import finding_line

log = logging.getLogger(__name__)

LOGS_PATH = "/v1/logs"
_SEVERITY_NUMBERS = {
    "info": SeverityNumber.INFO,
    "warning": SeverityNumber.WARN,
    "critical": SeverityNumber.ERROR,
}
_LINE_WIDTH = 1000
"""Wide enough for the fullest wording of a finding's sentence."""


def logs_url(endpoint: str) -> str:
    """The OTLP/HTTP logs URL of a base endpoint (as OTEL_EXPORTER_OTLP_ENDPOINT is)."""
    return endpoint if endpoint.endswith(LOGS_PATH) else endpoint.rstrip("/") + LOGS_PATH


def severity_number(severity: str) -> SeverityNumber:
    """OpenTelemetry's severity for a finding's info/warning/critical."""
    return _SEVERITY_NUMBERS.get(severity, SeverityNumber.UNSPECIFIED)


def _valued(attributes: Mapping[str, Any]) -> dict[str, Any]:
    """The attributes that have a value (OTLP has no null; NaN says nothing)."""
    return {
        k: v
        for k, v in attributes.items()
        if v is not None and not (isinstance(v, float) and not math.isfinite(v))
    }


def finding_attributes(finding: Finding, state: str) -> dict[str, Any]:
    """A finding's log-record attributes; `state` is opened or closed."""
    return _valued(
        {
            "stepscope.job_id": finding.job_id,
            "stepscope.finding.state": state,
            "stepscope.finding.kind": finding.kind,
            "stepscope.finding.severity": finding.severity,
            "stepscope.finding.ranks": [int(r) for r in finding.ranks or ()],
            "stepscope.finding.node": finding.node,
            "stepscope.finding.cause": finding.cause,
            "stepscope.finding.effect": finding.effect,
            "stepscope.finding.metric": finding.metric,
            "stepscope.finding.first_step": finding.first_step,
            "stepscope.finding.last_step": finding.last_step,
            "stepscope.finding.text": finding_sentence(finding),
        }
    )


def finding_sentence(finding: Finding) -> str:
    """The finding's one-line sentence (stepscope.text), in its fullest wording."""
    return finding_line(finding, width=_LINE_WIDTH).strip()


def summary_attributes(row: Mapping[str, Any]) -> dict[str, Any]:
    """A live job's summary figures (a `jobs.live_job_figures` row) as attributes."""
    return _valued(
        {
            "stepscope.job_id": row["job_id"],
            "stepscope.job.step_time_p50_s": row.get("step_p50_s"),
            "stepscope.job.tokens_per_s": row.get("tokens_per_s"),
            "stepscope.job.mfu": row.get("mfu"),
            "stepscope.job.goodput": row.get("goodput"),
            "stepscope.job.findings.info": row.get("num_info"),
            "stepscope.job.findings.warning": row.get("num_warning"),
            "stepscope.job.findings.critical": row.get("num_critical"),
            "stepscope.job.hang": bool(row.get("hang")),
        }
    )


class OtlpEventExporter:
    """Exports findings as they open and close, and live jobs' summaries on a timer."""

    def __init__(
        self,
        engine: sa.Engine,
        endpoint: str,
        *,
        interval_s: float = 30.0,
        seen_within_s: float = 600.0,
        timeout_s: float = 10.0,
    ) -> None:
        self._engine = engine
        self._interval_s = interval_s
        self._seen_within_s = seen_within_s
        resource = Resource.create(
            {"service.name": "stepscope-server", "service.version": __version__}
        )
        self._provider = LoggerProvider(resource=resource)
        self._provider.add_log_record_processor(
            BatchLogRecordProcessor(
                OTLPLogExporter(endpoint=logs_url(endpoint), timeout=timeout_s),
                schedule_delay_millis=1000,
                export_timeout_millis=timeout_s * 1000,
            )
        )
        self._logger = self._provider.get_logger("stepscope.server", __version__)
        self._open: dict[str, dict[str, Finding]] = {}
        """Per job, the findings exported as opened and not closed since, by finding_key."""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def pass_findings(self, job_id: str, findings: Sequence[Finding]) -> None:
        """A pass's whole set of a job's findings (the FindingsHook): new ones open, those no
        longer reported close. Never raises."""
        self._reported(job_id, findings, complete=True)

    def offered(self, job_id: str, findings: Sequence[Finding]) -> None:
        """Some of a job's findings (the hang monitor's hook): new ones open, ended hangs
        close. Never raises."""
        self._reported(job_id, findings, complete=False)

    def _reported(self, job_id: str, findings: Sequence[Finding], *, complete: bool) -> None:
        try:
            with self._lock:
                open_ = self._open.setdefault(job_id, {})
                closed: list[Finding] = []
                current = {}
                for finding in findings:
                    key = finding_key(finding)
                    if finding.evidence.get("closed_at") is not None:
                        if open_.pop(key, None) is not None:
                            closed.append(finding)
                        continue
                    current[key] = finding
                opened = [f for key, f in current.items() if key not in open_]
                if complete:
                    closed += [f for key, f in open_.items() if key not in current]
                    self._open[job_id] = current
                else:
                    open_.update(current)
            for finding in opened:
                self._emit_finding(finding, "opened")
            for finding in closed:
                self._emit_finding(finding, "closed")
        except Exception:  # exporting must never break a pass or an ingest request
            log.exception("OTLP export of the findings of job %s failed", job_id)

    def _emit_finding(self, finding: Finding, state: str) -> None:
        self._logger.emit(
            timestamp=time.time_ns(),
            severity_number=severity_number(finding.severity),
            severity_text=finding.severity,
            body=finding_sentence(finding),
            attributes=finding_attributes(finding, state),
            event_name=f"stepscope.finding.{state}",
        )

    def export_summaries(self) -> int:
        """One summary record per live job that has been analysed; how many."""
        rows = jobs.live_job_figures(self._engine, seen_within_s=self._seen_within_s)
        exported = 0
        for row in rows:
            if row.get("step_p50_s") is None:  # not analysed yet: nothing to summarise
                continue
            self._logger.emit(
                timestamp=time.time_ns(),
                severity_number=SeverityNumber.INFO,
                severity_text="info",
                body=f"job {row['job_id']}: live summary",
                attributes=summary_attributes(row),
                event_name="stepscope.job.summary",
            )
            exported += 1
        return exported

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="stepscope-otlp-export", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the timer and send what is queued (bounded by the exporter's timeout)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        try:
            self._provider.shutdown()
        except Exception:
            log.exception("shutting down the OTLP log export failed")

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self.export_summaries()
            except Exception as exc:  # a database hiccup must not end the export
                OUTAGES.failed(exc, log, "OTLP export of the live summaries failed")
