"""Hang attribution through HTTP (#19): simulated 3-D parallel jobs (dp x tp x pp) at 1,024
and 16,384 ranks, hangs of the four classes with 1-3 culprits injected one after another,
every rank's reports POSTed to a real `stepscope serve` (a node's 8 reports per request, as
a list, or with --one-per-request one each; many keep-alive connections in parallel).

Per hang: every rank's heartbeat of a job making progress (which closes the previous hang),
the heartbeats live ranks send while stalled, then every rank's hang report. Printed: top-1
culprit accuracy, exact culprit set, class, exact collective (group, op, seq), the time from
the last report's answer to the stored finding that reflects every report, closing with the
time lost, and false hangs on clean and checkpointing jobs.
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import random
import statistics
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import orjson
import sqlalchemy as sa

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.ingest import Conn  # noqa: E402
from stepscope import schema  # noqa: E402
from stepscope.analysis.hangs.culprits import RankReport, attribute_hang  # noqa: E402
from stepscope.store import tables  # noqa: E402
from stepscope.store.engine import make_engine  # noqa: E402
from stepscope.synthetic.hangs import (  # noqa: E402
    Layout,
    checkpointing,
    heartbeats,
    inject,
    report,
)
from tests.live_server import RunningServer, run_server  # noqa: E402
from tests.support import fresh_postgres_database  # noqa: E402

LAYOUTS = {1024: Layout(dp=16, tp=8, pp=8), 16384: Layout(dp=64, tp=8, pp=32)}


BY_NODE = True
"""POST a node's reports together (a list), as a node-level sender would; else one a request."""


async def post_all(conns: list[Conn], docs: list[dict[str, Any]]) -> float:
    """POST every report (gzip JSON; a node's together under BY_NODE), spread over the
    connections; wall time of the last answer."""
    if BY_NODE:
        by_node: dict[Any, list[dict[str, Any]]] = {}
        for d in docs:
            by_node.setdefault(d["node"], []).append(d)
        bodies = [gzip.compress(orjson.dumps(group), 1) for group in by_node.values()]
    else:
        bodies = [gzip.compress(orjson.dumps(d), 1) for d in docs]

    async def drain(conn: Conn, share: list[bytes]) -> None:
        for body in share:
            status, payload = await conn.post("/v1/hangs", body)
            if status != 200:
                raise RuntimeError(f"HTTP {status}: {payload[:200]!r}")

    await asyncio.gather(*(drain(c, bodies[i :: len(conns)]) for i, c in enumerate(conns)))
    return time.time()


def latest_hang(engine: sa.Engine, job_id: str) -> schema.Finding | None:
    t = tables.findings
    with engine.connect() as conn:
        row = (
            conn.execute(
                sa.select(t)
                .where(t.c.job_id == job_id, t.c.kind == "hang")
                .order_by(t.c.id.desc())
                .limit(1)
            )
            .mappings()
            .first()
        )
    return None if row is None else schema.Finding(**{k: row[k] for k in schema.FINDINGS.names})


def ranks_seen(f: schema.Finding) -> int:
    by_state = f.evidence["ranks_by_state"]
    waiting = sum(w["num_ranks"] for w in by_state["waiting"].values())
    return waiting + by_state["num_elsewhere"] + by_state["num_silent"]


