"""With auth on, every route answers 401 without a token, 403 with a wrong scope, 2xx with
the right one (admin holds every scope)."""

from __future__ import annotations

import gzip
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import orjson
import pytest

from stepscope.store.engine import make_engine
from stepscope.store.migrate import upgrade
from stepscope.store.tokens import create_token
from stepscope.synthetic.generate import JobSpec, generate
from stepscope.synthetic.stream import rank_batches, stream_job
from tests.live_server import RunningServer, run_server

JOB = "auth-job"
DOOMED = "auth-doomed"


@dataclass(frozen=True, slots=True)
class Secured:
    server: RunningServer
    tokens: dict[str, str]
    """scope → a token holding only that scope."""
    capture_id: int
    """A deep capture of JOB with its trace stored."""


@dataclass(frozen=True, slots=True)
class Route:
    method: str
    template: str
    scope: str
    """The scope it needs; "read" routes refuse an ingest token, the others a read token."""

    @property
    def wrong_scopes(self) -> tuple[str, ...]:
        return {"read": ("ingest",), "ingest": ("read",), "admin": ("read", "ingest")}[self.scope]


ROUTES = [
    Route("GET", "/api/v1/jobs", "read"),
    Route("GET", "/api/v1/jobs/{job_id}", "read"),
    Route("GET", "/api/v1/jobs/{job_id}/findings", "read"),
    Route("GET", "/api/v1/jobs/{job_id}/timeseries", "read"),
    Route("GET", "/api/v1/jobs/{job_id}/ranks", "read"),
    Route("GET", "/api/v1/jobs/{job_id}/heatmap", "read"),
    Route("GET", "/api/v1/jobs/{job_id}/mesh", "read"),
    Route("GET", "/api/v1/jobs/{job_id}/hang", "read"),
    Route("GET", "/api/v1/jobs/{job_id}/goodput", "read"),
    Route("GET", "/api/v1/goodput", "read"),
    Route("GET", "/api/v1/jobs/{job_id}/collectives", "read"),
    Route("GET", "/api/v1/jobs/{job_id}/gpu", "read"),
    Route("GET", "/api/v1/jobs/{job_id}/export", "read"),
    Route("GET", "/api/v1/compare", "read"),
    Route("GET", "/api/v1/jobs/{job_id}/metrics", "read"),
    Route("GET", "/api/v1/nodes", "read"),
    Route("GET", "/api/v1/nodes/{node}", "read"),
    Route("POST", "/api/v1/jobs/{job_id}/analyze", "ingest"),
    Route("POST", "/v1/ingest", "ingest"),
    Route("POST", "/api/v1/jobs/{job_id}/captures", "ingest"),
    Route("GET", "/api/v1/jobs/{job_id}/captures", "read"),
    Route("GET", "/api/v1/captures/{capture_id}/trace", "read"),
    Route("DELETE", "/api/v1/jobs/{job_id}", "admin"),
]


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Secured]:
    """A server with auth on, a token per scope, and two small analysed jobs."""
    url = f"sqlite:///{tmp_path_factory.mktemp('auth') / 'stepscope.db'}"
    engine = make_engine(url)
    upgrade(engine)
    tokens = {s: create_token(engine, name=s, scopes=[s]) for s in ("read", "ingest")}
    tokens["admin"] = create_token(engine, name="admin", scopes=["admin"])
    engine.dispose()
    with run_server(url, extra_args=["--auth"]) as server:
        for job_id in (JOB, DOOMED):
            # One rank per node: the analysed job stores levels of node-0000 (GET /nodes/…).
            spec = JobSpec(
                job_id=job_id, num_ranks=2, ranks_per_node=1, num_steps=60, spike_prob=0.0
            )
            assert not stream_job(generate(spec), server.url, token=tokens["ingest"]).failures
        analyzed = httpx.post(
            f"{server.url}/api/v1/jobs/{JOB}/analyze",
            headers={"Authorization": f"Bearer {tokens['ingest']}"},
            timeout=120,
        )
        assert analyzed.status_code == 200, analyzed.text
        yield Secured(server=server, tokens=tokens, capture_id=stored_capture(server, tokens))


