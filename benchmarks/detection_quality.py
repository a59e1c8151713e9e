"""Straggler detection quality on jobs drawn from three noise models (DESIGN §7, issue 11).

Every job is synchronous data parallelism: per step each rank loads its batch and computes,
the all-reduce completes after the last rank arrives, and every rank's step ends together.
The per-rank per-step jitter comes from one of three models:
- synth: the simulator (synthetic.generate): Gaussian jitter of data, compute and transfer,
  a persistent per-rank offset (rank_bias 0.5%), rare spikes; stragglers of every cause
  (compute, data, communication, throttled GPU);
- lognormal: lognormal compute, data and transfer jitter, rare 3x compute spikes;
- ar1: AR(1)-correlated compute jitter (rho 0.3 or 0.6) with Student-t(3) innovations,
  rare 3x spikes.
The lognormal and ar1 jobs are generated here, independently of the simulator. One rank is
slowed from a step between 120 and 180 to the end of the job, by 2, 3, 5, 8 or 12% of its
compute (the synth's data and communication stragglers: that much added to their data or
transfer time), at noise 1, 2 or 3% per step, 8, 32 or 128 ranks, 400 steps.

Printed: recall (the rank named by a straggler finding that was detected within 100 steps
of the onset) and recall with the right cause, per slowdown, noise level and model, with
the detection latency (steps from the onset to the step from which the data confirmed it);
the onset error; straggler findings naming a rank not slowed; whether the throughput drop
at the onset names the rank as its cause; what the stragglers cost the job (share of its
step time, GPU-equivalents) and their severities; the simulator's scenario matrix (a rank,
three ranks or a node; recovered or not); and the findings of any kind on clean jobs
(clean, spiky, drifting, warm-up heavy) of every model.

Goals (issue 11): recall with the right cause >= 95% for slowdowns >= 3% at noise <= 2%,
within 100 steps, on every model; >= 80% at 2%; no finding on >= 200 clean jobs. Real
torchrun jobs are checked by tests (tests/analysis/test_end_to_end.py); change points have
their own benchmark (benchmarks/changepoint_eval.py).

    .venv/bin/python benchmarks/detection_quality.py [--jobs 24] [--clean 24] [--workers 2]
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import polars as pl

from stepscope.analysis import analyze
from stepscope.synthetic.generate import JobSpec, SlowNode, Straggler, generate, to_frames

MODELS = ("synth", "lognormal", "ar1")
SIZES = (0.02, 0.03, 0.05, 0.08, 0.12)
NOISES = (0.01, 0.02, 0.03)
RANKS = (8, 32, 128)
CLEAN_KINDS = ("clean", "spiky", "drifting", "warmup")
SYNTH_CAUSES = ("compute", "data", "communication", "gpu_throttling")
NUM_STEPS = 400
MAX_LATENCY_STEPS = 100
STRAGGLER_KINDS = ("straggler_rank", "straggler_node", "gpu_throttling")
CHANGE_KINDS = ("throughput_drop", "throughput_gain")

COMPUTE_S = 0.45
DATA_S = 0.01
TRANSFER_S = 0.03
RANKS_PER_NODE = 8


@dataclass(frozen=True, slots=True, kw_only=True)
class Case:
    """One job to generate: a model, a noise level, and a slowdown (or a kind of clean job)."""

    model: str
    noise: float
    num_ranks: int
    seed: int
    size: float = 0.0
    """Slowdown, relative to the rank's compute; 0: a clean job."""
    cause: str = "compute"
    clean_kind: str | None = None
    rank: int = 0
    onset: int = 0


@dataclass(slots=True, kw_only=True)
class Outcome:
    case: Case
    detected: bool = False
    right_cause: bool = False
    latency_steps: int | None = None
    onset_error: int | None = None
    impact_share: float | None = None
    gpus: float | None = None
    severity: str | None = None
    false_stragglers: int = 0
    change_at_onset: bool = False
    change_names_rank: bool = False
    kinds: Counter[str] = field(default_factory=Counter)
    seconds: float = 0.0


# --- jobs -------------------------------------------------------------------------------


