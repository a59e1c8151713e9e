"""Collector ingest throughput vs the raw bulk-insert limit, on SQLite and PostgreSQL.

1. Burst: a simulated job of --ranks ranks posts all its batches concurrently (one
   connection per rank) to a real `stepscope serve` on a loopback port; rows/s through HTTP
   (gzip, validation, idempotency, one transaction per batch) is compared with a raw bulk
   insert of the same rows into a fresh database of the same engine, using the store's own
   bulk path (executemany / binary COPY) and no HTTP, no validation, no idempotency record.
   The limit is printed twice: in one transaction per batch (the same write pattern) and
   in one transaction for everything (the physical ceiling).
2. Sustained: a --sustained-ranks job training at 1 step/s, each rank flushing every
   --flush-steps steps (default: the profiler's flush interval for the job's size), once with
   a request per rank and once with a bundle per node of 8 ranks (`stepscope run`'s node
   relay); prints whether the server keeps up (lag), its CPU per interval, PostgreSQL's.

The HTTP client is a minimal asyncio HTTP/1.1 client so that, on this one machine, it
takes as little CPU from the server as possible.
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import os
import sys
import tempfile
import time
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stepscope.collector.validate import decode_body, parse_batch  # noqa: E402
from stepscope.profiler.config import default_flush_interval_s  # noqa: E402
from stepscope.profiler.shipping.node_relay import bundle_body  # noqa: E402
from stepscope.store import tables  # noqa: E402
from stepscope.store.engine import make_engine  # noqa: E402
from stepscope.store.migrate import upgrade  # noqa: E402
from stepscope.store.writer import BatchWriter, insert_ignoring_duplicates  # noqa: E402
from stepscope.synthetic.generate import JobSpec, generate  # noqa: E402
from stepscope.synthetic.stream import batch_rounds  # noqa: E402
from tests.live_server import ServerProcess, run_server  # noqa: E402
from tests.support import fresh_postgres_database  # noqa: E402


class Conn:
    """One keep-alive HTTP/1.1 connection that POSTs gzip JSON bodies."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        for _attempt in range(3):
            if self.writer is None:
                self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
            assert self.reader is not None
            head = (
                f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
                f"Content-Encoding: gzip\r\nContent-Length: {len(body)}\r\n\r\n"
            ).encode()
            self.writer.write(head + body)
            status_line = await self.reader.readline()
            if not status_line:  # the server closed an idle keep-alive connection
                self.close()
                continue
            length = 0
            while (line := await self.reader.readline()) not in (b"\r\n", b""):
                name, _, value = line.decode().partition(":")
                if name.lower() == "content-length":
                    length = int(value)
            return int(status_line.split()[1]), await self.reader.readexactly(length)
        raise ConnectionError("server keeps closing the connection")

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


async def post_rounds(
    port: int,
    rounds: list[list[bytes]],
    round_interval_s: float,
    num_conns: int = 512,
    latencies_s: list[float] | None = None,
) -> tuple[float, int, list[float]]:
    """Post round k at k × interval (0: back to back); elapsed s, rows, per-round lag s (and
    each request's latency, into `latencies_s`)."""
    conns = [Conn("127.0.0.1", port) for _ in range(min(num_conns, len(rounds[0])))]
    rows = 0
    lags = []
    start = time.perf_counter()

    async def drain(conn: Conn, bodies: list[bytes]) -> int:
        accepted = 0
        for body in bodies:
            sent_at = time.perf_counter()
            status, payload = await conn.post("/v1/ingest", body)
            if latencies_s is not None:
                latencies_s.append(time.perf_counter() - sent_at)
            if status != 200:
                raise RuntimeError(f"HTTP {status}: {payload[:200]!r}")
            answer = orjson.loads(payload)
            for result in answer.get("results", [answer]):  # a bundle: one result per batch
                if result.get("status", 200) != 200:
                    raise RuntimeError(f"a batch of a bundle was refused: {result}")
                accepted += sum(result["accepted"].values())
        return accepted

    for k, bodies in enumerate(rounds):
        due = start + k * round_interval_s
        if round_interval_s and time.perf_counter() < due:
            await asyncio.sleep(due - time.perf_counter())
        shares = [bodies[i :: len(conns)] for i in range(len(conns))]
        rows += sum(
            await asyncio.gather(*(drain(c, b) for c, b in zip(conns, shares, strict=True)))
        )
        lags.append(time.perf_counter() - due)
    elapsed = time.perf_counter() - start
    for conn in conns:
        conn.close()
    return elapsed, rows, lags


