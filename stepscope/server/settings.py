"""Server configuration: one pydantic-settings class, env prefix STEPSCOPE_."""

from __future__ import annotations

import ipaddress
import json
import socket
from typing import Annotated, Any

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from stepscope.store.engine import DEFAULT_DATABASE_URL, SQLITE_BUSY_TIMEOUT_S

KEEP_ALIVE_S = 45
"""How long the server keeps an idle HTTP connection open: longer than the profilers' longest
flush interval (30 s), so that every rank's shipper and watchdog post on one connection each
instead of opening one per request (uvicorn's default is 5 s)."""


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="STEPSCOPE_", extra="ignore")

    database_url: str = DEFAULT_DATABASE_URL
    """SQLAlchemy URL; SQLite (embedded default) or postgresql://..."""
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    auth: bool = False
    """Require bearer tokens (scopes ingest/read/admin) on every API call."""
    allow_unauthenticated: bool = False
    """Permit binding a non-loopback address with auth off."""
    max_body_bytes: int = Field(default=32 * 1024 * 1024, gt=0)
    """Largest ingest body accepted, before and after gzip decompression."""
    analyze_interval_s: float = Field(default=30.0, ge=0)
    """How often active jobs are re-analysed; 0 disables the background analyzer."""
    active_within_s: float = Field(default=600.0, gt=0)
    """A job is active while some rank sent a batch within this many seconds."""
    rollup_grace_s: float = Field(default=30.0, ge=0)
    """A step is rolled up once every rank reported it, or when it ended this long ago."""
    webhook_urls: Annotated[list[str], NoDecode] = Field(default_factory=list)
    """Where new warning/critical findings are POSTed (Slack-compatible JSON); comma-separated."""
    webhook_secret: SecretStr | None = None
    """Signs each webhook body: header X-Stepscope-Signature-256: sha256=<HMAC-SHA256 hex>."""
    webhook_timeout_s: float = Field(default=10.0, gt=0)
    """How long one webhook POST may take."""
    webhook_max_attempts: int = Field(default=8, ge=1)
    """Attempts per finding and URL before giving up (backoff doubles from 2 s to 10 min)."""
    hang_silent_after_s: float = Field(default=6.0, gt=0)
    """A rank is silent when its latest hang report or heartbeat is this old while others
    report a hang (3 x the profiler's heartbeat_s)."""
    hang_debounce_s: float = Field(default=0.2, ge=0)
    """At most one hang attribution per job per this many seconds while reports arrive."""
    sqlite_busy_timeout_s: float = Field(default=SQLITE_BUSY_TIMEOUT_S, gt=0)
    """How long a write waits for a SQLite lock held by another process before it answers 503."""
    retry_after_s: int = Field(default=5, ge=1, le=3600)
    """Retry-After of the 503 answered while the database is unavailable, in seconds."""
    otlp_export_endpoint: str | None = None
    """OTLP/HTTP endpoint (base URL; /v1/logs is appended) to which findings as they open and
    close and each live job's summary are exported as log records; unset: no export."""
    otlp_export_interval_s: float = Field(default=30.0, gt=0)
    """How often each live job's summary is exported."""
    otlp_export_timeout_s: float = Field(default=10.0, gt=0)
    """How long one OTLP export request may take."""
    capture_auto: bool = True
    """Ask a live job's straggler or hung rank (and a reference rank) for a deep capture when
    the analysis finds it (#21); off: only on request (API, dashboard, CLI)."""
    capture_steps: int = Field(default=5, ge=1, le=100)
    """Steps a deep capture records when the request does not say."""
    capture_request_max_steps: int = Field(default=50, ge=1)
    """Most steps a request may ask for."""
    capture_max_auto_per_job: int = Field(default=2, ge=0)
    """Captures the analysis asks for in one job, at most (one per rank)."""
    capture_max_bytes: int = Field(default=32 * 1024 * 1024, gt=0)
    """Largest gzipped trace an upload may carry; ranks skip larger ones."""
    capture_max_inflated_bytes: int = Field(default=512 * 1024 * 1024, gt=0)
    """Largest trace once decompressed."""
    cors_origins: Annotated[list[str], NoDecode] = Field(default_factory=list)
    """Browser origins allowed to call the API (CORS), comma-separated; empty: CORS off."""

    @field_validator("webhook_urls", "cors_origins", mode="before")
    @classmethod
    def _comma_separated(cls, value: Any) -> Any:
        """A comma-separated string (or a JSON list) from the environment as a list."""
        if not isinstance(value, str):
            return value
        if value.strip().startswith("["):
            return json.loads(value)
        return [part.strip() for part in value.split(",") if part.strip()]

    @field_validator("webhook_urls")
    @classmethod
    def _http_urls(cls, urls: list[str]) -> list[str]:
        for url in urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"webhook URL {url!r} must start with http:// or https://")
        return urls

    @field_validator("otlp_export_endpoint")
    @classmethod
    def _http_endpoint(cls, url: str | None) -> str | None:
        if not url:  # compose passes an unset variable as ""
            return None
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"OTLP export endpoint {url!r} must start with http:// or https://")
        return url


def is_loopback(host: str) -> bool:
    """True when `host` resolves only to loopback addresses."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        try:
            infos = socket.getaddrinfo(host, None)
        except OSError:
            return False
        return all(ipaddress.ip_address(info[4][0]).is_loopback for info in infos)


def check_exposure(settings: Settings) -> None:
    """Refuse to serve a non-loopback address without auth unless explicitly allowed."""
    if settings.auth or settings.allow_unauthenticated or is_loopback(settings.host):
        return
    raise ValueError(
        f"refusing to listen on {settings.host} without authentication: enable it with --auth "
        "(and create tokens with `stepscope token create`), or pass --allow-unauthenticated"
    )
