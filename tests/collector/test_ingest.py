"""The ingest endpoint through a real server on a loopback port, on SQLite and PostgreSQL."""

from __future__ import annotations

import copy
import gzip
import json
import math
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.live_server import RunningServer, read_rows, run_server

TS0 = 1_767_000_000.0


def make_batch(
    *, job_id: str = "job-a", rank: int = 1, seq: int = 0, first_step: int = 10
) -> dict[str, Any]:
    steps = [first_step, first_step + 1, first_step + 2]
    return {
        "schema": 1,
        "job": {
            "job_id": job_id,
            "name": "llm",
            "world_size": 4,
            "device_name": "NVIDIA H100 80GB HBM3",
            "peak_flops": 9.89e14,
            "attributes": {"git_sha": "abc123"},
        },
        "source": {
            "rank": rank,
            "local_rank": rank,
            "node": "host-a",
            "pid": 4711,
            "incarnation": "inc-1",
        },
        "seq": seq,
        "steps": {
            "step": steps,
            "ts": [TS0 + i for i in range(3)],
            "step_s": [0.5, 0.52, 0.51],
            "data_s": [0.01, 0.02, 0.0],
            "forward_s": [0.1, 0.1, 0.1],
            "backward_s": [0.2, 0.21, 0.2],
            "optimizer_s": [0.05, 0.05, 0.05],
            "comm_s": [0.15, 0.14, 0.16],
            "comm_wait_s": [0.03, 0.04, None],
            "tokens": [4096, 4096, 4096],
            "flops": [1.2e15, 1.2e15, 1.2e15],
            "mem_peak_bytes": [2**34, 2**34, 2**34],
        },
        "collectives": {
            "step": steps[:2],
            "op": ["all_reduce", "all_reduce"],
            "group_size": [4, 4],
            "count": [3, 3],
            "bytes": [400_000_000, 400_000_000],
            "busy_s": [0.15, 0.14],
        },
        "gpu": {
            "ts": [TS0, TS0 + 1],
            "gpu_index": [1, 1],
            "util": [97.0, 98.0],
            "power_w": [690.5, 700.0],
            "temp_c": [71.0, 72.0],
            "sm_clock_mhz": [1980.0, 1980.0],
            "throttle_reasons": [0, 4],
        },
        "events": [
            {"ts": TS0, "kind": "custom", "message": "warm-up done", "attributes": {"step": 10}}
        ],
    }


def post(
    server: RunningServer,
    body: Any,
    *,
    gzip_body: bool = False,
    token: str | None = None,
    content_type: str = "application/json",
) -> httpx.Response:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": content_type}
    if gzip_body:
        raw = gzip.compress(raw)
        headers["Content-Encoding"] = "gzip"
    if token:
        headers["Authorization"] = f"Bearer {token}"
    return httpx.post(f"{server.url}/v1/ingest", content=raw, headers=headers, timeout=30)


def stored_counts(server: RunningServer, job_id: str) -> dict[str, int]:
    tables = ("steps", "collectives", "gpu_samples", "events", "jobs", "ranks", "ingest_batches")
    return {t: len(read_rows(server.db_url, t, job_id)) for t in tables}


@pytest.fixture
def server(db_url: str) -> Iterator[RunningServer]:
    with run_server(db_url) as running:
        yield running


