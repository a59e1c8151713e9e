"""Time to a verdict (issue 52): how many steps after its onset a straggler is named, against
its size, and what that costs in false findings on clean jobs.

Jobs come from benchmarks/detection_quality.py's three noise models (the simulator,
lognormal jitter, AR(1) jitter with Student-t innovations), at 2% jitter per step, 8 or 32
ranks. One rank is slowed by 5, 10, 20 or 40% of its compute from a step between 60 and 100
to the end of a 200-step job. Printed per slowdown:
- named by step onset+N: the job cut at step onset+N (what a live analysis has then) names
  the slowed rank, for N = 10, 20, 30, 50;
- latency: the detected_step of the finding of the whole job, minus the onset;
- TraceML 0.5's rule beside it, re-implemented from its documented policy (see
  ../shared/research/data_pipeline.md): a verdict needs 20 steps, and a rank is a straggler
  when its excess over the median rank, as a share of the step, is >= 10% over them.
Then short jobs (60 steps, +40% from step 20, the end of the default warm-up: 4 and 8 ranks)
and clean jobs (clean, spiky, drifting, warm-up heavy; 8, 32 and 128 ranks, 400 steps): false
straggler findings per 1,000 rank-jobs, and those that start within 50 steps of the warm-up's
end.

    .venv/bin/python benchmarks/time_to_verdict.py [--jobs 12] [--clean 12] [--workers 2]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import statistics
import time
from collections import defaultdict
from concurrent.futures import ProcessPoolExecutor

import detection_quality as dq
import numpy as np
import polars as pl

from stepscope.analysis import AnalysisConfig, analyze

SIZES = (0.05, 0.10, 0.20, 0.40)
NOISE = 0.02
RANKS = (8, 32)
NUM_STEPS = 200
CUTS = (10, 20, 30, 50)
"""Steps after the onset at which a live analysis is asked."""
TRACEML_STEPS = 20
TRACEML_SCORE = 0.10
WARMUP_STEPS = AnalysisConfig().warmup_steps


@dataclasses.dataclass(slots=True, kw_only=True)
class Outcome:
    case: dq.Case
    num_steps: int
    named_by: dict[int, bool] = dataclasses.field(default_factory=dict)
    latency: int | None = None
    traceml_latency: int | None = None
    false_ranks: int = 0
    false_near_warmup: int = 0


def _frames(case: dq.Case, num_steps: int) -> tuple[dict[str, pl.DataFrame], dict[str, object]]:
    dq.NUM_STEPS = num_steps  # the generators read the job length from the module
    return dq.build(case)


def _names(findings: list, rank: int) -> bool:
    return any(f.kind in dq.STRAGGLER_KINDS and rank in f.ranks for f in findings)


def _traceml_latency(steps: pl.DataFrame, onset: int, rank: int) -> int | None:
    """Steps after the onset at which TraceML's rule names `rank`: the first step from which
    the last 20 steps' median excess of the rank over the median rank, over the median
    step, is >= 10%."""
    wide = steps.pivot(on="rank", index="step", values="step_s").sort("step")
    by_rank = steps.with_columns(ready_s=pl.col("step_s") - pl.col("comm_wait_s"))
    ready = by_rank.pivot(on="rank", index="step", values="ready_s").sort("step")
    x = ready.drop("step").to_numpy()
    step_s = np.median(wide.drop("step").to_numpy(), axis=1)
    score = (x[:, rank] - np.median(x, axis=1)) / step_s
    for end in range(onset + TRACEML_STEPS, x.shape[0] + 1):
        if np.median(score[end - TRACEML_STEPS : end]) >= TRACEML_SCORE:
            return end - 1 - onset
    return None


def evaluate(item: tuple[dq.Case, int]) -> Outcome:
    case, num_steps = item
    frames, job = _frames(case, num_steps)
    out = Outcome(case=case, num_steps=num_steps)
    findings = analyze(frames["steps"], collectives=frames["collectives"], job=job)
    if case.size == 0:
        for f in findings:
            if f.kind in dq.STRAGGLER_KINDS:
                out.false_ranks += len(f.ranks)
                out.false_near_warmup += (f.first_step or 0) < WARMUP_STEPS + 50
        return out
    for f in findings:
        if f.kind in dq.STRAGGLER_KINDS and case.rank in f.ranks:
            latency = int(f.evidence["detected_step"]) - case.onset
            out.latency = latency if out.latency is None else min(out.latency, latency)
        elif f.kind in dq.STRAGGLER_KINDS:
            out.false_ranks += len(f.ranks)
    out.traceml_latency = _traceml_latency(frames["steps"], case.onset, case.rank)
    for n in CUTS:
        last = case.onset + n
        if last >= num_steps:
            continue
        cut = {k: frames[k].filter(pl.col("step") <= last) for k in ("steps", "collectives")}
        live = analyze(cut["steps"], collectives=cut["collectives"], job=job)
        out.named_by[n] = _names(live, case.rank)
    return out


def _cases(jobs: int, clean: int, rng: np.random.Generator) -> list[tuple[dq.Case, int]]:
    items = []
    for model, size in itertools.product(dq.MODELS, SIZES):
        for i in range(jobs):
            num_ranks = RANKS[i % len(RANKS)]
            case = dq.Case(
                model=model,
                noise=NOISE,
                num_ranks=num_ranks,
                seed=int(rng.integers(2**31)),
                size=size,
                rank=int(rng.integers(num_ranks)),
                onset=int(rng.integers(60, 101)),
            )
            items.append((case, NUM_STEPS))
    for model, num_ranks in itertools.product(dq.MODELS, (4, 8)):
        for _ in range(jobs // 2):
            case = dq.Case(
                model=model,
                noise=NOISE,
                num_ranks=num_ranks,
                seed=int(rng.integers(2**31)),
                size=0.40,
                rank=int(rng.integers(num_ranks)),
                onset=WARMUP_STEPS,
            )
            items.append((case, 60))
    items += [(c, dq.NUM_STEPS) for c in dq.clean_cases(clean, rng)]
    return items


def _pct(part: int, whole: int) -> str:
    return f"{part / whole:6.1%}" if whole else "     -"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=12, help="jobs per (model, slowdown)")
    parser.add_argument("--clean", type=int, default=24, help="clean jobs per (model, kind)")
    parser.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--seed", type=int, default=20261207)
    args = parser.parse_args()
    items = _cases(args.jobs, args.clean, np.random.default_rng(args.seed))
    t0 = time.perf_counter()
    with ProcessPoolExecutor(max_workers=args.workers) as pool:
        outcomes = list(pool.map(evaluate, items, chunksize=2))
    slowed = [o for o in outcomes if o.case.size > 0 and o.num_steps == NUM_STEPS]
    short = [o for o in outcomes if o.case.size > 0 and o.num_steps != NUM_STEPS]
    clean = [o for o in outcomes if o.case.size == 0]
    print(
        f"{len(slowed)} jobs with a slowed rank ({NUM_STEPS} steps, {NOISE:.0%} jitter,"
        f" {'/'.join(map(str, RANKS))} ranks), {len(short)} short jobs, {len(clean)} clean jobs;"
        f" {time.perf_counter() - t0:.0f} s on {args.workers} workers"
    )
    head = " ".join(f"{'+' + str(n):>6}" for n in CUTS)
    print(f"\n{'':<14}  named by step onset+N{'':<5}  latency (steps)  TraceML's rule")
    print(f"{'slowdown':<9} {'jobs':>4}  {head}  {'p50':>7} {'p90':>7}  {'named':>6} {'p50':>6}")
    by_size: dict[float, list[Outcome]] = defaultdict(list)
    for o in slowed:
        by_size[o.case.size].append(o)
    for size, outs in sorted(by_size.items()):
        named = " ".join(
            f"{_pct(sum(o.named_by.get(n, False) for o in outs), len(outs)):>6}" for n in CUTS
        )
        latencies = sorted(o.latency for o in outs if o.latency is not None)
        p50 = f"{statistics.median(latencies):.0f}" if latencies else "-"
        p90 = f"{latencies[int(0.9 * (len(latencies) - 1))]}" if latencies else "-"
        tml = sorted(o.traceml_latency for o in outs if o.traceml_latency is not None)
        tml_p50 = f"{statistics.median(tml):.0f}" if tml else "-"
        print(
            f"{size:<9.0%} {len(outs):>4}  {named}  {p50:>7} {p90:>7}"
            f"  {_pct(len(tml), len(outs))} {tml_p50:>6}"
        )
    false_slowed = sum(o.false_ranks for o in slowed)
    print(f"straggler findings naming a rank not slowed, in these jobs: {false_slowed}")

    named_short = sum(o.latency is not None for o in short)
    print(
        f"\nshort jobs (60 steps, +40% from step {WARMUP_STEPS}, 4 and 8 ranks): named"
        f" {_pct(named_short, len(short))} of {len(short)}"
    )

    rank_jobs = sum(o.case.num_ranks for o in clean)
    false = sum(o.false_ranks for o in clean)
    near = sum(o.false_near_warmup for o in clean)
    print(
        f"\nclean jobs: {len(clean)} ({rank_jobs} rank-jobs): {false} false straggler findings"
        f" = {1000 * false / max(rank_jobs, 1):.2f} per 1,000 rank-jobs;"
        f" {near} of them start within 50 steps of the warm-up's end"
    )


if __name__ == "__main__":
    main()
