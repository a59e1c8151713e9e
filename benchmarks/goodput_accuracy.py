"""Goodput accuracy (#20, DESIGN §7): generated timelines of 1,024 ranks with known truth.

Each timeline (stepscope.synthetic.goodput_timelines) has random crashes resuming from the last
checkpoint or at the next step, hangs with long detection, stalls inside a step, checkpoints,
evaluation, compilation, a slow node for part of the job and data stalls on 5 % of the ranks.
Printed, beside the goals, in the same run:

1. stepscope's |goodput − truth| p50/p95 in percentage points (goal p95 ≤ 0.5 pp) and each
   category's p95 error (goal ≤ 1 pp);
2. the same timelines scored by the rules ml-goodput-measurement documents (v0.2.3, written
   here from its published definitions; research note §4.1): rank 0's step starts only,
   productive = the deltas between consecutive step starts, a repeated step number is a
   disruption (the steps after the restart step are wasted progress, the last step start to
   the next job start infrastructure recovery), the first step of a segment beyond the
   segment's mean step time program start-up; custom badput (here: the declared phases) is
   subtracted from the step interval holding it;
3. the time to compute a 1,024-rank × 100,000-step job's goodput from its stored step rollups
   and lifecycle events, its windows over time included (SQLite; goal ≤ 1 s). This is the
   cold computation: the server then reuses the answer until the job's next analyzer pass.

    python benchmarks/goodput_accuracy.py [--timelines 200] [--ranks 1024] [--big-steps 100000]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stepscope.analysis.goodput.job import goodput, lifecycles  # noqa: E402
from stepscope.query.goodput import job_goodput  # noqa: E402
from stepscope.schema import GOODPUT_CATEGORIES  # noqa: E402
from stepscope.store import rollup_tables, tables  # noqa: E402
from stepscope.store.engine import make_engine  # noqa: E402
from stepscope.store.migrate import upgrade  # noqa: E402
from stepscope.store.writer import BatchWriter  # noqa: E402
from stepscope.synthetic.goodput_timelines import Failure, Scenario, Timeline, generate  # noqa: E402

GOAL_PP = 0.5
CATEGORY_GOAL_PP = 1.0
TIME_GOAL_S = 1.0


def random_scenario(rng: np.random.Generator, ranks: int, seed: int) -> Scenario:
    """A timeline with a random mix of failures, stalls, phases and slow ranks."""
    num_steps = int(rng.integers(800, 2000))
    step_s = float(rng.uniform(0.5, 3.0))
    failures = []
    for at in sorted(rng.choice(np.arange(150, num_steps - 50), rng.integers(0, 4), replace=False)):
        failures.append(
            Failure(
                at_step=int(at),
                kind="hang" if rng.random() < 0.4 else "crash",
                resume="next" if rng.random() < 0.5 else "checkpoint",
                downtime_s=float(rng.uniform(60, 900)),
                detect_s=float(rng.uniform(10, 300)),
                abort_s=float(rng.uniform(1, 30)),
                at_fraction=0.0 if rng.random() < 0.3 else float(rng.uniform(0.1, 0.9)),
                rank=int(rng.integers(ranks)),
            )
        )
    node = int(rng.integers(ranks // 8)) * 8
    slow_from = int(rng.integers(num_steps))
    return Scenario(
        world_size=ranks,
        num_steps=num_steps,
        step_s=step_s,
        transfer_s=step_s * float(rng.uniform(0.02, 0.1)),
        data_s=step_s * 0.01,
        startup_s=float(rng.uniform(30, 300)),
        launch_jitter_s=float(rng.uniform(0, 10)),
        load_s=float(rng.uniform(5, 60)),
        compile_steps=int(rng.integers(1, 4)),
        compile_factor=float(rng.uniform(3, 20)),
        ckpt_every=int(rng.choice([100, 200, 250])),
        ckpt_s=float(rng.uniform(5, 60)),
        eval_every=int(rng.choice([0, 250, 500])),
        eval_s=float(rng.uniform(10, 60)),
        failures=failures,
        stall=(int(rng.integers(10, num_steps)), float(rng.uniform(60, 900)))
        if rng.random() < 0.3
        else None,
        slow=(
            list(range(node, node + 8)),
            slow_from,
            slow_from + 300,
            float(rng.uniform(1.05, 1.3)),
        )
        if rng.random() < 0.5
        else None,
        data_stall=(
            sorted(rng.choice(ranks, max(1, ranks // 20), replace=False).tolist()),
            step_s * float(rng.uniform(0.02, 0.2)),
        )
        if rng.random() < 0.5
        else None,
        seed=seed,
    )


def google_rules(t: Timeline) -> float:
    """Goodput by the rules ml-goodput-measurement documents, from rank 0's records."""
    starts = t.rank0_step_starts
    job_starts = sorted(t.rank0_job_starts)
    end = t.ended_at
    total = end - job_starts[0]
    rank0_phases = t.events.filter((pl.col("rank") == 0) & (pl.col("kind") == "phase"))
    phase_ts = rank0_phases["ts"].to_numpy()
    phase_s = np.array([json.loads(a)["duration_s"] for a in rank0_phases["attributes"]])
    productive = 0.0
    segment: list[tuple[int, float]] = []  # (step, delta) of the current segment
    segments: list[list[tuple[int, float]]] = []
    for i, (step, ts) in enumerate(starts):
        nxt_ts = starts[i + 1][1] if i + 1 < len(starts) else end
        disrupted = i + 1 < len(starts) and starts[i + 1][0] <= step
        delta = nxt_ts - ts
        inside = (phase_ts >= ts) & (phase_ts < nxt_ts)
        delta -= float(phase_s[inside].sum())  # synchronous custom badput
        if disrupted:
            # Infrastructure recovery: the last step start to the next job start.
            segments.append(segment)
            segment = []
            resume = starts[i + 1][0]
            for prev in segments:  # steps after the restart step become wasted progress
                prev[:] = [(s, d if s < resume else 0.0) for s, d in prev]
            continue
        segment.append((step, delta))
    segments.append(segment)
    for seg in segments:
        deltas = [d for _, d in seg if d > 0]
        if not deltas:
            continue
        mean = statistics.fmean(deltas)
        first = deltas[0]
        productive += sum(deltas) - max(0.0, first - mean)  # program start-up
    return productive / total