def wait_until(check: Any, timeout_s: float, poll_s: float = 0.02) -> float | None:
    """Wall time at which `check()` first held; None after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return time.time()
        time.sleep(poll_s)
    return None


def run_scale(
    server: RunningServer, world_size: int, num_hangs: int, seed: int, num_conns: int
) -> dict[str, Any]:
    layout = LAYOUTS[world_size]
    rng = random.Random(seed)
    job_id = f"hangs-{world_size}"
    engine = make_engine(server.db_url)
    port = server.port
    classes: list[schema.HangClass] = list(schema.HANG_CLASSES)
    out: dict[str, Any] = {"n": 0, "top1": 0, "exact_set": 0, "cls": 0, "coll": 0, "lat": []}
    out |= {"closed": 0, "lost_ok": 0, "wrong": []}

    async def go() -> None:
        conns = [Conn("127.0.0.1", port) for _ in range(num_conns)]
        prev_since: float | None = None
        plan = [(classes[k % 4], 1 + k // 4 % 3) for k in range(num_hangs)]
        for k, (hang_class, num_culprits) in enumerate(plan):
            t0 = 1_767_000_000.0 + 100.0 * k
            base_seq, step = 100 + 10 * k, 30 + k
            hang = inject(
                layout,
                job_id,
                hang_class,
                num_culprits,
                ts=t0 + 1,
                step=step,
                base_seq=base_seq,
                rng=rng,
                hang_after_s=3.0,
            )
            # The job makes progress (closing the previous hang); a rank about to freeze sends
            # nothing more, so its latest report stays the previous hang's.
            frozen = set(hang.culprits) if hang_class == "silent" else set()
            progress = [
                doc
                for doc in heartbeats(layout, job_id, ts=t0, step=step, base_seq=base_seq)
                if doc["rank"] not in frozen
            ]
            for doc in progress:
                doc["last_progress_ts"] = t0 - 0.1
            await post_all(conns, progress)
            if prev_since is not None:
                closed = wait_until(
                    lambda: (
                        (f := latest_hang(engine, job_id)) is not None and "closed_at" in f.evidence
                    ),
                    5.0,
                )
                f = latest_hang(engine, job_id)
                if closed and f is not None:
                    out["closed"] += 1
                    lost = f.evidence["time_lost_s"]
                    out["lost_ok"] += abs(lost - (t0 - 0.1 - prev_since)) < 1e-6
            last = await post_all(conns, hang.reports)
            found = wait_until(
                lambda: (
                    (f := latest_hang(engine, job_id)) is not None
                    and "closed_at" not in f.evidence
                    and ranks_seen(f) == world_size
                ),
                10.0,
            )
            f = latest_hang(engine, job_id)
            out["n"] += 1
            if found is None or f is None or "closed_at" in f.evidence:
                out["wrong"].append((k, hang_class, "no finding"))
                prev_since = None
                continue
            out["lat"].append(max(0.0, found - last))
            e = f.evidence
            out["top1"] += f.ranks[0] in hang.culprits
            out["exact_set"] += f.ranks == hang.culprits
            out["cls"] += e["class"] == hang_class
            ok = (e["group_name"], e["op"], e["seq"]) == (hang.group, hang.op, hang.seq)
            out["coll"] += ok
            if not (ok and f.ranks == hang.culprits and e["class"] == hang_class):
                out["wrong"].append((k, hang_class, f.ranks[:4], hang.culprits[:4], e["op"]))
            prev_since = e["since_ts"]
            if (k + 1) % 50 == 0:  # running figures, in case the run is cut short
                print(
                    f"  {world_size} ranks, {k + 1} hangs so far: top-1 {out['top1']}, "
                    f"collective {out['coll']}, max latency {max(out['lat']):.3f} s",
                    flush=True,
                )
        for c in conns:
            c.close()

    asyncio.run(go())
    engine.dispose()
    return out


def false_hangs(server: RunningServer, world_size: int, num_conns: int) -> tuple[int, int]:
    """Hang findings on a clean job (progressing heartbeats, some ranks inside collectives)
    and on a job checkpointing for 30 s (rank 0 in a declared phase, the others waiting)."""
    layout = LAYOUTS[world_size]
    engine = make_engine(server.db_url)

    async def go() -> None:
        conns = [Conn("127.0.0.1", server.port) for _ in range(num_conns)]
        for k in range(3):
            docs = heartbeats(layout, f"clean-{world_size}", ts=1e9 + k * 2, step=k, base_seq=k)
            for doc in docs[::7]:
                group = doc["frontiers"][0]["group"]
                doc["blocked"] = {"group": group, "op": "all_reduce", "seq": k + 1, "since_ts": 1e9}
            await post_all(conns, docs)
        job = f"ckpt-{world_size}"
        saving = checkpointing(layout, job, ts=1e9 + 1, step=5, base_seq=50)
        # Every rank heartbeats while it waits, before its watchdog declares a hang.
        waiting = [
            {**d, "kind": "heartbeat", "ts": d["ts"] - 3, "stack": None, "stack_source": None}
            for d in saving
        ]
        await post_all(conns, waiting)
        await post_all(conns, saving)
        for c in conns:
            c.close()

    asyncio.run(go())
    time.sleep(1.0)
    counts = []
    for job in (f"clean-{world_size}", f"ckpt-{world_size}"):
        counts.append(int(latest_hang(engine, job) is not None))
    engine.dispose()
    return counts[0], counts[1]


def in_process(world_size: int, num_hangs: int, seed: int) -> dict[str, Any]:
    """The same hangs through the attribution the server runs (stepscope.analysis.hangs.culprits),
    without HTTP and the database: accuracy over many hangs, and the attribution's time."""
    layout = LAYOUTS[world_size]
    rng = random.Random(seed)
    classes: list[schema.HangClass] = list(schema.HANG_CLASSES)
    base = {d["rank"]: d for d in heartbeats(layout, "j", ts=0.0, step=30, base_seq=100)}
    parsed = {r: RankReport.of(d) for r, d in base.items()}
    out: dict[str, Any] = {"n": 0, "top1": 0, "exact_set": 0, "cls": 0, "coll": 0, "lat": []}
    for k in range(num_hangs):
        hang_class, num_culprits = classes[k % 4], 1 + k // 4 % 3
        hang = inject(layout, "j", hang_class, num_culprits, ts=1.0, step=30, base_seq=100, rng=rng)
        latest = dict(parsed)
        latest.update((d["rank"], RankReport.of(d)) for d in hang.reports)
        start = time.perf_counter()
        state = attribute_hang("j", list(latest.values()), silent_after_s=6.0)
        out["lat"].append(time.perf_counter() - start)
        f = state.finding
        out["n"] += 1
        if f is None:
            continue
        e = f.evidence
        out["top1"] += f.ranks[0] in hang.culprits
        out["exact_set"] += f.ranks == hang.culprits
        out["cls"] += e["class"] == hang_class
        out["coll"] += (e["group_name"], e["op"], e["seq"]) == (hang.group, hang.op, hang.seq)
    return out


