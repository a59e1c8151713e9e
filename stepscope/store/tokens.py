"""API tokens: stored as SHA-256 hashes with their scopes; the token is shown once."""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Iterable
from datetime import UTC, datetime

import sqlalchemy as sa

from stepscope.store import tables

TOKEN_PREFIX = "ss_"


def token_sha256(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def create_token(engine: sa.Engine, *, name: str, scopes: Iterable[str]) -> str:
    """Store a new token's hash and return the token (shown to the user once)."""
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    with engine.begin() as conn:
        conn.execute(
            sa.insert(tables.ApiToken).values(
                name=name,
                token_sha256=token_sha256(token),
                scopes=" ".join(sorted(set(scopes))),
                created_at=datetime.now(UTC),
            )
        )
    return token


def token_scopes(engine: sa.Engine, token: str) -> frozenset[str] | None:
    """Scopes of a valid, unrevoked token; None if unknown."""
    t = tables.ApiToken
    query = sa.select(t.scopes).where(t.token_sha256 == token_sha256(token), t.revoked_at.is_(None))
    with engine.connect() as conn:
        scopes = conn.execute(query).scalar_one_or_none()
    return None if scopes is None else frozenset(scopes.split())
