"""Server configuration: one pydantic-settings class, env prefix STEPSCOPE_."""

from __future__ import annotations

import ipaddress
import socket

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from stepscope.store.engine import DEFAULT_DATABASE_URL


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