def test_batch_round_trips_with_every_column(server: RunningServer) -> None:
    batch = make_batch()
    resp = post(server, batch)
    assert resp.status_code == 200, resp.text
    assert resp.json() == {
        "accepted": {"steps": 3, "collectives": 2, "gpu": 2, "events": 1},
        "duplicate": False,
    }

    steps = sorted(read_rows(server.db_url, "steps", "job-a"), key=lambda r: r["step"])
    assert [r["step"] for r in steps] == [10, 11, 12]
    assert {r["rank"] for r in steps} == {1}
    assert [r["step_s"] for r in steps] == [0.5, 0.52, 0.51]
    assert [r["comm_wait_s"] for r in steps] == [0.03, 0.04, None]
    assert steps[0]["mem_peak_bytes"] == 2**34
    assert steps[0]["flops"] == 1.2e15
    assert steps[0]["h2d_s"] is None
    coll = read_rows(server.db_url, "collectives", "job-a")
    assert sorted((r["step"], r["op"], r["bytes"], r["busy_s"]) for r in coll) == [
        (10, "all_reduce", 400_000_000, 0.15),
        (11, "all_reduce", 400_000_000, 0.14),
    ]
    gpu = read_rows(server.db_url, "gpu_samples", "job-a")
    assert sorted((r["power_w"], r["throttle_reasons"]) for r in gpu) == [(690.5, 0), (700.0, 4)]
    (event,) = read_rows(server.db_url, "events", "job-a")
    assert (event["kind"], event["message"], event["attributes"]) == (
        "custom",
        "warm-up done",
        {"step": 10},
    )
    (job,) = read_rows(server.db_url, "jobs", "job-a")
    assert (job["world_size"], job["peak_flops"], job["status"], job["started_at"]) == (
        4,
        9.89e14,
        "running",
        TS0,
    )
    assert job["attributes"] == {"git_sha": "abc123"}
    (rank,) = read_rows(server.db_url, "ranks", "job-a")
    assert (rank["rank"], rank["node"], rank["pid"], rank["incarnation"]) == (
        1,
        "host-a",
        4711,
        "inc-1",
    )


def test_resent_batch_is_acknowledged_and_stored_once(server: RunningServer) -> None:
    batch = make_batch()
    assert post(server, batch).json()["duplicate"] is False
    again = post(server, batch)
    assert again.status_code == 200
    assert again.json() == {
        "accepted": {"steps": 3, "collectives": 2, "gpu": 2, "events": 1},
        "duplicate": True,
    }
    # Same rows under a new seq: accepted, and the natural keys keep them stored once.
    assert post(server, make_batch(seq=1)).json()["duplicate"] is False
    counts = stored_counts(server, "job-a")
    assert counts == {
        "steps": 3,
        "collectives": 2,
        "gpu_samples": 2,
        "events": 1,
        "jobs": 1,
        "ranks": 1,
        "ingest_batches": 2,
    }


@pytest.mark.parametrize(
    ("mutate", "status", "field"),
    [
        (lambda b: b["collectives"]["busy_s"].__setitem__(1, "slow"), 422, "collectives.busy_s"),
        (lambda b: b["steps"]["step_s"].pop(), 422, "steps columns differ in length"),
        (lambda b: b["steps"].__setitem__("gpu_temp", [1, 2, 3]), 422, "gpu_temp"),
        (lambda b: b["steps"].pop("data_s"), 422, "data_s"),
        (lambda b: b["steps"]["data_s"].__setitem__(2, -1.0), 422, "steps.data_s"),
        (lambda b: b["collectives"]["op"].__setitem__(0, "allreduce"), 422, "allreduce"),
        (lambda b: b["events"][0].__setitem__("kind", "nope"), 422, "events[0].kind"),
        (lambda b: b["job"].pop("job_id"), 422, "job.job_id"),
        (lambda b: b["source"].__setitem__("rank", "one"), 422, "source.rank"),
        (lambda b: b.__setitem__("schema", 2), 422, "schema"),
    ],
)
def test_bad_batch_is_rejected_whole_and_leaves_nothing(
    server: RunningServer, mutate: Any, status: int, field: str
) -> None:
    bad = make_batch()
    mutate(bad)
    resp = post(server, bad)
    assert resp.status_code == status
    assert field in resp.json()["detail"]
    assert set(stored_counts(server, "job-a").values()) == {0}
    # The seq was not consumed: the corrected batch is stored.
    assert post(server, make_batch()).json()["duplicate"] is False
    assert stored_counts(server, "job-a")["steps"] == 3


def _nested(depth: int) -> bytes:
    """A batch whose job attributes nest `depth` objects deep (raw: json.dumps would recurse)."""
    head = b'{"schema":1,"job":{"job_id":"job-a","attributes":'
    tail = b'},"source":{"rank":1,"incarnation":"inc-1"},"seq":0}'
    return head + b'{"a":' * depth + b"1" + b"}" * depth + tail


