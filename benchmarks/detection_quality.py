"""Straggler detection quality on a matrix of synthetic jobs (stepscope.synth).

Scenarios: 8 to 1024 ranks; one slow rank, several, or a slow node; slowdowns 3%-50%;
causes data / compute / communication / GPU throttling; mid-run onsets, recoveries after
50-200 steps or none; and noisy, spiky clean runs. Prints recall, cause accuracy and
detection latency (steps from onset until the sliding window confirmed it) per slice,
precision, and the findings on clean jobs. Then D's change-point evaluation, if present.

Goals: recall >= 95% with the right cause for slowdowns >= 5% lasting >= 50 steps;
no finding of any kind (stragglers, stalls, collectives, throughput, MFU) on >= 100 clean
jobs.

    python benchmarks/detection_quality.py
"""

from __future__ import annotations

import itertools
import random
import statistics
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

from stepscope.analysis import analyze
from stepscope.schema import Finding
from stepscope.synth import JobSpec, SlowNode, Straggler, generate, to_frames

STRAGGLER_KINDS = ("straggler_rank", "straggler_node", "gpu_throttling")
THROUGHPUT_KINDS = {"throughput_drop", "throughput_gain", "mfu_low", "peak_unknown"}
CAUSES = ("data", "compute", "communication", "gpu_throttling")
FACTORS = (1.03, 1.05, 1.1, 1.2, 1.5)
DURATIONS = (50, 100, 200, None)
RANKS = (8, 16, 64, 256, 1024)


@dataclass(kw_only=True, slots=True)
class Case:
    """One injected slowdown to find: a rank, or a node (all its ranks)."""

    job: str
    ranks: tuple[int, ...]
    node: str | None
    shape: str
    num_ranks: int
    cause: str
    factor: float
    from_step: int
    until_step: int | None
    detected: bool = False
    right_cause: bool = False
    latency_steps: int | None = None