def postgres_cpu_s() -> float:
    """CPU seconds used so far by this machine's running PostgreSQL processes (Linux; 0 when
    there are none, as on SQLite's runs)."""
    total_ticks = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            name, _, rest = stat.read_text().partition(") ")
        except OSError:  # the process ended
            continue
        if name.endswith("(postgres"):
            fields = rest.split()
            total_ticks += int(fields[11]) + int(fields[12])
    return total_ticks / os.sysconf("SC_CLK_TCK")


def raw_insert_rates(db_url: str, rounds: list[list[bytes]]) -> tuple[float, float]:
    """Rows/s of the same rows bulk-inserted directly: (per-batch transactions, one transaction)."""
    sections = [
        parse_batch(decode_body(b, content_encoding="gzip", max_bytes=1 << 30)).sections
        for bodies in rounds
        for b in bodies
    ]
    num_rows = sum(len(cols["rank"]) for batch in sections for cols in batch.values())
    rates = []
    for one_transaction in (False, True):
        engine = make_engine(db_url)
        with engine.begin() as conn:
            for t in tables.RECORD_TABLES.values():
                conn.execute(t.delete())
        start = time.perf_counter()
        if one_transaction:
            with engine.begin() as conn:
                for name in tables.RECORD_TABLES:
                    merged: dict[str, list[object]] = {}
                    for batch in sections:
                        for col, values in batch.get(name, {}).items():
                            merged.setdefault(col, []).extend(values)
                    if merged:
                        insert_ignoring_duplicates(conn, tables.RECORD_TABLES[name], merged)
        else:
            for batch in sections:
                with engine.begin() as conn:
                    for name, cols in batch.items():
                        insert_ignoring_duplicates(conn, tables.RECORD_TABLES[name], cols)
        rates.append(num_rows / (time.perf_counter() - start))
        engine.dispose()
    return rates[0], rates[1]


def job_rounds(num_ranks: int, num_steps: int, flush_steps: int) -> list[list[bytes]]:
    spec = JobSpec(
        job_id=f"bench-{num_ranks}-{time.time_ns()}",
        num_ranks=num_ranks,
        num_steps=num_steps,
        base_step_s=1.0,
        warmup_steps=0,
        start_ts=time.time(),
    )
    return batch_rounds(generate(spec), steps_per_batch=flush_steps)


def node_bundles(rounds: list[list[bytes]], node_ranks: int) -> list[list[bytes]]:
    """Each round's batches as `stepscope run`'s relays send them: one bundle per node."""
    if node_ranks == 1:
        return rounds
    return [
        [
            bundle_body([gzip.decompress(b) for b in bodies[i : i + node_ranks]])
            for i in range(0, len(bodies), node_ranks)
        ]
        for bodies in rounds
    ]


def bench_engine(name: str, db_url: str, args: argparse.Namespace) -> None:
    upgrade(make_engine(db_url))
    if not args.sustained_only:
        bench_burst(name, db_url, args)
    bench_sustained(db_url, args)


