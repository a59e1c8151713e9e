"""A real Prometheus scrapes /metrics of a server with a live simulated job (auth on)."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from stepscope.synthetic.generate import JobSpec, generate
from stepscope.synthetic.stream import stream_job
from tests.live_server import RunningServer, database_with_tokens, free_port, run_server, stop
from tests.support import require_prometheus

JOB = "prom-live"
NUM_RANKS, NUM_STEPS, STEPS_PER_BATCH = 2, 60, 10
_SLOW_S = 120.0
"""Timeout of a request to the server: a loaded CI machine makes an analysis pass slow."""
_SCRAPE_LABELS = ("__name__", "instance", "job")
"""Labels Prometheus adds to every series (its own "job" is the scrape job)."""


@dataclass(frozen=True, slots=True)
class Scraped:
    server: RunningServer
    tokens: dict[str, str]
    prometheus_url: str


def _prometheus_config(target_port: int, token: str) -> str:
    return f"""
global:
  scrape_interval: 1s
  scrape_timeout: 1s
scrape_configs:
  - job_name: stepscope
    metrics_path: /metrics
    authorization:
      credentials: {token}
    static_configs:
      - targets: ["127.0.0.1:{target_port}"]
"""


def _wait_ready(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"prometheus exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/-/ready", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"prometheus at {url} not ready after {timeout_s} s")


def _start_prometheus(
    binary: str, workdir: Path, target_port: int, token: str
) -> tuple[subprocess.Popen[bytes], str]:
    config = workdir / "prometheus.yml"
    config.write_text(_prometheus_config(target_port, token))
    port = free_port()
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        cwd=workdir,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(url, proc)
    except Exception:
        stop(proc, timeout_s=0)
        raise
    return proc, url


@pytest.fixture(scope="module")
def scraped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scraped]:
    """A server with auth on and one live analysed job, scraped by a real Prometheus."""
    binary = require_prometheus()
    tmp = tmp_path_factory.mktemp("prom")
    url = f"sqlite:///{tmp / 'stepscope.db'}"
    tokens = database_with_tokens(url, ("read", "ingest"))
    with run_server(url, extra_args=["--auth"]) as server:
        job = generate(JobSpec(job_id=JOB, num_ranks=NUM_RANKS, num_steps=NUM_STEPS))
        stats = stream_job(job, server.url, token=tokens["ingest"], steps_per_batch=STEPS_PER_BATCH)
        assert not stats.failures
        ingest = {"Authorization": f"Bearer {tokens['ingest']}"}
        bad = httpx.post(
            f"{server.url}/v1/ingest",
            content=b"{not json",
            headers={**ingest, "Content-Type": "application/json"},
            timeout=_SLOW_S,
        )
        assert bad.status_code == 400
        analyzed = httpx.post(
            f"{server.url}/api/v1/jobs/{JOB}/analyze", headers=ingest, timeout=_SLOW_S
        )
        assert analyzed.status_code == 200
        proc, prom_url = _start_prometheus(binary, tmp, server.port, tokens["read"])
        try:
            yield Scraped(server=server, tokens=tokens, prometheus_url=prom_url)
        finally:
            stop(proc)


def _query(scraped: Scraped, promql: str, timeout_s: float = 30.0) -> dict[str, float]:
    """Prometheus's instant answer to `promql` once it has one: a series' labels → value."""
    deadline = time.monotonic() + timeout_s
    while True:
        body = httpx.get(
            f"{scraped.prometheus_url}/api/v1/query", params={"query": promql}, timeout=5
        ).json()
        assert body["status"] == "success", body
        result = body["data"]["result"]
        if result or time.monotonic() > deadline:
            return {
                ",".join(
                    f"{k}={v}" for k, v in sorted(r["metric"].items()) if k not in _SCRAPE_LABELS
                ): float(r["value"][1])
                for r in result
            }
        time.sleep(0.5)


def _one(answer: dict[str, float]) -> float:
    assert len(answer) == 1, answer
    return next(iter(answer.values()))


def test_prometheus_scrapes_the_server_with_a_token(scraped: Scraped) -> None:
    up = _query(scraped, 'up{job="stepscope"} == 1')
    assert _one(up) == 1.0


def test_the_ingest_counters_count_the_batches_rows_and_rejections(scraped: Scraped) -> None:
    num_batches = NUM_RANKS * NUM_STEPS // STEPS_PER_BATCH
    accepted = _query(
        scraped, 'stepscope_ingest_batches_total{endpoint="/v1/ingest",outcome="accepted"}'
    )
    assert _one(accepted) == num_batches
    steps = _query(scraped, 'stepscope_ingest_rows_total{table="steps"}')
    assert _one(steps) == NUM_RANKS * NUM_STEPS
    rejected = _query(
        scraped, 'stepscope_ingest_rejected_batches_total{endpoint="/v1/ingest",reason="invalid"}'
    )
    assert _one(rejected) == 1.0
    latency = _query(
        scraped,
        'stepscope_http_request_duration_seconds_count{route="/v1/ingest",method="POST",'
        'status="2xx"}',
    )
    assert _one(latency) == num_batches


def test_the_job_gauges_equal_the_apis_summary(scraped: Scraped) -> None:
    read = {"Authorization": f"Bearer {scraped.tokens['read']}"}
    summary = httpx.get(
        f"{scraped.server.url}/api/v1/jobs/{JOB}", headers=read, timeout=_SLOW_S
    ).json()
    step = _query(scraped, f'stepscope_job_step_p50_seconds{{job_id="{JOB}"}}')
    assert _one(step) == pytest.approx(summary["step_p50_s"], rel=1e-9)
    tokens = _query(scraped, f'stepscope_job_tokens_per_second{{job_id="{JOB}"}}')
    assert _one(tokens) == pytest.approx(summary["tokens_per_s"], rel=1e-9)
    mfu = _query(scraped, f'stepscope_job_mfu_ratio{{job_id="{JOB}"}}')
    assert _one(mfu) == pytest.approx(summary["mfu"], rel=1e-9)
    goodput = httpx.get(
        f"{scraped.server.url}/api/v1/jobs/{JOB}/goodput", headers=read, timeout=_SLOW_S
    ).json()["goodput"]
    assert 0.5 < goodput <= 1.0
    ratio = _query(scraped, f'stepscope_job_goodput_ratio{{job_id="{JOB}"}}')
    assert _one(ratio) == pytest.approx(goodput, rel=1e-9)
    hang = _query(scraped, f'stepscope_job_hang{{job_id="{JOB}"}}')
    assert _one(hang) == 0.0
    assert _one(_query(scraped, "stepscope_live_jobs")) == 1.0
    findings = _query(scraped, f'stepscope_job_findings{{job_id="{JOB}"}}')
    assert findings == {
        f"job_id={JOB},severity={s}": float(summary[f"num_{s}"])
        for s in ("info", "warning", "critical")
    }


def test_metrics_needs_a_read_token_when_auth_is_on(scraped: Scraped) -> None:
    url = f"{scraped.server.url}/metrics"
    assert httpx.get(url).status_code == 401
    ingest_only = {"Authorization": f"Bearer {scraped.tokens['ingest']}"}
    assert httpx.get(url, headers=ingest_only).status_code == 403
    read = {"Authorization": f"Bearer {scraped.tokens['read']}"}
    response = httpx.get(url, headers=read)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")


def test_job_ids_with_quotes_and_backslashes_parse_back_exactly() -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from stepscope.server.metrics import live_jobs_text

    job_id = 'run "7"\\a\nb'
    row = {
        "job_id": job_id,
        "step_p50_s": 0.25,
        "tokens_per_s": 1e5,
        "mfu": None,
        "goodput": 0.875,
        "num_info": 1,
        "num_warning": 0,
        "num_critical": 2,
        "hang": True,
    }
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(live_jobs_text([row]))
        for s in family.samples
    }
    assert samples == {
        ("stepscope_live_jobs", ()): 1.0,
        ("stepscope_job_step_p50_seconds", (("job_id", job_id),)): 0.25,
        ("stepscope_job_tokens_per_second", (("job_id", job_id),)): 1e5,
        ("stepscope_job_goodput_ratio", (("job_id", job_id),)): 0.875,
        ("stepscope_job_findings", (("job_id", job_id), ("severity", "info"))): 1.0,
        ("stepscope_job_findings", (("job_id", job_id), ("severity", "warning"))): 0.0,
        ("stepscope_job_findings", (("job_id", job_id), ("severity", "critical"))): 2.0,
        ("stepscope_job_hang", (("job_id", job_id),)): 1.0,
    }