ABSURD: list[tuple[str, Any, str]] = [
    ("NaN", lambda b: b["steps"]["step_s"].__setitem__(0, float("nan")), "steps.step_s[0]"),
    ("+inf", lambda b: b["collectives"]["busy_s"].__setitem__(1, math.inf), "collectives.busy_s"),
    ("-inf", lambda b: b["job"].__setitem__("peak_flops", -math.inf), "job.peak_flops"),
    ("a 30-day step", lambda b: b["steps"]["step_s"].__setitem__(0, 30 * 86400.0), "steps.step_s"),
    ("a negative time", lambda b: b["steps"]["ts"].__setitem__(0, -1.0), "steps.ts"),
    ("a time in 2200", lambda b: b["gpu"]["ts"].__setitem__(0, 7.3e9), "gpu.ts"),
    ("step 2**64", lambda b: b["steps"]["step"].__setitem__(0, 2**64), "steps.step"),
    ("rank 2**70", lambda b: b["source"].__setitem__("rank", 2**70), "source.rank"),
    ("seq 2**70", lambda b: b.__setitem__("seq", 2**70), "seq"),
    ("NUL in a name", lambda b: b["job"].__setitem__("name", "a\x00b"), "job.name"),
    ("NUL in a message", lambda b: b["events"][0].__setitem__("message", "\x00"), "events[0]"),
    ("a list for a number", lambda b: b.__setitem__("seq", [1]), "seq"),
    ("an object for a column", lambda b: b["steps"].__setitem__("ts", {"0": 1.0}), "steps.ts"),
]


def test_absurd_values_are_refused_naming_the_field_and_nothing_is_stored(
    server: RunningServer,
) -> None:
    for name, mutate, field in ABSURD:
        bad = make_batch()
        mutate(bad)
        resp = post(server, bad)
        assert resp.status_code == 422, (name, resp.text)
        assert field in resp.json()["detail"], (name, resp.text)
    deep = post(server, _nested(5000))
    assert deep.status_code == 400
    assert "depth" in deep.json()["detail"]
    assert set(stored_counts(server, "job-a").values()) == {0}
    assert post(server, _nested(100)).status_code == 200  # deep, but within JSON's limit


def test_gzip_body_is_accepted_and_corrupt_gzip_refused(server: RunningServer) -> None:
    resp = post(server, make_batch(), gzip_body=True)
    assert resp.json()["accepted"]["steps"] == 3
    corrupt = httpx.post(
        f"{server.url}/v1/ingest",
        content=b"\x1f\x8bnot gzip",
        headers={"Content-Type": "application/json", "Content-Encoding": "gzip"},
    )
    assert corrupt.status_code == 400
    assert "gzip" in corrupt.json()["detail"]


def test_content_type_and_body_size_limits(db_url: str) -> None:
    with run_server(db_url, env={"STEPSCOPE_MAX_BODY_BYTES": "4096"}) as server:
        resp = post(server, make_batch(), content_type="text/plain")
        assert resp.status_code == 415
        big = make_batch()
        big["steps"]["step"] = list(range(1000))
        for col in ("ts", "step_s", "data_s"):
            big["steps"][col] = [1.0] * 1000
        for col in (
            "forward_s",
            "backward_s",
            "optimizer_s",
            "comm_s",
            "comm_wait_s",
            "tokens",
            "flops",
            "mem_peak_bytes",
        ):
            del big["steps"][col]
        assert post(server, big).status_code == 413
        # A small gzip body that inflates past the limit is refused too.
        assert post(server, big, gzip_body=True).status_code == 413
        assert post(server, {"schema": 1}, gzip_body=True).status_code == 422
        assert set(stored_counts(server, "job-a").values()) == {0}


def _create_token(db_url: str, *scopes: str) -> str:
    args = [a for s in scopes for a in ("--scope", s)]
    out = subprocess.run(
        [sys.executable, "-m", "stepscope.cli", "token", "create", *args, "--db", db_url],
        check=True,
        capture_output=True,
        text=True,
    )
    return out.stdout.strip()


def test_auth_requires_a_token_with_the_ingest_scope(db_url: str) -> None:
    ingest_token = _create_token(db_url, "ingest")
    read_token = _create_token(db_url, "read")
    assert ingest_token.startswith("ss_")
    assert ingest_token != read_token
    assert ingest_token not in repr(read_rows(db_url, "api_tokens", None)), "only hashes are stored"
    with run_server(db_url, extra_args=["--auth"]) as server:
        assert post(server, make_batch()).status_code == 401
        assert post(server, make_batch(), token="ss_unknown").status_code == 401
        forbidden = post(server, make_batch(), token=read_token)
        assert forbidden.status_code == 403
        assert "ingest" in forbidden.json()["detail"]
        assert stored_counts(server, "job-a")["steps"] == 0
        assert post(server, make_batch(), token=ingest_token).status_code == 200
        assert (
            post(server, make_batch(seq=1), token=_create_token(db_url, "admin")).status_code == 200
        )
        assert stored_counts(server, "job-a")["steps"] == 3


