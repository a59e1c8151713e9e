"""Property-based fuzzing of the wire batch, through the real decoder, validator and writer:
each input is rejected whole with a 4xx that says why, or stored correctly; never an error
of another kind (a 500), never a partial write (every table's row count is checked)."""

from __future__ import annotations

import gzip
import json
import math
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stepscope.collector.validate import BatchError, decode_body, parse_batch, parse_document
from stepscope.store import tables
from stepscope.store.engine import make_engine
from stepscope.store.writer import BatchWriter

MAX_BODY_BYTES = 1 << 20
NUM_EXAMPLES = 1000
COUNTED = ("jobs", "ranks", "ingest_batches", "steps", "collectives", "gpu_samples", "events")

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
    | st.sampled_from(["", "\x00", "all_reduce", "1e309", "<script>", "'; DROP TABLE jobs; --"])
)
json_values = st.recursive(
    scalars,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)


@st.composite
def wire_batches(draw: st.DrawFn) -> dict[str, Any]:
    """A valid batch of a few rows, then up to three random replacements or deletions."""
    n = draw(st.integers(0, 4))
    steps = draw(st.lists(st.integers(0, 2**40), min_size=n, max_size=n))
    doc: dict[str, Any] = {
        "schema": 1,
        "job": {"job_id": draw(st.sampled_from(["fz-a", "fz-b"])), "world_size": 4},
        "source": {"rank": draw(st.integers(0, 3)), "incarnation": draw(st.text(max_size=6))},
        "seq": draw(st.integers(0, 50)),
        "steps": {
            "step": steps,
            "ts": [1.7e9 + s for s in range(n)],
            "step_s": [0.1] * n,
            "data_s": [0.01] * n,
        },
        "collectives": {
            "step": steps,
            "op": ["all_reduce"] * n,
            "group_size": [4] * n,
            "count": [1] * n,
            "bytes": [1024] * n,
            "busy_s": [0.01] * n,
        },
        "events": [{"ts": 1.7e9, "kind": "custom", "message": "m", "attributes": {"a": 1}}],
    }
    for _ in range(draw(st.integers(0, 3))):
        container, key = draw(st.sampled_from(list(places(doc))))
        if draw(st.booleans()) and isinstance(container, dict):
            del container[key]
        else:
            container[key] = draw(json_values)
    return doc


def places(value: Any) -> Iterator[tuple[Any, Any]]:
    """Every (container, key) of a JSON value, at any depth."""
    items = value.items() if isinstance(value, dict) else enumerate(value)
    for key, child in list(items):
        yield value, key
        if isinstance(child, dict | list) and child:
            yield from places(child)


def _counts(engine: sa.Engine) -> dict[str, int]:
    with engine.connect() as conn:
        return {
            name: conn.execute(sa.text(f'SELECT count(*) FROM "{name}"')).scalar_one()
            for name in COUNTED
        }


def _stored_steps(engine: sa.Engine, job_id: str, rank: int, steps: list[int]) -> int:
    t = tables.steps
    query = sa.select(sa.func.count()).where(
        t.c.job_id == job_id, t.c.rank == rank, t.c.step.in_(steps)
    )
    with engine.connect() as conn:
        return int(conn.execute(query).scalar_one())


@pytest.fixture
def writer(db_url: str) -> Iterator[BatchWriter]:
    engine = make_engine(db_url)
    writer = BatchWriter(engine)
    yield writer
    writer.close()
    engine.dispose()


def test_a_fuzzed_batch_is_rejected_whole_with_a_4xx_or_stored_right(writer: BatchWriter) -> None:
    outcomes: dict[str, int] = {"rejected": 0, "stored": 0}

    @settings(
        max_examples=NUM_EXAMPLES,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(doc=wire_batches(), gzipped=st.booleans())
    def check(doc: dict[str, Any], gzipped: bool) -> None:
        body = json.dumps(doc, allow_nan=True).encode()  # NaN and Infinity as JS writes them
        if gzipped:
            body = gzip.compress(body)
        before = _counts(writer.engine)
        rejected: BatchError | None = None
        try:
            batch = parse_batch(
                decode_body(
                    body, content_encoding="gzip" if gzipped else None, max_bytes=MAX_BODY_BYTES
                )
            )
        except BatchError as exc:
            rejected = exc
        if rejected is not None:
            assert 400 <= rejected.status < 500
            assert str(rejected)  # says what is wrong
            assert _counts(writer.engine) == before, "a rejected batch left rows behind"
            outcomes["rejected"] += 1
            return
        result = writer.write(
            job=batch.job, source=batch.source, seq=batch.seq, sections=batch.sections
        )
        after = _counts(writer.engine)
        if result.duplicate:
            assert after == before
        else:
            assert after["ingest_batches"] == before["ingest_batches"] + 1
            grown = {
                "steps": "steps",
                "collectives": "collectives",
                "gpu_samples": "gpu",
                "events": "events",
            }
            for table, section in grown.items():
                assert 0 <= after[table] - before[table] <= result.accepted[section]
        steps = batch.sections.get("steps", {}).get("step", [])
        if steps and not result.duplicate:  # a resent key is trusted: its first copy stands
            assert all(isinstance(s, int) and not math.isnan(s) for s in steps)
            stored = _stored_steps(writer.engine, batch.job["job_id"], batch.source["rank"], steps)
            assert stored == len(set(steps))
        outcomes["stored"] += 1

    check()
    assert outcomes["rejected"] > 100
    assert outcomes["stored"] > 100


def test_a_fuzzed_bundle_treats_each_batch_as_it_would_be_alone(writer: BatchWriter) -> None:
    """A node's bundle is refused whole (a 4xx: not JSON, NaN anywhere), or each batch gets
    the verdict it gets alone; only the valid ones are stored, each whole (the claims grow by
    exactly their number)."""
    outcomes = {"refused whole": 0, "batch by batch": 0}

    @settings(
        max_examples=NUM_EXAMPLES // 4,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(docs=st.lists(wire_batches(), min_size=1, max_size=4))
    def check(docs: list[dict[str, Any]]) -> None:
        body = json.dumps({"batches": docs}, allow_nan=True).encode()
        try:
            parsed = parse_document(
                decode_body(body, content_encoding=None, max_bytes=MAX_BODY_BYTES)
            )
        except BatchError as exc:
            parsed = exc
        if isinstance(parsed, BatchError):
            assert 400 <= parsed.status < 500
            outcomes["refused whole"] += 1
            return
        outcomes["batch by batch"] += 1
        assert isinstance(parsed, list)
        assert len(parsed) == len(docs)
        for doc, item in zip(docs, parsed, strict=True):
            alone = json.loads(json.dumps(doc, allow_nan=True))
            try:
                expected: Any = parse_batch(alone)
            except BatchError as exc:
                expected = exc
            if isinstance(expected, BatchError):
                assert isinstance(item, BatchError)
                assert (item.status, str(item)) == (expected.status, str(expected))
            else:
                assert item == expected
        valid = [b for b in parsed if not isinstance(b, BatchError)]
        before = _counts(writer.engine)
        results = writer.submit(
            [
                {"job": b.job, "source": b.source, "seq": b.seq, "sections": b.sections}
                for b in valid
            ]
        ).result()
        fresh = {
            (b.job["job_id"], b.source["rank"], b.source["incarnation"], b.seq)
            for b, result in zip(valid, results, strict=True)
            if not result.duplicate
        }
        assert _counts(writer.engine)["ingest_batches"] == before["ingest_batches"] + len(fresh)

    check()
    assert outcomes["batch by batch"] > 100