def score(t: Timeline) -> dict[str, Any]:
    result = goodput(
        t.steps,
        lifecycles(t.events),
        world_size=t.world_size,
        ended_at=t.ended_at,
        hangs=t.hangs,
    )
    truth = t.truth["productive"] / t.total_s
    return {
        "error_pp": 100 * abs(result.goodput - truth),
        "google_error_pp": 100 * abs(google_rules(t) - truth),
        "categories_pp": {
            c: 100 * abs(result.share(c) - t.truth[c] / t.total_s) for c in GOODPUT_CATEGORIES
        },
        "truth": truth,
    }


def p(values: list[float], q: float) -> float:
    return float(np.percentile(values, q))


def stored_job_seconds(num_ranks: int, num_steps: int, repeat: int = 3) -> tuple[float, int]:
    """Best time of job_goodput over a stored 1,024 × 100,000-step job (rollups + events)."""
    with tempfile.TemporaryDirectory() as tmp:
        engine = make_engine(f"sqlite:///{Path(tmp) / 'goodput.db'}")
        upgrade(engine)
        job_id = "goodput-scale"
        t0 = 1.7e9
        step_s = 1.0
        ts = t0 + 60.0 + np.arange(num_steps) * step_s + (np.arange(num_steps) // 1000) * 10.0
        rollup = pl.DataFrame(
            {
                "step": np.arange(num_steps),
                "num_ranks": np.full(num_steps, num_ranks),
                "ts": ts,
                "step_s_mean": np.full(num_steps, step_s),
                "step_s_max": np.full(num_steps, step_s),
                "data_s_mean": np.full(num_steps, 0.01),
                "comm_wait_s_mean": np.full(num_steps, 0.06),
                "comm_wait_s_min": np.full(num_steps, 0.05),
            }
        )
        with engine.begin() as conn:
            rollup_tables.replace_step_rows(
                conn, tables.step_rollups, job_id, rollup, rollup["step"].to_list()
            )
        writer = BatchWriter(engine)
        pending = []
        ckpt_ts = ts[::1000][1:] - 10.0
        for rank in range(num_ranks):
            inc = f"i{rank}"
            kinds = ["start", "resume", *(["phase"] * len(ckpt_ts)), "exit"]
            stamps = [t0, ts[0], *ckpt_ts.tolist(), ts[-1] + step_s]
            attrs = [
                {"incarnation": inc},
                {"incarnation": inc, "step": 0},
                *(
                    {"incarnation": inc, "name": "checkpoint_save", "duration_s": 10.0}
                    for _ in ckpt_ts
                ),
                {"incarnation": inc},
            ]
            events = {
                "ts": stamps,
                "kind": kinds,
                "message": [None] * len(kinds),
                "attributes": [json.dumps(a) for a in attrs],
                "job_id": [job_id] * len(kinds),
                "rank": [rank] * len(kinds),
            }
            pending.append(
                {
                    "job": {"job_id": job_id, "world_size": num_ranks},
                    "source": {"rank": rank, "incarnation": inc},
                    "seq": 0,
                    "sections": {"events": events},
                }
            )
        writer.submit(pending).result()
        writer.close()
        best = float("inf")
        for _ in range(repeat):
            start = time.perf_counter()
            answer = job_goodput(engine, job_id)
            best = min(best, time.perf_counter() - start)
        assert abs(answer.result.total_s - num_ranks * (ts[-1] + step_s - t0)) < 1e-3 * num_ranks
        assert answer.windows is not None
        assert 0 < answer.windows.height <= 100
        engine.dispose()
        return best, len(pending)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--timelines", type=int, default=200)
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--big-steps", type=int, default=100_000)
    parser.add_argument("--seed", type=int, default=20)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    scores = []
    started = time.perf_counter()
    for i in range(args.timelines):
        scores.append(score(generate(random_scenario(rng, args.ranks, seed=args.seed * 1000 + i))))
    elapsed = time.perf_counter() - started
    errors = [s["error_pp"] for s in scores]
    google = [s["google_error_pp"] for s in scores]
    truths = [100 * s["truth"] for s in scores]
    print(
        f"{args.timelines} timelines of {args.ranks} ranks "
        f"(true goodput {min(truths):.1f}-{max(truths):.1f} %, "
        f"median {statistics.median(truths):.1f} %); "
        f"generated and scored in {elapsed:.0f} s"
    )
    print(f"{'':34} {'p50 pp':>8} {'p95 pp':>8} {'max pp':>8}   goal p95")
    ok = p(errors, 95) <= GOAL_PP
    print(
        f"{'stepscope |goodput - truth|':34} {p(errors, 50):8.3f} {p(errors, 95):8.3f} "
        f"{max(errors):8.3f}   <= {GOAL_PP}  {'ok' if ok else 'MISSED'}"
    )
    print(
        f"{'ml-goodput-measurement rules':34} {p(google, 50):8.3f} {p(google, 95):8.3f} "
        f"{max(google):8.3f}   (peer)"
    )
    print(f"\nper category, stepscope |share - truth| (goal p95 <= {CATEGORY_GOAL_PP} pp):")
    for c in GOODPUT_CATEGORIES:
        values = [s["categories_pp"][c] for s in scores]
        verdict = "ok" if p(values, 95) <= CATEGORY_GOAL_PP else "MISSED"
        print(
            f"  {c:18} p50 {p(values, 50):7.3f}  p95 {p(values, 95):7.3f}  "
            f"max {max(values):7.3f}  {verdict}"
        )
    seconds, num_ranks = stored_job_seconds(args.ranks, args.big_steps)
    verdict = "ok" if seconds <= TIME_GOAL_S else "MISSED"
    print(
        f"\ngoodput of a stored {num_ranks} x {args.big_steps:,}-step job (SQLite, step rollups "
        f"+ {num_ranks * (args.big_steps // 1000 + 2):,} lifecycle events, windows over time): "
        f"{seconds:.3f} s "
        f"(goal <= {TIME_GOAL_S} s) {verdict}"
    )


if __name__ == "__main__":
    main()