def _frames(
    case: Case, compute: np.ndarray, data: np.ndarray, transfer: np.ndarray
) -> tuple[dict[str, pl.DataFrame], dict[str, Any]]:
    """Steps and collectives of a synchronous job from (steps × ranks) times."""
    rng = np.random.default_rng(case.seed + 1)
    num_steps, num_ranks = compute.shape
    ready = data + compute
    arrival = ready.max(axis=1)
    finish = arrival[:, None] + transfer
    end = finish.max(axis=1)
    step_s = end[:, None] + np.abs(rng.standard_normal(compute.shape)) * 2e-4
    starts = 1.7e9 + np.concatenate(([0.0], np.cumsum(end)[:-1]))
    rank = np.tile(np.arange(num_ranks), num_steps)
    step = np.repeat(np.arange(num_steps), num_ranks)
    job_id = f"{case.model}-{case.seed}"
    steps = pl.DataFrame(
        {
            "job_id": job_id,
            "rank": rank,
            "step": step,
            "ts": np.repeat(starts, num_ranks),
            "step_s": step_s.ravel(),
            "data_s": data.ravel(),
            "comm_wait_s": (step_s - ready).ravel(),
            "tokens": np.full(rank.size, 4096),
            "node": [f"node-{r // RANKS_PER_NODE:04d}" for r in rank],
        }
    )
    collectives = pl.DataFrame(
        {
            "job_id": job_id,
            "rank": rank,
            "step": step,
            "op": "all_reduce",
            "group_size": num_ranks,
            "count": 25,
            "bytes": 1_000_000_000,
            "busy_s": (finish - ready).ravel(),
        }
    )
    job = {"job_id": job_id, "world_size": num_ranks}
    return {"steps": steps, "collectives": collectives}, job


