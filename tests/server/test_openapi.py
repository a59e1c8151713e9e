"""The OpenAPI document, CORS, and a bounded schemathesis run against a real server."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from stepscope.store.engine import make_engine
from stepscope.store.migrate import upgrade
from stepscope.store.tokens import create_token
from stepscope.synthetic.generate import JobSpec, Straggler, generate
from stepscope.synthetic.stream import stream_job
from tests.live_server import run_server
from tests.support import fresh_postgres_database

FUZZ_JOB = "fuzz-job"
MAX_EXAMPLES = int(os.environ.get("STEPSCOPE_FUZZ_EXAMPLES", "20"))
"""Per operation and token: bounds the run (about a minute for all operations on both
engines). The deep run, STEPSCOPE_FUZZ_EXAMPLES=70, makes over 1,000 requests per token."""


@dataclass(frozen=True, slots=True)
class Fuzzed:
    url: str
    token: str
    read_token: str


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def fuzzed(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Fuzzed]:
    """A server with auth on, an admin token and an analysed job with a straggler."""
    with contextlib.ExitStack() as stack:
        if request.param == "sqlite":
            url = f"sqlite:///{tmp_path_factory.mktemp('fuzz') / 'stepscope.db'}"
        else:
            url = stack.enter_context(fresh_postgres_database())
        engine = make_engine(url)
        upgrade(engine)
        token = create_token(engine, name="fuzz", scopes=["admin"])
        read_token = create_token(engine, name="fuzz-read", scopes=["read"])
        engine.dispose()
        server = stack.enter_context(run_server(url, extra_args=["--auth"]))
        spec = JobSpec(
            job_id=FUZZ_JOB,
            num_ranks=4,
            num_steps=200,
            stragglers=(Straggler(ranks=(1,), factor=1.3, cause="compute", from_step=80),),
        )
        assert not stream_job(generate(spec), server.url, token=token).failures
        headers = {"Authorization": f"Bearer {token}"}
        analyzed = httpx.post(
            f"{server.url}/api/v1/jobs/{FUZZ_JOB}/analyze", headers=headers, timeout=120
        )
        assert analyzed.status_code == 200
        yield Fuzzed(url=server.url, token=token, read_token=read_token)


@pytest.mark.parametrize("scope", ["admin", "read"])
def test_every_operation_answers_per_its_schema_and_never_5xx(fuzzed: Fuzzed, scope: str) -> None:
    """Schemathesis' default checks (no 5xx, documented status, content type, headers and
    body schema, invalid input rejected) on MAX_EXAMPLES generated requests per operation,
    with an admin token and with a read token (403s where more is needed). Not
    positive_data_acceptance: some schema-valid values are rightly refused with a 422 naming
    them (a cursor this server did not make, agg for a job-level metric, a rank the job has
    not seen), or a 403 for the read token."""
    api = schemathesis.openapi.from_url(f"{fuzzed.url}/openapi.json")
    token = fuzzed.token if scope == "admin" else fuzzed.read_token
    headers = {"Authorization": f"Bearer {token}"}
    operations = [result.ok() for result in api.get_all_operations()]
    assert len(operations) == 24  # 23 and /healthz

    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(
            max_examples=MAX_EXAMPLES,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        def conforms(case: Any) -> None:
            case.call_and_validate(
                headers=headers, excluded_checks=[schemathesis.checks.positive_data_acceptance]
            )

        conforms()


def test_the_document_describes_ingest_and_every_api_route(live_server: Any) -> None:
    doc = httpx.get(f"{live_server.url}/openapi.json").json()
    ingest = doc["paths"]["/v1/ingest"]["post"]
    batch = doc["components"]["schemas"]["IngestBatch"]

    assert set(batch["required"]) >= {"schema", "job", "source", "seq"}
    assert "steps" in batch["properties"]
    steps = doc["components"]["schemas"]["WireStepsColumns"]
    assert set(steps["required"]) == {"step", "ts", "step_s", "data_s"}
    assert ingest["requestBody"]["content"]["application/json"]["schema"] == {
        "oneOf": [
            {"$ref": "#/components/schemas/IngestBatch"},
            {"$ref": "#/components/schemas/IngestBundle"},
        ]
    }
    bundle = doc["components"]["schemas"]["IngestBundle"]
    assert bundle["properties"]["batches"]["items"] == {"$ref": "#/components/schemas/IngestBatch"}
    assert bundle["properties"]["batches"]["maxItems"] == 1024
    assert {"200", "401", "403", "413", "415", "422"} <= set(ingest["responses"])
    assert doc["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"
    for path, item in doc["paths"].items():
        if path.startswith("/api/v1"):
            for operation in item.values():
                assert "422" in operation["responses"]
                assert "401" in operation["responses"]
    assert httpx.get(f"{live_server.url}/docs").status_code == 200


def test_cors_is_off_by_default_and_allows_the_configured_origins(live_server: Any) -> None:
    origin = {"Origin": "https://dash.example"}
    plain = httpx.get(f"{live_server.url}/api/v1/jobs", headers=origin)
    assert plain.status_code == 200
    assert "access-control-allow-origin" not in plain.headers

    env = {"STEPSCOPE_CORS_ORIGINS": "https://dash.example,https://other.example"}
    with run_server(env=env) as server:
        allowed = httpx.get(f"{server.url}/api/v1/jobs", headers=origin)
        preflight = httpx.options(
            f"{server.url}/api/v1/jobs",
            headers={**origin, "Access-Control-Request-Method": "GET"},
        )
        other = httpx.get(f"{server.url}/api/v1/jobs", headers={"Origin": "https://evil.example"})
    assert allowed.headers["access-control-allow-origin"] == "https://dash.example"
    assert preflight.status_code == 200
    assert "access-control-allow-origin" not in other.headers
