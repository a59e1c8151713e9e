"""The read path at scale (DESIGN §6–7): a 1024-rank × 10,000-step job on SQLite and PostgreSQL.

The job (steps, collectives and GPU samples as synthetic.generate makes them, with stragglers)
is stored through the store's own bulk writer (BatchWriter: group commit, executemany on
SQLite, binary COPY on PostgreSQL), all but its last 100 steps; a full analysis builds the
rollups. Then, per engine, next to the limit or the previous code path in the same run:

1. a full load of the job's step rows into polars, rows/s: the Arrow-native read
   (stepscope.store.frames) beside a raw fetch by the engine's fastest client (connectorx,
   the limit) and the row-wise `load_frame` this replaced (timed on the first ranks' rows);
2. one incremental analyzer pass after 100 new steps of every rank arrive (goal ≤ 1 s): in a
   live server, whose previous pass kept its last segment's rows in memory, and after a
   restart (the segment read from the store); beside a full re-analysis of the job (what
   every background pass did before);
3. each query function of stepscope.query: its first call after the pass (rank_table and
   heatmap are computed then and reused until the next pass) and p50/p99 over repeated
   calls (goal p99 ≤ 100 ms), and the payload of step_series (2,000 points) and heatmap
   (1,024 × 1,000) (goal ≤ 1 MB);
4. the rollup tables' size against the raw tables'.

    python benchmarks/query_scale.py [--ranks 1024] [--steps 10000] [--engines sqlite,postgresql]
"""

from __future__ import annotations

import argparse
import gzip
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import polars as pl
import sqlalchemy as sa

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stepscope import query, schema  # noqa: E402
from stepscope.analysis import analyze  # noqa: E402
from stepscope.pipeline.job_pass import JobAnalyzer  # noqa: E402
from stepscope.pipeline.resources import PassResources  # noqa: E402
from stepscope.store import frames, tables  # noqa: E402
from stepscope.store.engine import make_engine  # noqa: E402
from stepscope.store.migrate import upgrade  # noqa: E402
from stepscope.store.writer import BatchWriter  # noqa: E402
from stepscope.synthetic.generate import JobSpec, SlowNode, Straggler, SynthJob, generate  # noqa: E402
from tests.support import fresh_postgres_database  # noqa: E402

JOB_ID = "scale"
NEW_STEPS = 100
STEPS_PER_BATCH = 500
PASS_GOAL_S = 1.0
QUERY_GOAL_MS = 100.0
PAYLOAD_GOAL_BYTES = 1_000_000
OLD_PATH_RANKS = 32
"""The row-wise load_frame is timed on this many ranks' rows (it needs minutes for all)."""


