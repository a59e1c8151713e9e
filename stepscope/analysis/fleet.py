"""Fleet health (docs/fleet.md): each node's own effect on step time, separated from its jobs'.

Input: per (job, node) the node's level in that job (`node_levels.job_levels`: log of its own
time over the job's median rank) with a standard error. The model, on the log scale:

    level[job, node] = offset[job] + effect[node] + noise[job, node] + error[job, node]

- `offset` absorbs what a job's median does not (a small job whose median a slow node moves)
  and `effect` the node's own slowness; they are fitted alternately, the offsets as medians
  over a job's nodes, the effects as Huber means over a node's jobs (so a few odd jobs move
  them little), centred on the fleet's typical (median) node: an additive model fixes the
  effects only up to a constant, and most nodes are healthy.
- `noise` is the job-to-job variation of a node (its interaction with the job: data, place
  in the mesh, neighbours): a variance tau² estimated robustly from all the residuals, so a
  job counts with sigma² = tau² + se² and no job is ever measured better than tau.
- Evidence: a robust score of "effect > tolerance" (hardware is never quite equal): the sum
  over the node's jobs of its standardised residuals less the tolerance, each clipped at
  `clip` sigmas, over its null spread. One job adds at most
  `clip`, so one job (or two) never reaches the suspicion threshold whatever it shows.
- Shrinkage (empirical Bayes): a node's effect is the posterior mode of its Huber
  likelihood under a normal prior at 0 whose variance s² is the spread of true effects over
  the fleet (method of moments over the nodes' Huber means, never below `tolerance`²): few
  or noisy jobs pull it toward 0, and one job moves it at most 1.5 s²/sigma.
- Since when: the single most significant change of a node's clipped scores over time (a
  CUSUM split); when significant, only the jobs after it describe the node now, and their
  first is "since". A repaired node's old jobs stop counting against it.
- Confidence: 1 − the Bonferroni-adjusted one-sided p-value of the score over the nodes
  tested, 0..1. A suspect has `min_jobs` current jobs, confidence ≥ `min_confidence` and an
  effect ≥ `min_effect`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np
import polars as pl
from numpy.typing import NDArray

from stepscope.analysis.robust import MAD_TO_SIGMA

Floats = NDArray[np.float64]
_PHI = NormalDist()
_HUBER_K = 1.5
"""Huber's constant of the effect's M-estimate, in sigmas."""
_ITERATIONS = 8
"""Alternations of job offsets and node effects (from effects of 0)."""

INPUT_SCHEMA = {
    "job_id": pl.String,
    "node": pl.String,
    "ts": pl.Float64,
    "excess": pl.Float64,
    "se": pl.Float64,
}
"""The columns `fleet_health` reads (others are carried along)."""


@dataclass(kw_only=True, slots=True)
class FleetConfig:
    """Thresholds of the fleet model."""

    min_effect: float = 0.02
    """Smallest node effect (relative step time) a suspect has."""
    tolerance: float = 0.01
    """Effects up to this are the normal spread of hardware: the evidence (and confidence)
    is that a node is slower than this."""
    min_confidence: float = 0.95
    """Smallest confidence a suspect has."""
    min_jobs: int = 3
    """Fewest jobs (since the node's last change) a suspect has."""
    clip: float = 2.0
    """Most sigmas one job adds to a node's evidence."""
    split_z: float = 3.5
    """Significance (sigmas) of a change over time that starts a node's current period."""
    min_side_jobs: int = 5
    """Fewest jobs on either side of such a change."""

    def __post_init__(self) -> None:
        if not 0 < self.min_effect < 1 or not 0 < self.min_confidence < 1:
            raise ValueError("min_effect and min_confidence must be in (0, 1)")
        if not 0 <= self.tolerance <= self.min_effect:
            raise ValueError("tolerance must be in [0, min_effect]")
        if self.min_jobs < 1 or self.min_side_jobs < 1 or self.clip <= 0 or self.split_z <= 0:
            raise ValueError("min_jobs, min_side_jobs, clip and split_z must be > 0")


@dataclass(kw_only=True, slots=True)
class FleetHealth:
    """The fitted fleet: one row per node, one per (job, node)."""

    nodes: pl.DataFrame
    """node, effect (relative, shrunk), raw_effect, se, confidence, z, num_jobs (current),
    num_jobs_total, since (epoch s of the first current job, when a change was found or the
    node is a suspect), first_ts, last_ts, suspect; by effect, descending."""
    jobs: pl.DataFrame
    """job_id, node, ts, residual (relative: the node's excess in the job, less the job's
    offset), sigma (log units), score (clipped sigmas), current (after the node's change)."""
    tau: float
    """Job-to-job noise of a node (log units)."""
    prior_sd: float
    """Spread of the true effects over the fleet (log units), the shrinkage's prior."""


def fleet_health(levels: pl.DataFrame, config: FleetConfig | None = None) -> FleetHealth:
    """Every node's effect, confidence and since-when from per-(job, node) levels."""
    config = config or FleetConfig()
    if "gpu" in levels.columns:  # node rows only (a GPU's row has its UUID there)
        levels = levels.filter(pl.col("gpu").fill_null("") == "")
    frame = levels.select(*INPUT_SCHEMA).cast(INPUT_SCHEMA)  # type: ignore[arg-type]
    frame = frame.drop_nulls(["job_id", "node", "excess"]).filter(pl.col("excess").is_finite())
    frame = frame.with_columns(
        pl.col("se").fill_null(1.0).clip(lower_bound=1e-4), pl.col("ts").fill_null(0.0)
    )
    sizes = frame.group_by("job_id").agg(pl.len().alias("_n"))
    frame = frame.join(sizes.filter(pl.col("_n") >= 2), on="job_id").drop("_n")
    if frame.is_empty():
        return _empty()
    job_code = (frame["job_id"].rank("dense") - 1).to_numpy().astype(np.int64)
    node_code = (frame["node"].rank("dense") - 1).to_numpy().astype(np.int64)
    node_names = frame["node"].unique().sort().to_numpy()
    x = frame["excess"].to_numpy().astype(np.float64)
    se2 = frame["se"].to_numpy().astype(np.float64) ** 2
    num_jobs = int(job_code.max()) + 1
    num_nodes = node_names.size

    effect = np.zeros(num_nodes)
    tau2 = _robust_var(x) - float(np.median(se2))
    for _ in range(_ITERATIONS):
        offset = _group_median(job_code, x - effect[node_code], num_jobs)
        r = x - offset[job_code]
        sigma2 = max(tau2, 1e-8) + se2
        effect = _huber(node_code, r, sigma2, num_nodes)
        effect -= np.median(effect)  # effects are against the fleet's typical node
        tau2 = _robust_var(r - effect[node_code]) - float(np.median(se2))
    tau2 = max(tau2, 1e-8)
    sigma = np.sqrt(tau2 + se2)
    score = np.clip((r - math.log1p(config.tolerance)) / sigma, -config.clip, config.clip)
    spread = np.clip((r - effect[node_code]) / sigma, -config.clip, config.clip)
    null_var = max(float(np.mean(spread**2)), 0.25)

    ts = frame["ts"].to_numpy().astype(np.float64)
    current = _current(node_code, ts, score, null_var, num_nodes, config)
    effect_now = _huber(node_code[current], r[current], sigma[current] ** 2, num_nodes)
    n_now = np.bincount(node_code[current], minlength=num_nodes).astype(np.float64)
    sum_score = np.bincount(node_code[current], score[current], minlength=num_nodes)
    z = np.where(n_now > 0, sum_score / np.sqrt(np.maximum(n_now, 1.0) * null_var), 0.0)
    precision = np.bincount(node_code[current], 1.0 / sigma[current] ** 2, minlength=num_nodes)
    v = np.where(precision > 0, 1.0 / np.maximum(precision, 1e-300), np.inf)
    has = n_now >= config.min_jobs
    prior2 = float(np.mean(effect_now[has] ** 2 - v[has])) if has.any() else 0.0
    prior2 = max(prior2, math.log1p(config.tolerance) ** 2)
    shrunk = _huber(
        node_code[current], r[current], sigma[current] ** 2, num_nodes, prior_precision=1 / prior2
    )

    p_one = np.array([1.0 - _PHI.cdf(float(s)) for s in z])
    confidence = np.clip(1.0 - p_one * num_nodes, 0.0, 1.0)
    rel = np.expm1(shrunk)
    suspect = (
        (n_now >= config.min_jobs)
        & (confidence >= config.min_confidence)
        & (rel >= config.min_effect)
    )
    first_now = _group_min(node_code[current], ts[current], num_nodes)
    split = np.bincount(node_code[~current], minlength=num_nodes) > 0
    jobs = frame.select("job_id", "node", "ts").with_columns(
        residual=pl.Series(np.expm1(r)),
        sigma=pl.Series(sigma),
        score=pl.Series(score),
        current=pl.Series(current),
    )
    nodes = pl.DataFrame(
        {
            "node": node_names.astype(str),
            "effect": rel,
            "raw_effect": np.expm1(effect_now),
            "se": np.sqrt(v),
            "confidence": confidence,
            "z": z,
            "num_jobs": n_now.astype(np.int64),
            "num_jobs_total": np.bincount(node_code, minlength=num_nodes).astype(np.int64),
            "since": np.where(split | suspect, first_now, np.nan),
            "first_ts": _group_min(node_code, ts, num_nodes),
            "last_ts": -_group_min(node_code, -ts, num_nodes),
            "suspect": suspect,
        }
    ).with_columns(pl.col("since").fill_nan(None))
    nodes = nodes.sort(["suspect", "effect", "confidence"], descending=True)
    return FleetHealth(nodes=nodes, jobs=jobs, tau=math.sqrt(tau2), prior_sd=math.sqrt(prior2))


def _empty() -> FleetHealth:
    nodes = pl.DataFrame(
        schema={
            "node": pl.String,
            "effect": pl.Float64,
            "raw_effect": pl.Float64,
            "se": pl.Float64,
            "confidence": pl.Float64,
            "z": pl.Float64,
            "num_jobs": pl.Int64,
            "num_jobs_total": pl.Int64,
            "since": pl.Float64,
            "first_ts": pl.Float64,
            "last_ts": pl.Float64,
            "suspect": pl.Boolean,
        }
    )
    jobs = pl.DataFrame(
        schema={
            "job_id": pl.String,
            "node": pl.String,
            "ts": pl.Float64,
            "residual": pl.Float64,
            "sigma": pl.Float64,
            "score": pl.Float64,
            "current": pl.Boolean,
        }
    )
    return FleetHealth(nodes=nodes, jobs=jobs, tau=0.0, prior_sd=0.0)


def _robust_var(x: Floats) -> float:
    """The normal-equivalent variance of `x` about 0 from its median absolute value."""
    return float((MAD_TO_SIGMA * np.median(np.abs(x))) ** 2)


def _group_median(codes: NDArray[np.int64], values: Floats, size: int) -> Floats:
    """Median of `values` per code 0..size-1 (0 where a code has none)."""
    medians = pl.DataFrame({"c": codes, "v": values}).group_by("c").agg(pl.col("v").median())
    out = np.zeros(size)
    out[medians["c"].to_numpy()] = medians["v"].to_numpy()
    return out


def _group_min(codes: NDArray[np.int64], values: Floats, size: int) -> Floats:
    out = np.full(size, np.inf)
    np.minimum.at(out, codes, values)
    return np.where(np.isfinite(out), out, np.nan)


def _huber(
    codes: NDArray[np.int64], r: Floats, sigma2: Floats, size: int, prior_precision: float = 0.0
) -> Floats:
    """Per code, the Huber M-estimate of the location of `r` (weights 1/sigma2), from the
    median, by reweighting steps; with `prior_precision`, the posterior mode under a normal
    prior at 0 of that precision (one job then moves it at most Huber's k × sigma ×
    precision-ratio: bounded influence)."""
    mu = _group_median(codes, r, size)
    if prior_precision > 0:
        mu *= 0.0
    w0 = 1.0 / sigma2
    sigma = np.sqrt(sigma2)
    for _ in range(3 if prior_precision == 0 else 8):
        u = np.abs(r - mu[codes]) / sigma
        w = w0 * np.minimum(1.0, _HUBER_K / np.maximum(u, 1e-12))
        total = np.bincount(codes, w, minlength=size).astype(np.float64) + prior_precision
        mu = np.where(total > 0, np.bincount(codes, w * r, minlength=size) / total, 0.0)
    return mu


def _current(
    codes: NDArray[np.int64],
    ts: Floats,
    score: Floats,
    null_var: float,
    size: int,
    config: FleetConfig,
) -> NDArray[np.bool_]:
    """Per (job, node), whether it is after the node's most significant change over time
    (every job where there is none): a CUSUM split of the clipped scores, in time order."""
    order = np.lexsort((ts, codes))
    c, s = codes[order], score[order]
    n = np.bincount(c, minlength=size).astype(np.float64)
    starts = np.concatenate(([0], np.cumsum(n)[:-1])).astype(np.int64)
    k = np.arange(c.size) - starts[c] + 1.0  # jobs up to and including this one
    cum = np.cumsum(s)
    before = cum - (cum[starts[c]] - s[starts[c]])
    total = np.bincount(c, s, minlength=size)[c]
    nn = n[c]
    after_n = nn - k
    valid = (k >= config.min_side_jobs) & (after_n >= config.min_side_jobs)
    with np.errstate(invalid="ignore", divide="ignore"):
        diff = (total - before) / after_n - before / k
        t = np.where(valid, np.abs(diff) * np.sqrt(k * after_n / nn / null_var), 0.0)
    best = np.full(size, -1.0)
    np.maximum.at(best, c, t)
    at_best = (t == best[c]) & (t >= config.split_z)
    cut = np.full(size, -1.0)
    np.maximum.at(cut, c, np.where(at_best, k, -1.0))
    keep_sorted = k > cut[c]
    out = np.empty(c.size, dtype=bool)
    out[order] = keep_sorted
    return out