def _profile(case: Case, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(steps × ranks) compute multipliers (warm-up, drift, spikes) and the (steps × 1)
    noise multipliers of this kind of job."""
    n, r = NUM_STEPS, case.num_ranks
    t = np.arange(n)[:, None]
    if case.clean_kind == "warmup":
        # The configured 20 warm-up steps are heavy (5x slower, 4x noisier), each rank
        # settles at its own step within them, and a quarter of the ranks keep a decaying tail.
        ends = rng.integers(12, 21, size=r)[None, :]
        level = np.where(t < ends, 1.0 + 4.0 * (1.0 - t / ends) ** 2, 1.0)
        tail = rng.random(r) < 0.25
        level = level + np.where(tail & (t >= ends), 0.03 * np.exp(-(t - ends) / 8.0), 0.0)
        noise = np.where(t < 20, 4.0, 1.0)
    else:
        level = np.where(t < 15, 1.0 + 3.0 * (1.0 - t / 15) ** 2, 1.0) + np.zeros((n, r))
        noise = np.where(t < 15, 3.0, 1.0)
    if case.clean_kind == "drifting":
        level = level * (1.0 + 0.0025 * _walks(rng, 1) + 0.0015 * _walks(rng, r))
    spike_prob, spike_factor = 1e-3, 3.0
    if case.clean_kind == "spiky":
        spike_prob = float(rng.choice([5e-3, 1e-2, 2e-2]))
        spike_factor = float(rng.choice([2.0, 3.0, 5.0]))
    return np.where(rng.random((n, r)) < spike_prob, spike_factor * level, level), noise


def _walks(rng: np.random.Generator, count: int) -> np.ndarray:
    """(steps × count) random walks, centred, standard deviation 1."""
    walk = np.cumsum(rng.standard_normal((NUM_STEPS, count)), axis=0)
    walk -= walk.mean(axis=0)
    return walk / walk.std(axis=0)


def _own_model_job(case: Case) -> tuple[dict[str, pl.DataFrame], dict[str, Any]]:
    """A lognormal or ar1 job, generated here (independently of synthetic.generate)."""
    rng = np.random.default_rng(case.seed)
    n, r = NUM_STEPS, case.num_ranks
    level, noise = _profile(case, rng)
    sigma = case.noise * noise
    if case.model == "lognormal":
        jitter = np.exp(sigma * rng.standard_normal((n, r)) - 0.5 * sigma**2)
    else:
        rho = float(rng.choice([0.3, 0.6]))
        # Student-t(3) innovations scaled to a stationary standard deviation of 1.
        innovations = rng.standard_t(3, size=(n, r)) / np.sqrt(3.0) * np.sqrt(1.0 - rho**2)
        eps = np.empty((n, r))
        eps[0] = rng.standard_normal(r)
        for i in range(1, n):
            eps[i] = rho * eps[i - 1] + innovations[i]
        jitter = np.maximum(1.0 + sigma * eps, 0.2)
    compute = COMPUTE_S * level * jitter
    if case.size > 0:
        compute[case.onset :, case.rank] *= 1.0 + case.size
    small = np.exp(case.noise * rng.standard_normal((2, n, r)))
    return _frames(case, compute, DATA_S * small[0], TRANSFER_S * np.sqrt(small[1]))


def _synth_job(case: Case) -> tuple[dict[str, pl.DataFrame], dict[str, Any]]:
    """A job of the simulator; its stragglers add the slowdown times the clean compute."""
    rng = np.random.default_rng(case.seed)
    base = JobSpec()
    compute0 = base.base_step_s * (1 - base.data_share) - base.transfer_s
    stragglers: tuple[Straggler, ...] = ()
    if case.size > 0:
        factor = 1.0 + case.size * compute0 / base.base_step_s
        stragglers = (
            Straggler(ranks=(case.rank,), factor=factor, cause=case.cause, from_step=case.onset),  # type: ignore[arg-type]
        )
    spike_prob, spike_factor = 1e-4, 3.0
    if case.clean_kind == "spiky":
        spike_prob = float(rng.choice([5e-3, 1e-2, 2e-2]))
        spike_factor = float(rng.choice([2.0, 3.0, 5.0]))
    spec = JobSpec(
        job_id=f"synth-{case.seed}",
        num_ranks=case.num_ranks,
        num_steps=NUM_STEPS,
        noise=case.noise,
        spike_prob=spike_prob,
        spike_factor=spike_factor,
        warmup_steps=20 if case.clean_kind == "warmup" else 10,
        drift=0.0025 if case.clean_kind == "drifting" else 0.0,
        stragglers=stragglers,
        seed=case.seed,
    )
    job = generate(spec)
    return to_frames(job), job.job


def build(case: Case) -> tuple[dict[str, pl.DataFrame], dict[str, Any]]:
    return _synth_job(case) if case.model == "synth" else _own_model_job(case)


# --- evaluation -------------------------------------------------------------------------


def evaluate(case: Case) -> Outcome:
    frames, job = build(case)
    t0 = time.perf_counter()
    findings = analyze(
        frames["steps"], collectives=frames["collectives"], gpu=frames.get("gpu"), job=job
    )
    out = Outcome(case=case, seconds=time.perf_counter() - t0)
    out.kinds.update(f.kind for f in findings)
    if case.size == 0:
        return out
    expected_cause = case.cause
    for f in findings:
        if f.kind not in STRAGGLER_KINDS:
            if (
                f.kind == "throughput_drop"
                and abs((f.first_step or 0) - case.onset) <= 25
                and f.metric != "mfu"
            ):
                out.change_at_onset = True
                out.change_names_rank |= case.rank in f.ranks
            continue
        if case.rank not in f.ranks or (f.last_step is not None and f.last_step < case.onset):
            out.false_stragglers += 1
            continue
        latency = int(f.evidence["detected_step"]) - case.onset
        if out.detected or latency > MAX_LATENCY_STEPS:
            continue
        out.detected = True
        out.right_cause = f.cause == expected_cause
        out.latency_steps = latency
        out.onset_error = (f.first_step or 0) - case.onset
        impact = f.evidence.get("impact") or {}
        out.impact_share = impact.get("step_share")
        out.gpus = impact.get("gpus")
        out.severity = f.severity
    return out


@dataclass(frozen=True, slots=True, kw_only=True)
class Scenario:
    """A simulator job with one slow rank, several, or a slow node, which may recover."""

    shape: str
    cause: str
    factor: float
    num_ranks: int
    from_step: int
    until_step: int | None
    seed: int
    ranks: tuple[int, ...] = ()
    node: int | None = None


@dataclass(slots=True, kw_only=True)
class ScenarioOutcome:
    scenario: Scenario
    found: int = 0
    """Slowed ranks (or the slow node) named in the slow stretch, with the right cause."""
    expected: int = 0
    recovery_error: int | None = None
    """|last_step - last slow step| of the first finding, for a recovered slowdown."""


def scenarios(rng: np.random.Generator) -> list[Scenario]:
    """Shapes (a rank, 3 ranks, a node) × causes × slowdowns × recovered or not, 600 steps."""
    out = []
    shapes, causes = ("rank", "several", "node"), SYNTH_CAUSES
    for shape, cause, factor, recovers in itertools.product(
        shapes, causes, (1.03, 1.05, 1.1, 1.2), (True, False)
    ):
        # A node of 8 ranks is half a 16-rank job: there is no majority left to compare with.
        num_ranks = int(rng.choice([64, 256] if shape == "node" else [16, 64, 256]))
        from_step = int(rng.integers(100, 300))
        out.append(
            Scenario(
                shape=shape,
                cause=cause,
                factor=factor,
                num_ranks=num_ranks,
                from_step=from_step,
                until_step=from_step + int(rng.integers(100, 250)) if recovers else None,
                seed=int(rng.integers(2**31)),
                ranks=tuple(sorted(rng.choice(num_ranks, 3 if shape == "several" else 1, False)))
                if shape != "node"
                else (),
                node=int(rng.integers(num_ranks // RANKS_PER_NODE)) if shape == "node" else None,
            )
        )
    return out


def evaluate_scenario(s: Scenario) -> ScenarioOutcome:
    common = {
        "factor": s.factor,
        "cause": s.cause,
        "from_step": s.from_step,
        "until_step": s.until_step,
    }
    spec = JobSpec(
        job_id=f"{s.shape}-{s.seed}",
        num_ranks=s.num_ranks,
        num_steps=600,
        stragglers=(Straggler(ranks=s.ranks, **common),) if s.ranks else (),  # type: ignore[arg-type]
        slow_nodes=(SlowNode(node=s.node, **common),) if s.node is not None else (),  # type: ignore[arg-type]
        seed=s.seed,
    )
    job = generate(spec)
    frames = to_frames(job)
    findings = analyze(
        frames["steps"],
        collectives=frames["collectives"],
        gpu=frames["gpu"],
        ranks=frames["ranks"],
        job=job.job,
    )
    out = ScenarioOutcome(scenario=s, expected=1 if s.node is not None else len(s.ranks))
    last_slow = (s.until_step or 600) - 1
    for f in findings:
        if f.kind not in STRAGGLER_KINDS or f.cause != s.cause:
            continue
        if (f.last_step if f.last_step is not None else 599) < s.from_step:
            continue
        if s.node is not None:
            hit = f.kind == "straggler_node" and f.node == f"node-{s.node:04d}"
        else:
            hit = bool(set(f.ranks) & set(s.ranks))
        if not hit:
            continue
        out.found += 1 if s.node is not None else len(set(f.ranks) & set(s.ranks))
        if s.until_step is not None and out.recovery_error is None:
            out.recovery_error = abs((f.last_step if f.last_step is not None else 599) - last_slow)
    out.found = min(out.found, out.expected)
    return out


def straggler_cases(jobs_per_cell: int, rng: np.random.Generator) -> list[Case]:
    cases = []
    for model, size, noise in itertools.product(MODELS, SIZES, NOISES):
        for i in range(jobs_per_cell):
            num_ranks = RANKS[i % len(RANKS)]
            cause = str(rng.choice(SYNTH_CAUSES)) if model == "synth" else "compute"
            cases.append(
                Case(
                    model=model,
                    noise=noise,
                    num_ranks=num_ranks,
                    seed=int(rng.integers(2**31)),
                    size=size,
                    cause=cause,
                    rank=int(rng.integers(num_ranks)),
                    onset=int(rng.integers(120, 181)),
                )
            )
    return cases


def clean_cases(per_kind: int, rng: np.random.Generator) -> list[Case]:
    cases = []
    for model, kind in itertools.product(MODELS, CLEAN_KINDS):
        for i in range(per_kind):
            cases.append(
                Case(
                    model=model,
                    noise=0.02 if kind == "spiky" else NOISES[i % len(NOISES)],
                    num_ranks=RANKS[i % len(RANKS)],
                    seed=int(rng.integers(2**31)),
                    clean_kind=kind,
                )
            )
    return cases


def _rate(part: int, whole: int) -> str:
    return f"{part / whole:6.1%}" if whole else "     -"


def table(title: str, outcomes: list[Outcome], key: Callable[[Outcome], object]) -> None:
    groups: dict[object, list[Outcome]] = defaultdict(list)
    for o in outcomes:
        groups[key(o)].append(o)
    print(f"\n{title:<26} {'jobs':>5} {'recall':>7} {'+cause':>7} {'latency p50':>12} {'p90':>5}")
    for k in sorted(groups, key=str):
        outs = groups[k]
        found = [o for o in outs if o.detected]
        latency = sorted(o.latency_steps for o in found if o.latency_steps is not None)
        p50 = f"{statistics.median(latency):.0f}" if latency else "-"
        p90 = f"{latency[int(0.9 * (len(latency) - 1))]}" if latency else "-"
        right = sum(o.right_cause for o in found)
        print(
            f"{k!s:<26} {len(outs):>5} {_rate(len(found), len(outs)):>7}"
            f" {_rate(right, len(outs)):>7} {p50:>12} {p90:>5}"
        )


def goal(label: str, outcomes: list[Outcome], wanted: float) -> bool:
    hits = sum(o.detected and o.right_cause for o in outcomes)
    ok = bool(outcomes) and hits / len(outcomes) >= wanted
    verdict = "ok" if ok else "MISSED"
    rate = _rate(hits, len(outcomes))
    print(f"GOAL {label}: {rate} of {len(outcomes)} (>= {wanted:.0%}) [{verdict}]")
    return ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=24, help="jobs per (model, size, noise)")
    parser.add_argument("--clean", type=int, default=24, help="clean jobs per (model, kind)")
    parser.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--seed", type=int, default=20240611)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    slowed = straggler_cases(args.jobs, rng)
    clean = clean_cases(args.clean, rng)

    t0 = time.perf_counter()
    with ProcessPoolExecutor(max_workers=args.workers) as pool:
        outcomes = list(pool.map(evaluate, slowed + clean, chunksize=4))
        scenario_out = list(pool.map(evaluate_scenario, scenarios(rng), chunksize=2))
    took = time.perf_counter() - t0
    slow_out = outcomes[: len(slowed)]
    clean_out = outcomes[len(slowed) :]
    analyse_s = [o.seconds for o in outcomes]
    print(
        f"{len(slowed)} jobs with a slowed rank, {len(clean)} clean jobs; {NUM_STEPS} steps,"
        f" {'/'.join(map(str, RANKS))} ranks; {took:.0f} s on {args.workers} workers"
        f" (analyze() median {statistics.median(analyse_s) * 1e3:.0f} ms per job)"
    )
    print(
        f"recall: the rank named, detected within {MAX_LATENCY_STEPS} steps of the onset;"
        " +cause: and with its cause"
    )

    table("by slowdown (of compute)", slow_out, lambda o: f"{o.case.size:>4.0%}")
    table("by noise per step", slow_out, lambda o: f"{o.case.noise:>4.0%}")
    table("by model", slow_out, lambda o: o.case.model)
    table("by ranks", slow_out, lambda o: f"{o.case.num_ranks:>4} ranks")
    table(
        "synth by cause", [o for o in slow_out if o.case.model == "synth"], lambda o: o.case.cause
    )
    table(
        "32 ranks, noise 2%",
        [o for o in slow_out if o.case.num_ranks == 32 and o.case.noise == 0.02],
        lambda o: f"{o.case.size:>4.0%}",
    )
    table(
        "by model, slowdown (noise<=2%)",
        [o for o in slow_out if o.case.noise <= 0.02],
        lambda o: f"{o.case.model:<9} {o.case.size:>4.0%}",
    )
    table(
        "by model, noise (>=3%)",
        [o for o in slow_out if o.case.size >= 0.03],
        lambda o: f"{o.case.model:<9} {o.case.noise:>4.0%}",
    )

    found = [o for o in slow_out if o.detected]
    errors = [abs(o.onset_error) for o in found if o.onset_error is not None]
    if errors:
        within = sum(e <= 20 for e in errors)
        print(
            f"\nonset error |first_step - onset|: median {statistics.median(errors):.0f} steps,"
            f" max {max(errors)}; within 20 steps: {_rate(within, len(errors))}"
        )
    false = sum(o.false_stragglers for o in slow_out)
    print(f"straggler findings naming no slowed rank, in jobs with one: {false}")
    with_change = [o for o in slow_out if o.change_at_onset]
    named = sum(o.change_names_rank for o in with_change)
    print(
        f"throughput drops at the onset: {len(with_change)}; naming the slowed rank as cause:"
        f" {_rate(named, len(with_change))}"
    )
    print("\nimpact of the found stragglers (share of the job's step time, GPU-equivalents):")
    print(f"{'slowdown':<10} {'ranks':>5} {'share p50':>10} {'GPUs p50':>9}  severities")
    groups: dict[tuple[float, int], list[Outcome]] = defaultdict(list)
    for o in found:
        groups[(o.case.size, o.case.num_ranks)].append(o)
    for (size, num_ranks), outs in sorted(groups.items()):
        shares = [o.impact_share for o in outs if o.impact_share is not None]
        gpus = [o.gpus for o in outs if o.gpus is not None]
        severities = dict(Counter(o.severity for o in outs))
        print(
            f"{size:<10.0%} {num_ranks:>5} {statistics.median(shares):>10.2%}"
            f" {statistics.median(gpus):>9.2f}  {severities}"
        )

    print("\nsimulator scenarios (600 steps, 16-256 ranks): named with the right cause")
    print(f"{'':<26} {'slowed':>7} {'found':>7}")
    by_key: dict[tuple[str, float | str], list[ScenarioOutcome]] = defaultdict(list)
    for o in scenario_out:
        s = o.scenario
        for key in (("shape", s.shape), ("slowdown", s.factor - 1), ("cause", s.cause)):
            by_key[key].append(o)
    for (what, value), outs in sorted(by_key.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
        label = f"{what} {value:.0%}" if isinstance(value, float) else f"{what} {value}"
        expected = sum(o.expected for o in outs)
        print(f"{label:<26} {expected:>7} {_rate(sum(o.found for o in outs), expected):>7}")
    errors = [o.recovery_error for o in scenario_out if o.recovery_error is not None]
    if errors:
        within = _rate(sum(e <= 20 for e in errors), len(errors))
        print(
            f"recovered slowdowns found: {len(errors)}; |last_step - last slow step| median"
            f" {statistics.median(errors):.0f}, within 20 steps: {within}"
        )

    print()
    ok = True
    for model in MODELS:
        mine = [o for o in slow_out if o.case.model == model and o.case.noise <= 0.02]
        ok &= goal(
            f"{model}: slowdowns >= 3%, noise <= 2%",
            [o for o in mine if o.case.size >= 0.03],
            0.95,
        )
        ok &= goal(
            f"{model}: slowdowns of 2%, noise <= 2%", [o for o in mine if o.case.size == 0.02], 0.80
        )

    print(f"\nclean jobs: {len(clean_out)} ({', '.join(CLEAN_KINDS)}; every model)")
    flagged = [o for o in clean_out if o.kinds]
    by: dict[tuple[str, str], list[Outcome]] = defaultdict(list)
    for o in clean_out:
        by[(o.case.model, o.case.clean_kind or "")].append(o)
    for (model, kind), outs in sorted(by.items()):
        kinds: Counter[str] = Counter()
        for o in outs:
            kinds.update(o.kinds)
        with_findings = sum(bool(o.kinds) for o in outs)
        print(f"  {model:<9} {kind:<9} {len(outs):>3} jobs, with findings: {with_findings}", end="")
        print(f" {dict(kinds)}" if kinds else "")
    clean_ok = not flagged and len(clean_out) >= 200
    print(
        f"GOAL no finding of any kind on >= 200 clean jobs: {len(flagged)} of {len(clean_out)}"
        f" have findings [{'ok' if clean_ok else 'MISSED'}]"
    )
    for o in flagged[:20]:
        c = o.case
        print(f"  {c.model} {c.clean_kind} noise {c.noise:.0%} {c.num_ranks} ranks", end="")
        print(f" seed {c.seed}: {dict(o.kinds)}")
    print(f"\nall goals {'met' if ok and clean_ok else 'NOT met'}")


if __name__ == "__main__":
    main()
