"""With auth on, the dashboard serves nothing but its sign-in page without a read token;
the dashboard claims only its own paths (it shadows no API route)."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from stepscope.dashboard.signin import COOKIE
from stepscope.synthetic.generate import JobSpec, generate
from stepscope.synthetic.stream import stream_job
from tests.live_server import RunningServer, database_with_tokens, run_server

JOB = "dash-secret"
NAME = "secret-llm-run"


@dataclass(frozen=True, slots=True)
class Secured:
    server: RunningServer
    tokens: dict[str, str]


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Secured]:
    db_url = f"sqlite:///{tmp_path_factory.mktemp('dash-auth') / 'stepscope.db'}"
    tokens = database_with_tokens(db_url, ("read", "ingest", "admin"))
    with run_server(db_url, extra_args=["--auth"]) as server:
        job = generate(JobSpec(job_id=JOB, num_ranks=2, num_steps=40, seed=1))
        job.job["name"] = NAME
        # In a thread of its own: when the browser tests ran first in this process,
        # Playwright's sync API keeps an event loop running in this one.
        with ThreadPoolExecutor(1) as pool:
            stats = pool.submit(
                stream_job, job, server.url, token=tokens["ingest"], steps_per_batch=20
            ).result()
        assert not stats.failures, stats.failures
        yield Secured(server=server, tokens=tokens)


def _router_request(pathname: str) -> dict[str, Any]:
    """The body Dash Pages' router callback posts for `pathname`."""
    return {
        "output": ".._pages_content.children..._pages_store.data..",
        "outputs": [
            {"id": "_pages_content", "property": "children"},
            {"id": "_pages_store", "property": "data"},
        ],
        "inputs": [
            {"id": "_pages_location", "property": "pathname", "value": pathname},
            {"id": "_pages_location", "property": "search", "value": ""},
        ],
        "changedPropIds": ["_pages_location.pathname"],
        "state": [],
    }


def _client(secured: Secured, **kw: Any) -> httpx.Client:
    return httpx.Client(base_url=secured.server.url, timeout=30, **kw)


def test_without_a_token_a_page_redirects_to_sign_in(secured: Secured) -> None:
    with _client(secured) as c:
        r = c.get(f"/jobs/{JOB}")
        assert r.status_code == 303
        assert r.headers["location"] == f"/sign-in?next=/jobs/{JOB}"
        page = c.get(r.headers["location"])
        assert page.status_code == 200
        assert 'name="token"' in page.text
        assert NAME not in page.text


@pytest.mark.parametrize(
    "path", ["/_dash-layout", "/_dash-dependencies", "/assets/style.css", "/_reload-hash"]
)
def test_without_a_token_dash_requests_get_401(secured: Secured, path: str) -> None:
    with _client(secured) as c:
        r = c.get(path)
        assert r.status_code == 401
        assert NAME not in r.text


def test_without_a_token_a_callback_answers_nothing(secured: Secured) -> None:
    with _client(secured) as c:
        r = c.post("/_dash-update-component", json=_router_request(f"/jobs/{JOB}"))
        assert r.status_code == 401
        assert NAME not in r.text
    with _client(secured, cookies={"stepscope_token": "ss_not-a-token"}) as c:
        bad = c.post("/_dash-update-component", json=_router_request(f"/jobs/{JOB}"))
        assert bad.status_code == 401


def test_sign_in_sets_an_httponly_samesite_cookie_that_opens_the_pages(secured: Secured) -> None:
    with _client(secured) as c:
        wrong = c.post("/sign-in", data={"token": secured.tokens["ingest"], "next": "/"})
        assert wrong.status_code == 401
        assert "lacks the read scope" in wrong.text
        assert "set-cookie" not in wrong.headers
        r = c.post("/sign-in", data={"token": secured.tokens["read"], "next": f"/jobs/{JOB}"})
        assert r.status_code == 303
        assert r.headers["location"] == f"/jobs/{JOB}"
        cookie = r.headers["set-cookie"].lower()
        assert "httponly" in cookie
        assert "samesite=lax" in cookie
        assert c.get(f"/jobs/{JOB}").status_code == 200
        answer = c.post("/_dash-update-component", json=_router_request(f"/jobs/{JOB}"))
        assert answer.status_code == 200
        assert NAME in answer.text
        c.post("/sign-out")
        assert c.get(f"/jobs/{JOB}").status_code == 303


def test_a_proxy_may_send_the_token_as_a_bearer_header(secured: Secured) -> None:
    headers = {"Authorization": f"Bearer {secured.tokens['read']}"}
    with _client(secured, headers=headers) as c:
        answer = c.post("/_dash-update-component", json=_router_request(f"/jobs/{JOB}"))
        assert answer.status_code == 200
        assert NAME in answer.text


def test_sign_in_returns_only_to_local_paths(secured: Secured) -> None:
    with _client(secured) as c:
        r = c.post("/sign-in", data={"token": secured.tokens["read"], "next": "//evil.example"})
        assert r.headers["location"] == "/"


@pytest.mark.parametrize(
    ("path", "status"),
    [("/api/v1/no-such", 404), ("/v1/no-such", 404), ("/healthz", 200), ("/openapi.json", 200)],
)
def test_the_dashboard_shadows_no_api_path(secured: Secured, path: str, status: int) -> None:
    with _client(secured) as c:
        r = c.get(path)
        assert r.status_code == status
        assert r.headers["content-type"].startswith("application/json")


def test_dashboard_responses_are_compressed(secured: Secured) -> None:
    headers = {"Authorization": f"Bearer {secured.tokens['read']}", "Accept-Encoding": "gzip"}
    with _client(secured, headers=headers) as c:
        r = c.get("/_dash-dependencies")
        assert r.status_code == 200
        assert r.headers["content-encoding"] == "gzip"


@pytest.mark.browser
def test_only_a_token_with_ingest_or_admin_asks_for_a_capture_on_the_job_page(
    secured: Secured, browser: Any
) -> None:
    """A read token signs in and sees the captures, but asking for one needs more."""
    url = secured.server.url
    for scope, answer in (
        ("read", "needs a token with the ingest or admin scope"),
        ("admin", "asked"),
    ):
        context = browser.new_context()
        try:
            context.add_cookies([{"name": COOKIE, "value": secured.tokens[scope], "url": url}])
            page = context.new_page()
            page.goto(f"{url}/jobs/{JOB}")
            page.locator("#job-capture-rank").wait_for(timeout=60_000)
            page.fill("#job-capture-rank", "1")
            page.click("#job-capture-go")
            page.locator("#job-capture-message", has_text=answer).wait_for(timeout=20_000)
        finally:
            context.close()
    read = {"Authorization": f"Bearer {secured.tokens['read']}"}
    [request] = httpx.get(f"{url}/api/v1/jobs/{JOB}/captures", headers=read).json()
    assert [c["rank"] for c in request["captures"]] == [1, 0]