def test_copy_of_batch_from_other_rank_is_separate(server: RunningServer) -> None:
    other = copy.deepcopy(make_batch(rank=2))
    assert post(server, make_batch()).status_code == 200
    assert post(server, other).json()["duplicate"] is False
    assert stored_counts(server, "job-a")["steps"] == 6
    assert stored_counts(server, "job-a")["ranks"] == 2


MESH = {"dp_shard": [1, 2], "tp": [0, 2]}


def per_group_batch(*, seq: int = 0, mesh: Any = MESH) -> dict[str, Any]:
    """make_batch() from a profiler of per-group records: step 10's all_gather in two groups
    (tp and dp_shard), a broadcast in the default group without a mesh dimension."""
    batch = make_batch(seq=seq)
    batch["source"]["mesh"] = mesh
    batch["collectives"] = {
        "step": [10, 10, 10],
        "group": ["1", "2", "0"],
        "op": ["all_gather", "all_gather", "broadcast"],
        "group_size": [2, 2, 4],
        "count": [6, 3, 1],
        "bytes": [6_000_000, 3_000_000, 8],
        "busy_s": [0.012, 0.02, 0.001],
        "wait_s": [0.004, 0.015, None],
        "first_seq": [12, 6, 0],
        "mesh_dim": ["tp", "dp_shard", None],
        "group_ranks": ["0-1", "1-3:2", "0-3"],
    }
    return batch


def test_per_group_collectives_and_the_rank_mesh_round_trip(server: RunningServer) -> None:
    resp = post(server, per_group_batch())
    assert resp.status_code == 200, resp.text
    assert resp.json()["accepted"]["collectives"] == 3

    coll = read_rows(server.db_url, "collectives", "job-a")
    assert sorted(
        (
            r["step"],
            r["group"],
            r["op"],
            r["count"],
            r["wait_s"],
            r["first_seq"],
            r["mesh_dim"],
            r["group_ranks"],
        )
        for r in coll
    ) == [
        (10, "0", "broadcast", 1, None, 0, None, "0-3"),
        (10, "1", "all_gather", 6, 0.004, 12, "tp", "0-1"),
        (10, "2", "all_gather", 3, 0.015, 6, "dp_shard", "1-3:2"),
    ]
    (rank,) = read_rows(server.db_url, "ranks", "job-a")
    assert rank["mesh"] == MESH
    filled = {
        r["column_name"]
        for r in read_rows(server.db_url, "job_columns", "job-a")
        if r["table_name"] == "collectives"
    }
    assert filled == {"wait_s", "first_seq", "mesh_dim", "group_ranks"}

    # A resend is acknowledged and stored once; the same rows under a new seq too.
    again = post(server, per_group_batch())
    assert again.json() == {
        "accepted": {"steps": 3, "collectives": 3, "gpu": 2, "events": 1},
        "duplicate": True,
    }
    assert post(server, per_group_batch(seq=1)).json()["duplicate"] is False
    assert len(read_rows(server.db_url, "collectives", "job-a")) == 3

    # The rank's mesh is the latest it sent; a batch without one keeps it.
    moved = {"pp": [1, 4]}
    assert post(server, per_group_batch(seq=2, mesh=moved)).status_code == 200
    assert post(server, make_batch(seq=3)).status_code == 200
    (rank,) = read_rows(server.db_url, "ranks", "job-a")
    assert rank["mesh"] == moved