def stored_capture(server: RunningServer, tokens: dict[str, str]) -> int:
    """A capture of JOB's rank 0 asked for and its trace uploaded, with the ingest token."""
    headers = {"Authorization": f"Bearer {tokens['ingest']}"}
    asked = httpx.post(
        f"{server.url}/api/v1/jobs/{JOB}/captures", json={"rank": 0}, headers=headers
    )
    assert asked.status_code == 201, asked.text
    capture_id = int(asked.json()["captures"][0]["id"])
    trace = {"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5}]}
    uploaded = httpx.post(
        f"{server.url}/v1/captures/{capture_id}",
        content=gzip.compress(orjson.dumps(trace)),
        headers={**headers, "Content-Type": "application/json", "Content-Encoding": "gzip"},
    )
    assert uploaded.status_code == 200, uploaded.text
    return capture_id


def call(secured: Secured, route: Route, token: str | None) -> httpx.Response:
    job_id = DOOMED if route.method == "DELETE" else JOB
    path = route.template.format(job_id=job_id, node="node-0000", capture_id=secured.capture_id)
    params = {"baseline": JOB, "candidate": JOB} if path.endswith("/compare") else None
    if path.endswith("/api/v1/goodput"):
        params = {"since": 0}
    headers = {} if token is None else {"Authorization": f"Bearer {token}"}
    body = None
    if route.method == "POST" and path.endswith("/captures"):
        body = orjson.dumps({"rank": 0})
        headers["Content-Type"] = "application/json"
    if path == "/v1/ingest":
        job = generate(JobSpec(job_id="auth-ingest", num_ranks=1, num_steps=5))
        body = orjson.dumps(next(rank_batches(job, 0, steps_per_batch=5)))
        headers["Content-Type"] = "application/json"
    return httpx.request(
        route.method,
        f"{secured.server.url}{path}",
        params=params,
        headers=headers,
        content=body,
        timeout=60,
    )


def test_the_matrix_covers_every_route_of_the_openapi_document(secured: Secured) -> None:
    doc = httpx.get(f"{secured.server.url}/openapi.json").json()
    documented = {
        (method.upper(), path)
        for path, item in doc["paths"].items()
        for method in item
        if path != "/healthz"
    }
    assert documented == {(r.method, r.template) for r in ROUTES}


@pytest.mark.parametrize("route", ROUTES, ids=lambda r: f"{r.method} {r.template}")
def test_a_route_needs_a_token_with_its_scope(secured: Secured, route: Route) -> None:
    missing = call(secured, route, None)
    unknown = call(secured, route, "ss_not-a-token")
    assert missing.status_code == 401
    assert missing.headers["www-authenticate"] == "Bearer"
    assert unknown.status_code == 401
    for scope in route.wrong_scopes:
        wrong = call(secured, route, secured.tokens[scope])
        assert wrong.status_code == 403, scope
        assert route.scope in wrong.json()["detail"]
    right = call(secured, route, secured.tokens[route.scope])
    assert 200 <= right.status_code < 300, right.text


@pytest.mark.parametrize("route", ROUTES[:-1], ids=lambda r: f"{r.method} {r.template}")
def test_an_admin_token_opens_every_route(secured: Secured, route: Route) -> None:
    assert 200 <= call(secured, route, secured.tokens["admin"]).status_code < 300


@pytest.mark.parametrize(
    ("method", "path", "scope", "content_type"),
    [
        ("GET", "/metrics", "read", None),
        ("POST", "/v1/metrics", "ingest", "application/x-protobuf"),
    ],
)
def test_prometheus_and_otlp_routes_need_their_scope(
    secured: Secured, method: str, path: str, scope: str, content_type: str | None
) -> None:
    """/metrics (Prometheus' format) and /v1/metrics (OTLP's) are outside the OpenAPI
    document, under the same tokens."""
    url = f"{secured.server.url}{path}"
    headers = {"Content-Type": content_type} if content_type else {}

    def status(token: str | None) -> int:
        auth = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.request(method, url, headers={**headers, **auth}, content=b"").status_code

    assert status(None) == 401
    wrong = "ingest" if scope == "read" else "read"
    assert status(secured.tokens[wrong]) == 403
    assert status(secured.tokens[scope]) == 200
    assert status(secured.tokens["admin"]) == 200


def test_health_and_the_openapi_document_need_no_token(secured: Secured) -> None:
    for path in ("/healthz", "/openapi.json", "/docs"):
        assert httpx.get(f"{secured.server.url}{path}").status_code == 200


def test_tokens_are_stored_as_hashes_only(secured: Secured, tmp_path: Path) -> None:
    from tests.live_server import read_rows

    stored = repr(read_rows(secured.server.db_url, "api_tokens", None))
    assert all(token not in stored for token in secured.tokens.values())


def test_uploading_a_capture_needs_the_ingest_scope(secured: Secured) -> None:
    """The ranks' trace upload and failure report are outside the OpenAPI document, under
    the ingest scope: refused before anything is read or stored."""
    for path in (
        f"/v1/captures/{secured.capture_id}",
        f"/v1/captures/{secured.capture_id}/failure",
    ):

        def status(token: str | None, path: str = path) -> int:
            headers = {"Content-Type": "application/json"}
            if token:
                headers["Authorization"] = f"Bearer {token}"
            url = f"{secured.server.url}{path}"
            return httpx.post(url, content=b'{"error": "x"}', headers=headers).status_code

        assert status(None) == 401
        assert status(secured.tokens["read"]) == 403
    listed = httpx.get(
        f"{secured.server.url}/api/v1/jobs/{JOB}/captures",
        headers={"Authorization": f"Bearer {secured.tokens['read']}"},
    ).json()
    stored = [c for r in listed for c in r["captures"] if c["id"] == secured.capture_id]
    assert [c["status"] for c in stored] == ["uploaded"]
