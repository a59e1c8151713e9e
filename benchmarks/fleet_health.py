"""Fleet health (#21): suspect recall and precision over generated fleets, beside the naive
rule (flag a node that was a straggler in >= k jobs), and the time to recompute fleet health
after a job finishes at 10,000 jobs x 1,024 ranks of stored history.

Quality: fleets of 200-400 jobs over 64 nodes (stepscope.synthetic.fleet), three nodes
chronically 3-10 % slow (random nodes and factors per fleet), job-to-job noise of a node,
one-off slow (job, node) pairs. A job's node levels come from `job_levels` on the generated
rank x bucket own times; the model is `stepscope.analysis.fleet.health.fleet_health`. The naive
rule counts a node a straggler in a job when its excess there is >= 2 % (the straggler
detector's min_offset) and >= 3 standard errors.

Timing: 10,000 jobs of 128 nodes x 8 ranks (1.28 M node rows) over a fleet of 2,048 nodes
written into a SQLite file (and with --postgres into PostgreSQL); then a job finishes: its
levels from its 1,024-rank x 1,024-bucket own-time matrix, stored, and fleet health
recomputed (the query layer's cached read brings in the new rows, and the previous fit is
updated by them: `stepscope.analysis.fleet.health.add_jobs`).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np
import polars as pl
import sqlalchemy as sa

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stepscope.analysis.fleet.health import fleet_health  # noqa: E402
from stepscope.analysis.fleet.node_levels import job_levels  # noqa: E402
from stepscope.query import fleet as fleet_query  # noqa: E402
from stepscope.store import node_levels  # noqa: E402
from stepscope.store.engine import make_engine  # noqa: E402
from stepscope.store.migrate import upgrade  # noqa: E402
from stepscope.synthetic.fleet import FleetSpec, fleet_levels, slow_node_names  # noqa: E402
from stepscope.synthetic.generate import node_name  # noqa: E402

NAIVE_KS = (1, 2, 3, 5)
GOAL_S = 1.0


def naive_flags(levels: pl.DataFrame, k: int) -> set[str]:
    """Nodes that were a straggler (excess >= 2 % and >= 3 se) in at least k jobs."""
    own = levels.filter(pl.col("gpu") == "")
    straggler = (pl.col("excess").exp() - 1 >= 0.02) & (pl.col("excess") >= 3 * pl.col("se"))
    counts = own.filter(straggler).group_by("node").agg(pl.len().alias("n"))
    return set(counts.filter(pl.col("n") >= k)["node"].to_list())


def quality(num_fleets: int, harsh: bool) -> None:
    rng = np.random.default_rng(12345 + harsh)
    found = {"model": [0, 0, 0]} | {f"naive k>={k}": [0, 0, 0] for k in NAIVE_KS}
    errors: list[float] = []
    for seed in range(num_fleets):
        slow = rng.choice(64, size=3, replace=False)
        factors = rng.uniform(1.03, 1.10, size=3)
        spec = FleetSpec(
            num_nodes=64,
            num_jobs=int(rng.integers(200, 401)),
            slow_nodes={int(n): float(f) for n, f in zip(slow, factors, strict=True)},
            job_noise=0.015 if harsh else 0.01,
            one_off_prob=0.05 if harsh else 0.02,
            seed=seed + 1000 * harsh,
        )
        truth = slow_node_names(spec)
        levels = fleet_levels(spec)
        fitted = fleet_health(levels)
        flagged = {"model": set(fitted.nodes.filter("suspect")["node"].to_list())}
        flagged |= {f"naive k>={k}": naive_flags(levels, k) for k in NAIVE_KS}
        for name, nodes in flagged.items():
            tp = len(nodes & set(truth))
            found[name][0] += tp
            found[name][1] += len(nodes) - tp
            found[name][2] += len(truth) - tp
        for row in fitted.nodes.filter(pl.col("node").is_in(list(truth))).to_dicts():
            errors.append(abs(row["effect"] - truth[row["node"]]))
    label = "harsh (job noise 1.5 %, one-offs 5 %)" if harsh else "default (1 %, 2 %)"
    print(f"\n{num_fleets} fleets, {label}: 3 slow nodes of 64 each")
    print(f"{'rule':<14}{'recall':>8}{'precision':>11}{'false nodes':>13}")
    for name, (tp, fp, fn) in found.items():
        recall = tp / (tp + fn) if tp + fn else float("nan")
        precision = tp / (tp + fp) if tp + fp else float("nan")
        print(f"{name:<14}{recall:>8.3f}{precision:>11.3f}{fp:>13d}")
    print(
        f"model effect error on the slow nodes: median {np.median(errors) * 100:.2f} pp, "
        f"max {max(errors) * 100:.2f} pp (goal within 1 pp)"
    )


def history_levels(num_jobs: int, nodes_per_job: int, fleet_nodes: int) -> pl.DataFrame:
    """Node rows of num_jobs stored jobs, generated directly (as their passes wrote them)."""
    rng = np.random.default_rng(7)
    nodes, factors = rng.choice(fleet_nodes, 10, replace=False), rng.uniform(1.03, 1.1, 10)
    slow = {int(n): float(f) for n, f in zip(nodes, factors, strict=True)}
    placed = np.stack(
        [rng.choice(fleet_nodes, nodes_per_job, replace=False) for _ in range(num_jobs)]
    )
    factor = np.vectorize(lambda n: slow.get(int(n), 1.0))(placed)
    se = np.full(placed.shape, 0.002)
    excess = (
        np.log(factor)
        + 0.01 * rng.standard_normal(placed.shape)
        + se * rng.standard_normal(placed.shape)
    )
    names = np.array([node_name(i) for i in range(fleet_nodes)])
    jobs = np.repeat(np.array([f"hist-{j:06d}" for j in range(num_jobs)]), nodes_per_job)
    return pl.DataFrame(
        {
            "job_id": jobs,
            "node": names[placed.ravel()],
            "gpu": "",
            "ranks": "0-7",
            "num_ranks": 8,
            "excess": excess.ravel(),
            "se": se.ravel(),
            "num_buckets": 1024,
            "ts": 1.75e9 + 600.0 * np.repeat(np.arange(num_jobs), nodes_per_job),
        }
    )


def store_history(engine: sa.Engine, levels: pl.DataFrame) -> float:
    """Write the rows; seconds taken."""
    start = time.perf_counter()
    rows = levels.with_columns(updated_at=pl.lit(1.75e9)).to_dicts()
    with engine.begin() as conn:
        node_levels.insert_rows(conn, [], rows)
    return time.perf_counter() - start


def finish_a_job(
    engine: sa.Engine, job_id: str, fleet_nodes: int, num_ranks: int
) -> dict[str, float]:
    """A 1,024-rank job finishes: its levels, stored; fleet health recomputed. Seconds each."""
    rng = np.random.default_rng(zlib.crc32(job_id.encode()))
    hosts = rng.choice(fleet_nodes, num_ranks // 8, replace=False)
    nodes = {r: node_name(int(hosts[r // 8])) for r in range(num_ranks)}
    gpus = {r: f"GPU-{nodes[r]}-{r % 8}" for r in range(num_ranks)}
    own = 0.45 * np.exp(0.01 * rng.standard_normal((1024, num_ranks)))
    t0 = time.perf_counter()
    levels = job_levels(own, np.arange(num_ranks), nodes, gpus)
    t1 = time.perf_counter()
    with engine.begin() as conn:
        node_levels.replace_job_levels(conn, job_id, levels, 1.76e9, time.time())
    t2 = time.perf_counter()
    fitted = fleet_query.health(engine)
    t3 = time.perf_counter()
    assert job_id in set(fitted.jobs["job_id"].unique().to_list())
    return {"levels": t1 - t0, "store": t2 - t1, "refit": t3 - t2, "total": t3 - t0}


def timing(url: str, num_jobs: int, num_ranks: int, fleet_nodes: int) -> None:
    engine = make_engine(url)
    upgrade(engine)
    levels = history_levels(num_jobs, num_ranks // 8, fleet_nodes)
    print(f"\n{engine.dialect.name}: {num_jobs:,} jobs x {num_ranks:,} ranks of history "
          f"({levels.height:,} node rows over {fleet_nodes:,} nodes)")  # fmt: skip
    print(f"  stored in {store_history(engine, levels):.1f} s")
    if engine.dialect.name == "postgresql":
        # A fleet's history was written long ago and vacuumed since: without this, autovacuum
        # on the freshly loaded table competes for the 2 cores during the timings below.
        start = time.perf_counter()
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(sa.text("VACUUM ANALYZE node_levels"))
        print(f"  VACUUM ANALYZE in {time.perf_counter() - start:.1f} s")
    start = time.perf_counter()
    fitted = fleet_query.health(engine)
    cold = time.perf_counter() - start
    start = time.perf_counter()
    fleet_health(fleet_query.fleet_levels(engine))
    fit = time.perf_counter() - start
    print(f"  cold (full read + fit): {cold:.2f} s; fit alone: {fit:.2f} s; "
          f"{int(fitted.nodes['suspect'].sum())} suspects")  # fmt: skip
    for attempt in (1, 2, 3):
        t = finish_a_job(engine, f"just-finished-{attempt}", fleet_nodes, num_ranks)
        print(
            f"  a job finishes ({attempt}): levels {t['levels']:.3f} s + store {t['store']:.3f} s"
            f" + recompute {t['refit']:.3f} s = {t['total']:.3f} s (goal <= {GOAL_S:.0f} s)"
        )
    engine.dispose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fleets", type=int, default=20)
    parser.add_argument("--jobs", type=int, default=10_000)
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--fleet-nodes", type=int, default=2048)
    parser.add_argument("--postgres", action="store_true", help="also time on PostgreSQL")
    args = parser.parse_args()
    quality(args.fleets, harsh=False)
    quality(args.fleets, harsh=True)
    with tempfile.TemporaryDirectory() as tmp:
        timing(f"sqlite:///{Path(tmp) / 'fleet.db'}", args.jobs, args.ranks, args.fleet_nodes)
    if args.postgres:
        from tests.support import fresh_postgres_database

        with fresh_postgres_database() as url:
            timing(url, args.jobs, args.ranks, args.fleet_nodes)


if __name__ == "__main__":
    main()