def bench_burst(name: str, db_url: str, args: argparse.Namespace) -> None:
    rounds = job_rounds(args.ranks, args.steps, args.flush_steps or 10)
    num_batches = sum(len(r) for r in rounds)
    with run_server(db_url) as server:
        elapsed, rows, _ = asyncio.run(post_rounds(server.port, rounds, 0.0))
    http_rate = rows / elapsed
    with tempfile.TemporaryDirectory() as tmp:
        raw_db = f"sqlite:///{tmp}/raw.db" if name == "sqlite" else db_url
        if name == "sqlite":
            upgrade(make_engine(raw_db))
        per_batch, single = raw_insert_rates(raw_db, rounds)
    print(
        f"\n[{name}] burst: {args.ranks} ranks x {args.steps} steps, {num_batches} batches "
        f"of {args.flush_steps or 10} steps, {rows} rows"
    )
    print(
        f"  HTTP ingest (gzip+validation+idempotency): {http_rate:>10,.0f} rows/s "
        f"({num_batches / elapsed:,.0f} batches/s)"
    )
    print(
        f"  raw bulk insert, a transaction per batch:  {per_batch:>10,.0f} rows/s  "
        f"ratio {http_rate / per_batch:.2f} (goal >= 0.5)"
    )
    print(
        f"  raw bulk insert, one transaction:          {single:>10,.0f} rows/s  "
        f"ratio {http_rate / single:.2f}"
    )


def bench_sustained(db_url: str, args: argparse.Namespace) -> None:
    # At 1 step/s, the profiler's default flush interval for the job's size, in steps.
    flush_steps = args.flush_steps or round(default_flush_interval_s(args.sustained_ranks))
    for node_ranks in args.node_ranks:  # a new job each time
        started = time.perf_counter()
        rounds = job_rounds(args.sustained_ranks, args.sustained_steps, flush_steps)
        made_s = time.perf_counter() - started
        bundled = node_bundles(rounds, node_ranks)
        sustained(db_url, args.sustained_ranks, flush_steps, bundled, made_s, node_ranks)