def make_job(num_ranks: int, num_steps: int) -> SynthJob:
    return generate(
        JobSpec(
            job_id=JOB_ID,
            num_ranks=num_ranks,
            num_steps=num_steps,
            start_ts=time.time() - num_steps * 0.5,
            stragglers=(
                Straggler(ranks=(7,), factor=1.15, cause="compute", from_step=num_steps // 5),
                Straggler(
                    ranks=(num_ranks // 3,), factor=1.1, cause="data", from_step=num_steps // 2
                ),
            ),
            slow_nodes=(
                SlowNode(
                    node=num_ranks // 16, factor=1.1, cause="compute", from_step=num_steps * 4 // 5
                ),
            ),
            busbw_shifts=((num_steps * 9 // 10, 0.6),),
        )
    )


def batches(job: SynthJob, first_step: int, last_step: int) -> Iterator[dict[str, Any]]:
    """Wire-shaped batches (sections with job_id and rank) of every rank for steps first..last."""
    spec = job.spec
    sections = {"steps": job.steps, "collectives": job.collectives, "gpu": job.gpu}
    bounds = {
        name: np.searchsorted(cols["rank"], np.arange(spec.num_ranks + 1))
        for name, cols in sections.items()
    }
    step_ts = job.steps["ts"]
    meta = {k: v for k, v in job.job.items() if k not in ("status", "ended_at", "started_at")}
    for start in range(first_step, last_step + 1, STEPS_PER_BATCH):
        stop = min(start + STEPS_PER_BATCH, last_step + 1)
        for rank in range(spec.num_ranks):
            out: dict[str, dict[str, list[Any]]] = {}
            for name, cols in sections.items():
                lo, hi = bounds[name][rank], bounds[name][rank + 1]
                if name == "gpu":
                    rank_rows = bounds["steps"][rank]
                    t0 = step_ts[rank_rows + start]
                    t1 = step_ts[rank_rows + stop] if stop < spec.num_steps else np.inf
                    a, b = lo + np.searchsorted(cols["ts"][lo:hi], [t0, t1])
                else:
                    a, b = lo + np.searchsorted(cols["step"][lo:hi], [start, stop])
                if b > a:
                    part = {c: v[a:b].tolist() for c, v in cols.items()}
                    part["job_id"] = [JOB_ID] * (b - a)
                    out[name] = part
            yield {
                "job": meta,
                "source": {"rank": rank, "node": job.nodes[rank], "incarnation": "bench"},
                "seq": start,
                "sections": out,
            }


def store_batches(engine: sa.Engine, job: SynthJob, first: int, last: int) -> tuple[int, float]:
    """Rows written and seconds, through the group-committing BatchWriter."""
    writer = BatchWriter(engine)
    t0 = time.perf_counter()
    pending, rows = [], 0
    for batch in batches(job, first, last):
        rows += sum(len(s["rank"]) for s in batch["sections"].values())
        pending.append(batch)
    writer.submit(pending).result()
    elapsed = time.perf_counter() - t0
    writer.close()
    return rows, elapsed


def verdict(ok: bool) -> str:
    return "ok" if ok else "MISSED"


def best_of(fn: Callable[[], Any], repeat: int = 3) -> tuple[float, Any]:
    best, result = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - t0)
    return best, result


def old_load_frame(engine: sa.Engine, job_id: str, max_rank: int) -> pl.DataFrame:
    """The row-wise load_frame this issue replaced (SQLAlchemy rows → polars), for comparison."""
    t = tables.steps
    query_ = (
        sa.select(t).where(t.c.job_id == job_id, t.c.rank < max_rank).order_by(t.c.rank, t.c.step)
    )
    with engine.connect() as conn:
        result = conn.execute(query_)
        columns = list(result.keys())
        rows = [tuple(r) for r in result]
    spec = schema.STEPS
    types = {"str": pl.String, "int": pl.Int64, "float": pl.Float64}
    return pl.DataFrame(
        rows, schema={c: types[spec.column(c).dtype] for c in columns}, orient="row"
    )


def raw_limit(engine: sa.Engine, db_url: str) -> tuple[float, int]:
    """Seconds and rows of the fastest raw fetch of the job's step rows (connectorx)."""
    import connectorx as cx

    if db_url.startswith("sqlite"):
        uri = "sqlite://" + str(Path(engine.url.database or "").resolve())
    else:
        uri = db_url.replace("postgresql+psycopg://", "postgresql://")
    names = ", ".join(c.name for c in tables.steps.c)
    sql = f"SELECT {names} FROM steps WHERE job_id = '{JOB_ID}' ORDER BY rank, step"
    seconds, table = best_of(lambda: cx.read_sql(uri, sql, return_type="arrow"))
    return seconds, table.num_rows


def percentiles_ms(fn: Callable[[], Any], repeat: int) -> tuple[float, float, float]:
    """(first call, p50, p99) in ms."""
    t0 = time.perf_counter()
    fn()
    first = (time.perf_counter() - t0) * 1000
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
    times.sort()
    p99 = times[min(len(times) - 1, int(round(0.99 * (len(times) - 1))))]
    return first, statistics.median(times), p99


def payload(doc: Any) -> tuple[int, int]:
    body = orjson.dumps(doc, option=orjson.OPT_SERIALIZE_NUMPY)
    return len(body), len(gzip.compress(body, 6))


def table_bytes(engine: sa.Engine) -> dict[str, int]:
    names = [t.name for t in tables.Base.metadata.sorted_tables]
    with engine.connect() as conn:
        if engine.dialect.name == "sqlite":
            rows = conn.exec_driver_sql("SELECT name, SUM(pgsize) FROM dbstat GROUP BY name").all()
            sizes = dict(rows)
            # A table's indexes (sqlite_autoindex_<table>_N) count with it.
            return {
                n: sum(
                    v for k, v in sizes.items() if k == n or k.startswith(f"sqlite_autoindex_{n}_")
                )
                for n in names
            }
        return {
            n: int(conn.exec_driver_sql(f"SELECT pg_total_relation_size('{n}')").scalar_one())
            for n in names
        }


def bench(name: str, db_url: str, job: SynthJob, args: argparse.Namespace) -> None:
    print(f"\n=== {name} ===")
    engine = make_engine(db_url)
    upgrade(engine)
    last_old = job.spec.num_steps - 2 * NEW_STEPS - 1
    rows, seconds = store_batches(engine, job, 0, last_old)
    print(
        f"stored {rows:,} rows (all but the last {2 * NEW_STEPS} steps) in {seconds:.1f} s "
        f"through BatchWriter ({rows / seconds:,.0f} rows/s)"
    )
    t0 = time.perf_counter()
    server = PassResources()  # what the server's scheduler keeps between passes
    JobAnalyzer(engine, JOB_ID, grace_s=0.0, resources=server).run(full=True)
    print(f"full analysis building the rollups: {time.perf_counter() - t0:.1f} s")

    print("\n1. full load of the job's step rows into polars")
    limit_s, num_rows = raw_limit(engine, db_url)
    new_s, frame = best_of(lambda: frames.read_frame(engine, "steps", JOB_ID))
    assert frame.height == num_rows
    old_s, old = best_of(lambda: old_load_frame(engine, JOB_ID, OLD_PATH_RANKS), repeat=1)
    limit, new, before = num_rows / limit_s, num_rows / new_s, old.height / old_s
    print(f"   raw fetch, connectorx (limit): {limit:12,.0f} rows/s  ({limit_s:.2f} s)")
    print(
        f"   frames.read_frame (Arrow):     {new:12,.0f} rows/s  ({new_s:.2f} s)"
        f"  = {new / limit:.2f} of the limit [goal >= 0.70: {verdict(new >= 0.7 * limit)}]"
    )
    print(
        f"   old row-wise load_frame:       {before:12,.0f} rows/s  ({old.height:,} rows of "
        f"{OLD_PATH_RANKS} ranks in {old_s:.2f} s) = {before / limit:.2f} of the limit"
    )
    del frame, old

    print(f"\n2. incremental pass after {NEW_STEPS} new steps on all {job.spec.num_ranks} ranks")
    for when, first in (("live server", last_old + 1), ("after a restart", last_old + 101)):
        if when == "after a restart":
            server.close()
            server = PassResources()  # what a new server process starts with
        rows, seconds = store_batches(engine, job, first, first + NEW_STEPS - 1)
        t0 = time.perf_counter()
        result = JobAnalyzer(engine, JOB_ID, grace_s=0.0, resources=server).run()
        pass_s = time.perf_counter() - t0
        print(
            f"   {when:16s} stored {rows:,} new rows in {seconds:.1f} s; pass: {pass_s:.2f} s, "
            f"{result.rolled_up_steps} steps rolled up, segments {result.analysed_segments}, "
            f"{len(result.findings)} findings [goal <= {PASS_GOAL_S:.0f} s: "
            f"{verdict(pass_s <= PASS_GOAL_S)}]"
        )
    t0 = time.perf_counter()
    steps = frames.read_frame(engine, "steps", JOB_ID)
    collectives = frames.read_frame(engine, "collectives", JOB_ID)
    read_s = time.perf_counter() - t0
    analyze(steps.drop("job_id"), collectives=collectives.drop("job_id"), job=dict(job.job))
    print(
        f"   beside it, a full re-analysis (what each pass did before): read {read_s:.1f} s + "
        f"analyze {time.perf_counter() - t0 - read_s:.1f} s"
    )
    del steps, collectives
    server.close()

    print(
        f"\n3. queries: first call after the pass, p50 / p99 over {args.repeat} calls "
        f"[goal p99 <= {QUERY_GOAL_MS:.0f} ms]"
    )
    last = job.spec.num_steps - 1
    calls: dict[str, Callable[[], Any]] = {
        "list_jobs": lambda: query.list_jobs(engine, query.JobFilters()),
        "job_summary": lambda: query.job_summary(engine, JOB_ID),
        "step_series(step_s, p50)": lambda: query.step_series(engine, JOB_ID, "step_s", "p50"),
        "step_series(tokens_per_s)": lambda: query.step_series(engine, JOB_ID, "tokens_per_s"),
        "step_series(rank=7)": lambda: query.step_series(engine, JOB_ID, "step_s", rank=7),
        "step_series(last 500 steps)": lambda: query.step_series(
            engine, JOB_ID, "compute_s", "max", from_step=last - 500
        ),
        "rank_table": lambda: query.rank_table(engine, JOB_ID),
        "heatmap(1024 x 1000)": lambda: query.heatmap(
            engine, JOB_ID, "compute_s", max_ranks=1024, max_steps=1000
        ),
        "collective_stats": lambda: query.collective_stats(engine, JOB_ID),
        "gpu_series(all devices)": lambda: query.gpu_series(engine, JOB_ID),
        "gpu_series(rank=7)": lambda: query.gpu_series(engine, JOB_ID, rank=7),
        "findings": lambda: query.findings(engine, JOB_ID),
    }
    for label, fn in calls.items():
        first, p50, p99 = percentiles_ms(fn, args.repeat)
        print(
            f"   {label:30s} {first:8.1f}, {p50:8.1f} / {p99:8.1f} ms  "
            f"[{verdict(p99 <= QUERY_GOAL_MS)}]"
        )
    series = query.step_series(engine, JOB_ID, "step_s", "p50", max_points=2000)
    raw, zipped = payload({"step": series.step, "value": series.value})
    print(
        f"   payload step_series (2,000 points): {raw:,} B JSON, {zipped:,} B gzip "
        f"[goal <= 1 MB: {verdict(min(raw, zipped) <= PAYLOAD_GOAL_BYTES)}]"
    )
    heat = query.heatmap(engine, JOB_ID, "compute_s", max_ranks=1024, max_steps=1000)
    raw, zipped = payload(heat.encode())
    print(
        f"   payload heatmap {heat.values.shape[0]} x {heat.values.shape[1]}: {raw:,} B JSON, "
        f"{zipped:,} B gzip [goal <= 1 MB: {verdict(min(raw, zipped) <= PAYLOAD_GOAL_BYTES)}]"
    )

    print("\n4. storage")
    sizes = table_bytes(engine)
    raw_tables = ("steps", "collectives", "gpu_samples", "events", "ingest_batches")
    rollup_tables = tuple(t.name for t in tables.ROLLUP_TABLES)
    raw_total = sum(sizes[n] for n in raw_tables)
    rollup_total = sum(sizes[n] for n in rollup_tables)
    for n in (*raw_tables, *rollup_tables):
        print(f"   {n:16s} {sizes[n] / 2**20:10.1f} MiB")
    print(
        f"   rollups {rollup_total / 2**20:.1f} MiB = {rollup_total / raw_total:.1%} of the raw "
        f"tables' {raw_total / 2**20:.1f} MiB"
    )
    engine.dispose()


@contextmanager
def sqlite_url() -> Iterator[str]:
    with tempfile.TemporaryDirectory() as directory:
        yield f"sqlite:///{directory}/bench.db"


Bench = Callable[[str, str, SynthJob, argparse.Namespace], None]


def run(bench_engine: Bench, description: str, *, repeat: int) -> None:
    """Parse the common options, generate the job once, bench it on each engine asked for."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--engines", default="sqlite,postgresql")
    parser.add_argument("--repeat", type=int, default=repeat)
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    t0 = time.perf_counter()
    job = make_job(args.ranks, args.steps)
    print(
        f"generated {args.ranks} ranks x {args.steps} steps in {time.perf_counter() - t0:.1f} s: "
        f"steps {len(job.steps['step']):,}, collectives {len(job.collectives['step']):,}, "
        f"gpu {len(job.gpu['ts']):,} rows"
    )
    for name in args.engines.split(","):
        context = sqlite_url() if name == "sqlite" else fresh_postgres_database()
        with context as url:
            bench_engine(name, url, job, args)


if __name__ == "__main__":
    run(bench, __doc__.splitlines()[0], repeat=30)