def half_arrived_s(world_size: int) -> float:
    """The attribution's time when half the ranks wait in a world barrier (rank 0 in a
    checkpoint) and the other half have not reached it yet (heartbeats, in no collective):
    every late rank is asked when the barrier's waiters began and last reported."""
    layout = LAYOUTS[world_size]
    docs = {d["rank"]: d for d in checkpointing(layout, "j", ts=1.0, step=30, base_seq=100)}
    seqs = dict.fromkeys(("tp", "dp", "pp", "world"), (100, 100))
    for rank in range(1, world_size // 2):
        docs[rank] = report(layout, "j", rank, ts=20.0, kind="heartbeat", step=30, seqs=seqs)
    reports = [RankReport.of(d) for d in docs.values()]
    start = time.perf_counter()
    attribute_hang("j", reports, silent_after_s=6.0)
    return time.perf_counter() - start


def figure(label: str, measured: object, goal: str) -> None:
    print(f"{label:<56} {measured!s:>10} {goal:>10}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hangs-1024", type=int, default=40, help="through HTTP")
    parser.add_argument("--hangs-16384", type=int, default=4, help="through HTTP")
    parser.add_argument("--in-process-1024", type=int, default=500)
    parser.add_argument("--in-process-16384", type=int, default=100)
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--postgres", action="store_true", help="PostgreSQL instead of SQLite")
    parser.add_argument(
        "--one-per-request",
        action="store_true",
        help="one report per request (default: a node's 8 ranks per request)",
    )
    args = parser.parse_args()
    global BY_NODE
    BY_NODE = not args.one_per_request
    how = "one report per request" if args.one_per_request else "a node's reports per request"
    print(f"hang attribution through HTTP ({'PostgreSQL' if args.postgres else 'SQLite'}, {how})")
    print(
        f"{'ranks':>6} {'hangs':>5} {'top-1':>7} {'exact set':>9} {'class':>7} "
        f"{'collective':>10} {'p50 s':>6} {'p99 s':>6} {'max s':>6} {'closed':>6} {'lost ok':>7} "
        f"{'setup':>6}"
    )
    totals = {"n": 0, "top1": 0, "coll": 0}
    max_lat_16k = 0.0
    falses = []
    for world_size, num_hangs in ((1024, args.hangs_1024), (16384, args.hangs_16384)):
        if not num_hangs:
            continue
        with ExitStack() as stack:
            db_url = stack.enter_context(fresh_postgres_database()) if args.postgres else None
            server = stack.enter_context(run_server(db_url))
            start = time.perf_counter()
            r = run_scale(
                server, world_size, num_hangs, seed=world_size, num_conns=args.connections
            )
            wall = time.perf_counter() - start
            falses.append((world_size, *false_hangs(server, world_size, args.connections)))
        n = r["n"]
        lat = sorted(r["lat"]) or [float("nan")]
        p99 = lat[min(len(lat) - 1, int(0.99 * len(lat)))]
        print(
            f"{world_size:>6} {n:>5} {r['top1'] / n:>7.1%} {r['exact_set'] / n:>9.1%} "
            f"{r['cls'] / n:>7.1%} {r['coll'] / n:>10.1%} {statistics.median(lat):>6.3f} "
            f"{p99:>6.3f} {lat[-1]:>6.3f} {r['closed']:>6} {r['lost_ok']:>7} {wall:>5.0f}s"
        )
        for wrong in r["wrong"][:5]:
            print("   wrong:", wrong)
        totals["n"] += n
        totals["top1"] += r["top1"]
        totals["coll"] += r["coll"]
        if world_size == 16384:
            max_lat_16k = lat[-1]
    print()
    print("the same simulation through the attribution alone (no HTTP, no database)")
    print(
        f"{'ranks':>6} {'hangs':>5} {'top-1':>7} {'exact set':>9} {'class':>7} "
        f"{'collective':>10} {'attribution p50 / max s':>24}"
    )
    bulk = {"n": 0, "top1": 0, "coll": 0}
    for world_size, num_hangs in ((1024, args.in_process_1024), (16384, args.in_process_16384)):
        if not num_hangs:
            continue
        r = in_process(world_size, num_hangs, seed=world_size + 1)
        n = r["n"]
        print(
            f"{world_size:>6} {n:>5} {r['top1'] / n:>7.1%} {r['exact_set'] / n:>9.1%} "
            f"{r['cls'] / n:>7.1%} {r['coll'] / n:>10.1%} "
            f"{statistics.median(r['lat']):>15.3f} / {max(r['lat']):.3f}"
        )
        for key in bulk:
            bulk[key] += r[key]
    n = max(totals["n"], 1)
    nb = max(bulk["n"], 1)
    print()
    figure("figure", "measured", "goal")
    figure("injected hangs through HTTP (4 classes, 1-3 culprits)", totals["n"], ">= 500")
    figure("  + through the attribution alone", bulk["n"], "")
    figure("top-1 culprit accuracy, HTTP", f"{totals['top1'] / n:.1%}", ">= 99 %")
    figure("top-1 culprit accuracy, attribution alone", f"{bulk['top1'] / nb:.1%}", ">= 99 %")
    figure("exact collective (group, op, seq), HTTP", f"{totals['coll'] / n:.1%}", ">= 99 %")
    figure("exact collective, attribution alone", f"{bulk['coll'] / nb:.1%}", ">= 99 %")
    figure("last report -> stored finding, max at 16,384 ranks", f"{max_lat_16k:.3f} s", "<= 1 s")
    half_s = half_arrived_s(16384)
    figure("attribution, half of 16,384 ranks not yet arrived", f"{half_s:.3f} s", "<= 1 s")
    for world_size, clean, ckpt in falses:
        figure(
            f"false hangs, clean / checkpointing job, {world_size:,} ranks",
            f"{clean} / {ckpt}",
            "0 / 0",
        )


if __name__ == "__main__":
    main()