def test_collectives_without_a_group_are_stored_in_the_default_group(
    server: RunningServer,
) -> None:
    assert post(server, make_batch()).status_code == 200
    old = make_batch(seq=1)
    old["collectives"]["group"] = [None, "0"]  # a null group is the default group too
    assert post(server, old).status_code == 200

    coll = read_rows(server.db_url, "collectives", "job-a")
    # Step 11 in group "0" is another row than step 11 in the unknown group.
    assert sorted((r["step"], r["group"], r["wait_s"], r["first_seq"]) for r in coll) == [
        (10, "", None, None),
        (11, "", None, None),
        (11, "0", None, None),
    ]
    (rank,) = read_rows(server.db_url, "ranks", "job-a")
    assert rank["mesh"] is None
    assert not [
        r
        for r in read_rows(server.db_url, "job_columns", "job-a")
        if r["table_name"] == "collectives"
    ]


@pytest.mark.parametrize(
    ("mesh", "message"),
    [
        ([1, 2], "source.mesh must be of type json"),
        ({"tp": [2, 2]}, "source.mesh.tp must be [coordinate, size]"),
        ({"tp": [-1, 2]}, "source.mesh.tp must be [coordinate, size]"),
        ({"tp": [0, 2, 1]}, "source.mesh.tp must be [coordinate, size]"),
        ({"tp": [0.0, 2]}, "source.mesh.tp must be [coordinate, size]"),
        ({"tp": [True, 2]}, "source.mesh.tp must be [coordinate, size]"),
        ({"tp": "0/2"}, "source.mesh.tp must be [coordinate, size]"),
        ({"x" * 65: [0, 2]}, "source.mesh dimension names must be 1 to 64 characters"),
        ({"": [0, 2]}, "source.mesh dimension names must be 1 to 64 characters"),
        ({f"d{i}": [0, 2] for i in range(9)}, "source.mesh has 9 dimensions, more than 8"),
    ],
)
def test_a_bad_source_mesh_is_named_and_nothing_is_stored(
    server: RunningServer, mesh: Any, message: str
) -> None:
    resp = post(server, per_group_batch(mesh=mesh))
    assert resp.status_code == 422
    assert message in resp.json()["detail"]
    assert set(stored_counts(server, "job-a").values()) == {0}


ACCEPTED = {"steps": 3, "collectives": 2, "gpu": 2, "events": 1}


def test_a_node_bundle_stores_each_batch_and_answers_each_in_order(server: RunningServer) -> None:
    """`stepscope run`'s relay: one request for a node's ranks; a bad batch is rejected alone."""
    bad = make_batch(rank=2)
    bad["steps"]["data_s"][1] = -1.0
    stored_before = make_batch(rank=4)
    assert post(server, stored_before).status_code == 200
    bundle = {"batches": [make_batch(rank=1), bad, make_batch(rank=3), stored_before]}
    resp = post(server, bundle, gzip_body=True)
    assert resp.status_code == 200
    assert resp.json() == {
        "results": [
            {"status": 200, "accepted": ACCEPTED, "duplicate": False},
            {"status": 422, "detail": "steps.data_s must not be negative"},
            {"status": 200, "accepted": ACCEPTED, "duplicate": False},
            {"status": 200, "accepted": ACCEPTED, "duplicate": True},
        ]
    }
    steps = read_rows(server.db_url, "steps", "job-a")
    assert sorted({(r["rank"], r["step"]) for r in steps}) == [
        (rank, step) for rank in (1, 3, 4) for step in (10, 11, 12)
    ]
    batches = read_rows(server.db_url, "ingest_batches", "job-a")
    assert sorted(b["rank"] for b in batches) == [1, 3, 4]
    # The rejected rank's corrected batch is stored under the same seq.
    assert post(server, {"batches": [make_batch(rank=2)]}).json()["results"][0]["status"] == 200
    assert stored_counts(server, "job-a")["steps"] == 12


@pytest.mark.parametrize(
    ("bundle", "status", "detail"),
    [
        ({"batches": []}, 422, "batches must be a non-empty list"),
        ({"batches": "all"}, 422, "batches must be a non-empty list"),
        ({"batches": [make_batch()], "seq": 1}, 422, "unknown field(s): seq"),
        ({"batches": [make_batch(seq=s) for s in range(1025)]}, 413, "more than 1024"),
    ],
)
def test_a_malformed_bundle_is_refused_whole(
    server: RunningServer, bundle: dict[str, Any], status: int, detail: str
) -> None:
    resp = post(server, bundle)
    assert resp.status_code == status
    assert detail in resp.json()["detail"]
    assert set(stored_counts(server, "job-a").values()) == {0}