def scenario_specs(rng: random.Random) -> list[tuple[JobSpec, str]]:
    specs = []
    for num_ranks, cause, factor in itertools.product(RANKS, CAUSES, FACTORS):
        num_steps = 600 if num_ranks <= 256 else 400
        for shape in ("rank", "several", "node"):
            if shape == "node" and num_ranks < 24:
                continue  # a node holding half the ranks or more has no majority to compare with
            if num_ranks == 1024 and shape == "several":
                continue
            from_step = rng.randrange(60, num_steps // 2)
            duration = rng.choice(DURATIONS)
            until = None if duration is None else from_step + duration
            common = {"factor": factor, "cause": cause, "from_step": from_step, "until_step": until}
            stragglers: tuple[Straggler, ...] = ()
            nodes: tuple[SlowNode, ...] = ()
            if shape == "node":
                nodes = (SlowNode(node=rng.randrange(num_ranks // 8), **common),)  # type: ignore[arg-type]
            else:
                count = 1 if shape == "rank" else min(3, num_ranks // 4)
                picked = tuple(sorted(rng.sample(range(num_ranks), count)))
                stragglers = (Straggler(ranks=picked, **common),)  # type: ignore[arg-type]
            spec = JobSpec(
                job_id=f"{shape}-{cause}-{factor}-{num_ranks}",
                num_ranks=num_ranks,
                num_steps=num_steps,
                noise=rng.choice((0.01, 0.02, 0.03)),
                spike_prob=rng.choice((0.0, 1e-4, 1e-3)),
                stragglers=stragglers,
                slow_nodes=nodes,
                seed=rng.randrange(2**31),
            )
            specs.append((spec, shape))
    return specs


def clean_specs(rng: random.Random, count: int) -> list[JobSpec]:
    specs = []
    for i in range(count):
        num_ranks = RANKS[i % len(RANKS)]
        specs.append(
            JobSpec(
                job_id=f"clean-{i}",
                num_ranks=num_ranks,
                num_steps=600 if num_ranks <= 256 else 400,
                noise=rng.choice((0.01, 0.02, 0.04, 0.06)),
                spike_prob=rng.choice((0.0, 1e-3, 5e-3, 0.01)) / (1 if num_ranks <= 64 else 10),
                spike_factor=rng.choice((2.0, 3.0, 5.0)),
                seed=rng.randrange(2**31),
            )
        )
    return specs


def run(spec: JobSpec) -> list[Finding]:
    job = generate(spec)
    frames = to_frames(job)
    return analyze(
        frames["steps"],
        collectives=frames["collectives"],
        gpu=frames["gpu"],
        ranks=frames["ranks"],
        job=job.job,
    )


def cases_of(spec: JobSpec, shape: str) -> list[Case]:
    job = spec.job_id
    out = []
    for n in spec.slow_nodes:
        ranks = spec.node_ranks(n.node)
        out.append(
            Case(
                job=job,
                ranks=ranks,
                node=f"node-{n.node:04d}",
                shape=shape,
                num_ranks=spec.num_ranks,
                cause=n.cause,
                factor=n.factor,
                from_step=n.from_step,
                until_step=n.until_step,
            )
        )
    for s in spec.stragglers:
        for r in s.ranks:
            out.append(
                Case(
                    job=job,
                    ranks=(r,),
                    node=None,
                    shape=shape,
                    num_ranks=spec.num_ranks,
                    cause=s.cause,
                    factor=s.factor,
                    from_step=s.from_step,
                    until_step=s.until_step,
                )
            )
    return out


def match(cases: list[Case], findings: list[Finding], num_steps: int) -> int:
    """Mark detected cases; return the number of straggler findings matching no case."""
    unmatched = 0
    for f in findings:
        if f.kind not in STRAGGLER_KINDS:
            continue
        hit = False
        for c in cases:
            until = c.until_step if c.until_step is not None else num_steps
            last = f.last_step if f.last_step is not None else num_steps
            overlaps = (f.first_step or 0) < until and last >= c.from_step
            same = f.node == c.node if c.node else c.ranks[0] in f.ranks
            if overlaps and same:
                hit = True
                if not c.detected:
                    c.detected = True
                    c.right_cause = f.cause == c.cause
                    c.latency_steps = int(f.evidence["detected_step"]) - c.from_step
        unmatched += not hit
    return unmatched


def table(title: str, groups: dict[object, list[Case]]) -> None:
    print(f"\n{title:<22} {'cases':>6} {'recall':>8} {'+cause':>8} {'latency p50':>12} {'p90':>6}")
    for key in sorted(groups, key=str):
        cs = groups[key]
        found = [c for c in cs if c.detected]
        lat = sorted(c.latency_steps for c in found if c.latency_steps is not None)
        p50 = f"{statistics.median(lat):.0f}" if lat else "-"
        p90 = f"{lat[int(0.9 * (len(lat) - 1))]:.0f}" if lat else "-"
        recall = len(found) / len(cs)
        with_cause = sum(c.right_cause for c in found) / len(cs)
        print(f"{key!s:<22} {len(cs):>6} {recall:>8.1%} {with_cause:>8.1%} {p50:>12} {p90:>6}")


def main() -> None:
    rng = random.Random(20240601)
    t0 = time.perf_counter()
    cases: list[Case] = []
    num_findings = false_findings = 0
    for spec, shape in scenario_specs(rng):
        findings = run(spec)
        job_cases = cases_of(spec, shape)
        false_findings += match(job_cases, findings, spec.num_steps)
        num_findings += sum(f.kind in STRAGGLER_KINDS for f in findings)
        cases += job_cases
    took = time.perf_counter() - t0
    num_jobs = len(scenario_specs(random.Random(20240601)))
    print(f"{len(cases)} injected slowdowns in {num_jobs} jobs ({took:.0f} s)")

    def by(key: str) -> dict[object, list[Case]]:
        groups: dict[object, list[Case]] = defaultdict(list)
        for c in cases:
            groups[getattr(c, key)].append(c)
        return groups

    table("by cause", by("cause"))
    table("by slowdown factor", by("factor"))
    table("by ranks in job", by("num_ranks"))
    table("by shape", by("shape"))
    durations: dict[object, list[Case]] = defaultdict(list)
    for c in cases:
        durations[
            "to end" if c.until_step is None else f"{c.until_step - c.from_step} steps"
        ].append(c)
    table("by duration", durations)

    goal = [c for c in cases if c.factor >= 1.05]
    ok = sum(c.detected and c.right_cause for c in goal) / len(goal)
    precision = 1 - false_findings / max(1, num_findings)
    print(
        f"\nprecision (straggler findings matching an injected slowdown): {precision:.1%}"
        f" ({num_findings - false_findings}/{num_findings})"
    )
    print(
        f"GOAL recall with right cause, slowdown >= 5% lasting >= 50 steps: {ok:.1%}"
        f" of {len(goal)} [{'ok' if ok >= 0.95 else 'MISSED'}]"
    )

    t1 = time.perf_counter()
    clean = clean_specs(rng, 120)
    kinds: Counter[str] = Counter()
    flagged: list[tuple[JobSpec, Counter[str]]] = []
    for spec in clean:
        job_kinds = Counter(f.kind for f in run(spec))
        kinds.update(job_kinds)
        if job_kinds:
            flagged.append((spec, job_kinds))
    took = time.perf_counter() - t1
    print(f"\nclean jobs: {len(clean)} (noise 1-6%, spikes up to 1% of rank-steps; {took:.0f} s)")
    stragglerish = sum(bool(set(k) - THROUGHPUT_KINDS) for _, k in flagged)
    print(
        f"GOAL no finding of any kind on >= 100 clean jobs: {len(flagged)} of {len(clean)}"
        f" clean jobs have a finding [{'ok' if not flagged and len(clean) >= 100 else 'MISSED'}]"
    )
    print(
        f"  of which a straggler/dataloader/collective finding: {stragglerish},"
        f" only throughput/MFU findings: {len(flagged) - stragglerish}"
    )
    if kinds:
        print(f"  findings by kind: {dict(kinds)}")
    for spec, job_kinds in flagged:
        print(
            f"  {spec.job_id}: {spec.num_ranks} ranks, noise {spec.noise}, spike_prob"
            f" {spec.spike_prob:g} x{spec.spike_factor:g}: {dict(job_kinds)}"
        )

    sys.path.insert(0, str(Path(__file__).parent))
    try:
        import changepoint_eval
    except ImportError:
        print("\nbenchmarks/changepoint_eval.py is absent: change-point evaluation skipped")
        return
    print("\n--- change-point evaluation (benchmarks/changepoint_eval.py) ---")
    changepoint_eval.main()


if __name__ == "__main__":
    main()