def sustained(
    db_url: str,
    num_ranks: int,
    flush_steps: int,
    rounds: list[list[bytes]],
    made_s: float,
    node_ranks: int,
) -> None:
    latencies_s: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        with ServerProcess(db_url, log_path=Path(tmp) / "server.log") as server:
            cpu_before_s, pg_before_s = server.cpu_s(), postgres_cpu_s()
            client_before_s = time.process_time()
            elapsed, rows, lags = asyncio.run(
                post_rounds(server.port, rounds, flush_steps, latencies_s=latencies_s)
            )
            server_cpu_s = server.cpu_s() - cpu_before_s
            pg_cpu_s = postgres_cpu_s() - pg_before_s
            client_cpu_s = time.process_time() - client_before_s
            peak_rss_bytes = server.peak_rss_bytes()
    trained_s = len(rounds) * flush_steps  # 1 step/s
    keeps_up = max(lags) < flush_steps
    busy = sum(lags) / len(lags) / flush_steps
    latencies_s.sort()
    p50_s = latencies_s[len(latencies_s) // 2]
    p99_s = latencies_s[min(len(latencies_s) - 1, int(len(latencies_s) * 0.99))]
    sender = "one request per rank" if node_ranks == 1 else f"a bundle per node of {node_ranks}"
    print(
        f"  sustained, {sender}: {num_ranks} ranks at 1 step/s, flush every "
        f"{flush_steps} steps ({len(rounds)} rounds of {len(rounds[0])} requests, made "
        f"in {made_s:.1f} s): "
        f"{rows} rows over {elapsed:.1f} s for {trained_s} s of training; "
        f"round lag max {max(lags):.2f} s, mean {sum(lags) / len(lags):.2f} s -> "
        f"{'keeps up' if keeps_up else 'FALLS BEHIND'}"
    )
    # On a shared machine the wall-clock share says as much about the neighbours as about the
    # server; its own CPU time per interval does not.
    cpu_busy = server_cpu_s / (len(rounds) * flush_steps)
    interval_s = len(rounds) * flush_steps
    on_postgres = db_url.startswith("postgresql")
    postgres = f"PostgreSQL {pg_cpu_s / interval_s:.0%}, " if on_postgres else ""
    print(
        f"  server CPU {server_cpu_s:.1f} s for {len(rounds)} rounds: {cpu_busy:.0%} of one core "
        f"per flush interval (goal <= 50%); beside it on this machine: {postgres}the simulated "
        f"ranks (this process) {client_cpu_s / interval_s:.0%}; load average "
        f"{os.getloadavg()[0]:.1f} on "
        f"{os.cpu_count()} CPUs"
    )
    print(
        f"  server wall-clock busy {busy:.0%} of each flush interval (goal <= 50%); ingest latency "
        f"p50 {p50_s * 1e3:.0f} ms, p99 {p99_s * 1e3:.0f} ms; server peak RSS "
        f"{peak_rss_bytes / 2**20:.0f} MiB"
    )


def path_costs(db_url: str, num_ranks: int, flush_steps: int) -> None:
    """CPU per batch of each stage of ingest, in this process (no HTTP): where to cut first."""
    rounds = job_rounds(num_ranks, flush_steps, flush_steps)
    bodies = [body for bodies in rounds for body in bodies]
    started = time.process_time()
    docs = [decode_body(b, content_encoding="gzip", max_bytes=1 << 30) for b in bodies]
    decoded = time.process_time()
    batches = [parse_batch(doc) for doc in docs]
    validated = time.process_time()
    engine = make_engine(db_url)
    upgrade(engine)
    writer = BatchWriter(engine)
    writer.submit(
        [{"job": b.job, "source": b.source, "seq": b.seq, "sections": b.sections} for b in batches]
    ).result()
    written = time.process_time()
    writer.close()
    engine.dispose()
    rows = sum(len(cols["rank"]) for b in batches for cols in b.sections.values())
    ms = 1e3 / len(bodies)  # per batch
    decode_ms, validate_ms = (decoded - started) * ms, (validated - decoded) * ms
    print(
        f"  path costs, {len(bodies)} batches of {rows / len(bodies):.0f} rows, CPU per batch: "
        f"gunzip + JSON {decode_ms:.2f} ms, validation {validate_ms:.2f} ms, "
        f"writer {(written - validated) * ms:.2f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument(
        "--flush-steps",
        type=int,
        default=None,
        help="steps per batch; at 1 step/s this is the flush interval in s (default: 10 in the "
        "burst; in the sustained run the profiler's default for the job's size, 30 at 16,384 "
        "ranks)",
    )
    parser.add_argument("--sustained-ranks", type=int, default=4096)
    parser.add_argument("--sustained-steps", type=int, default=60)
    parser.add_argument(
        "--node-ranks",
        type=lambda text: [int(n) for n in text.split(",")],
        default=[1, 8],
        help="ranks per request in the sustained run: 1 (each rank posts) and N (a node's "
        "relay bundles N ranks, as `stepscope run` does); comma-separated, each run in turn",
    )
    parser.add_argument("--engines", default="sqlite,postgresql")
    parser.add_argument(
        "--sustained-only", action="store_true", help="skip the burst and its raw-insert limit"
    )
    parser.add_argument(
        "--path-costs",
        type=int,
        default=0,
        metavar="RANKS",
        help="only print the CPU per batch of each ingest stage, for a job of RANKS ranks",
    )
    args = parser.parse_args()
    if args.path_costs:
        with fresh_postgres_database() as url:
            path_costs(url, args.path_costs, args.flush_steps or 10)
        return
    for name in args.engines.split(","):
        if name == "sqlite":
            with tempfile.TemporaryDirectory() as tmp:
                bench_engine(name, f"sqlite:///{tmp}/bench.db", args)
        else:
            with fresh_postgres_database() as url:
                bench_engine(name, url, args)


if __name__ == "__main__":
    main()
