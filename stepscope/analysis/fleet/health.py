"""Fleet health (docs/fleet.md): each node's own effect on step time, separated from its jobs'.

Input: per (job, node) the node's level in that job (`node_levels.job_levels`: log of its own
time over the job's median rank) with a standard error. The model, on the log scale:

    level[job, node] = offset[job] + effect[node] + noise[job, node] + error[job, node]

- `offset` absorbs what a job's median does not (a small job whose median a slow node moves)
  and `effect` the node's own slowness; they are fitted alternately, the offsets as Huber
  means over a job's nodes, the effects as Huber means over a node's jobs (so a few odd jobs move
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
from dataclasses import dataclass, fields
from statistics import NormalDist
from typing import Any

import numpy as np
import polars as pl
from numpy.typing import NDArray

from stepscope.analysis.stats.robust import MAD_TO_SIGMA

Floats = NDArray[np.float64]
_PHI = NormalDist()
_HUBER_K = 1.5
"""Huber's constant of the effect's M-estimate, in sigmas."""
_ITERATIONS = 8
"""Alternations of job offsets and node effects (one Huber step each after the first)."""
_WARM_ITERATIONS = 2
"""Alternations from a previous fit's offsets and effects (a job more changes them little)."""

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
    fit: pl.DataFrame | None = None
    """The alternation's end: per job ("job", job_id, offset) and node ("node", node,
    effect), log units: `fleet_health(..., start=fit)` refits from there."""
    state: FleetState | None = None
    """What `add_jobs` updates locally."""


@dataclass(kw_only=True, slots=True)
class _Rows:
    """The model's input, one entry per (job, node) row."""

    ids: pl.DataFrame
    """job_id, node, ts."""
    job_code: NDArray[np.int64]
    node_code: NDArray[np.int64]
    x: Floats
    """The node's excess in the job (log units)."""
    se2: Floats
    ts: Floats


@dataclass(kw_only=True, slots=True)
class _NodeFigures:
    """Per node: what its current period says."""

    effect_now: Floats
    shrunk: Floats
    n_now: Floats
    z: Floats
    var: Floats
    n_total: Floats
    split: NDArray[np.bool_]
    first_ts: Floats
    last_ts: Floats
    first_current_ts: Floats


@dataclass(kw_only=True, slots=True)
class FleetState:
    """A full fit's arrays, which `add_jobs` extends by new jobs without refitting the rest."""

    config: FleetConfig
    rows: _Rows
    job_names: list[str]
    node_names: list[str]
    offset: Floats
    effect: Floats
    r: Floats
    sigma: Floats
    score: Floats
    current: NDArray[np.bool_]
    figures: _NodeFigures
    tau2: float
    null_var: float
    prior2: float
    num_added_jobs: int = 0
    """Jobs added locally since the full fit."""


def fleet_health(
    levels: pl.DataFrame, config: FleetConfig | None = None, *, start: pl.DataFrame | None = None
) -> FleetHealth:
    """Every node's effect, confidence and since-when from per-(job, node) levels; `start`,
    a previous fit's `fit`, makes a refit after a few new jobs take a few alternations."""
    config = config or FleetConfig()
    prepared = _prepare(levels)
    if prepared is None:
        return _empty()
    rows, job_names, node_names = prepared
    x, se2, job_code, node_code = rows.x, rows.se2, rows.job_code, rows.node_code
    num_jobs, num_nodes = job_names.len(), node_names.len()
    effect, offset = _started(start, node_names, job_names)
    median_se2 = float(np.median(se2))
    tau2 = _robust_var(x) - median_se2
    warm = effect is not None
    for i in range(_WARM_ITERATIONS if warm else _ITERATIONS):
        sigma2 = max(tau2, 1e-8) + se2
        steps = 3 if i == 0 and not warm else 1  # later alternations start from the last
        own = x if effect is None else x - np.take(effect, node_code)
        offset = _huber(job_code, own, sigma2, num_jobs, start=offset, steps=steps)
        r = x - np.take(offset, job_code)
        effect = _huber(node_code, r, sigma2, num_nodes, start=effect, steps=steps)
        effect -= np.median(effect)  # effects are against the fleet's typical node
        tau2 = _robust_var(r - np.take(effect, node_code)) - median_se2
    assert effect is not None
    assert offset is not None
    tau2 = max(tau2, 1e-8)
    sigma = np.sqrt(tau2 + se2)
    score = _scores(r, sigma, config)
    spread = np.clip((r - effect[node_code]) / sigma, -config.clip, config.clip)
    null_var = max(float(np.mean(spread**2)), 0.25)
    current, figures, prior2 = _node_figures(
        rows, r, sigma, score, effect, num_nodes, null_var, None, config
    )
    state = FleetState(
        config=config,
        rows=rows,
        job_names=job_names.to_list(),
        node_names=node_names.to_list(),
        offset=offset,
        effect=effect,
        r=r,
        sigma=sigma,
        score=score,
        current=current,
        figures=figures,
        tau2=tau2,
        null_var=null_var,
        prior2=prior2,
    )
    return _health(state)


def add_jobs(previous: FleetHealth, levels: pl.DataFrame) -> FleetHealth | None:
    """`previous` with the (job, node) levels of new jobs, updated locally: the new jobs'
    offsets, then their nodes' effects, periods and evidence, every other node and job as
    fitted; milliseconds where a full fit of a large fleet takes a second. The fleet's noise
    and prior stay as fitted, so a full fit now and then (after many jobs) keeps them true.
    None when `levels` holds a job already fitted (a refit is needed)."""
    state = previous.state
    prepared = _prepare(levels)
    if state is None:
        return None
    if prepared is None:
        return previous
    fresh, fresh_jobs, fresh_nodes = prepared
    known_jobs = dict(zip(state.job_names, range(len(state.job_names)), strict=True))
    if any(job in known_jobs for job in fresh_jobs):
        return None
    config = state.config
    node_index = dict(zip(state.node_names, range(len(state.node_names)), strict=True))
    node_names = state.node_names + [n for n in fresh_nodes if n not in node_index]
    num_nodes = len(node_names)
    grown = num_nodes - len(state.node_names)
    node_index.update((n, i) for i, n in enumerate(node_names) if n not in node_index)
    to_node = np.array([node_index[n] for n in fresh_nodes], dtype=np.int64)
    node_code = to_node[fresh.node_code]
    effect = np.concatenate([state.effect, np.zeros(grown)])

    # The new jobs' offsets against the fitted effects, and their rows' residuals.
    sigma = np.sqrt(state.tau2 + fresh.se2)
    own = fresh.x - effect[node_code]
    offset = _huber(fresh.job_code, own, sigma**2, fresh_jobs.len(), steps=3)
    r = fresh.x - offset[fresh.job_code]
    rows = _Rows(
        ids=pl.concat([state.rows.ids, fresh.ids]),
        job_code=np.concatenate([state.rows.job_code, fresh.job_code + len(state.job_names)]),
        node_code=np.concatenate([state.rows.node_code, node_code]),
        x=np.concatenate([state.rows.x, fresh.x]),
        se2=np.concatenate([state.rows.se2, fresh.se2]),
        ts=np.concatenate([state.rows.ts, fresh.ts]),
    )
    all_r = np.concatenate([state.r, r])
    all_sigma = np.concatenate([state.sigma, sigma])
    all_score = np.concatenate([state.score, _scores(r, sigma, config)])

    # Their nodes, refitted on all their rows.
    touched = np.unique(node_code)
    local = np.full(num_nodes, -1, dtype=np.int64)
    local[touched] = np.arange(touched.size)
    at = np.flatnonzero(local[rows.node_code] >= 0)
    sub = _Rows(
        ids=rows.ids,  # not read by _node_figures
        job_code=rows.job_code[at],
        node_code=local[rows.node_code[at]],
        x=rows.x[at],
        se2=rows.se2[at],
        ts=rows.ts[at],
    )
    sub_r, sub_sigma = all_r[at], all_sigma[at]
    effect[touched] = _huber(
        sub.node_code, sub_r, sub_sigma**2, touched.size, start=effect[touched], steps=2
    )
    sub_current, sub_figures, _ = _node_figures(
        sub, sub_r, sub_sigma, all_score[at], effect[touched], touched.size,
        state.null_var, state.prior2, config,
    )  # fmt: skip
    current = np.concatenate([state.current, np.ones(r.size, dtype=bool)])
    current[at] = sub_current
    figures = _NodeFigures(
        **{
            f.name: _grown(
                getattr(state.figures, f.name), grown, touched, getattr(sub_figures, f.name)
            )
            for f in fields(_NodeFigures)
        }
    )
    updated = FleetState(
        config=config,
        rows=rows,
        job_names=state.job_names + fresh_jobs.to_list(),
        node_names=node_names,
        offset=np.concatenate([state.offset, offset]),
        effect=effect,
        r=all_r,
        sigma=all_sigma,
        score=all_score,
        current=current,
        figures=figures,
        tau2=state.tau2,
        null_var=state.null_var,
        prior2=state.prior2,
        num_added_jobs=state.num_added_jobs + fresh_jobs.len(),
    )
    return _health(updated)


def _grown(
    values: NDArray[Any], grown: int, at: NDArray[np.int64], new: NDArray[Any]
) -> NDArray[Any]:
    """Per-node `values` with `grown` new nodes, and `new` values at `at`."""
    out = np.concatenate([values, np.zeros(grown, dtype=values.dtype)])
    out[at] = new
    return out


def _prepare(levels: pl.DataFrame) -> tuple[_Rows, pl.Series, pl.Series] | None:
    """The rows the model reads (jobs of one node dropped), with the sorted job and node
    names their codes index; None when there are none."""
    if "gpu" in levels.columns:  # node rows only (a GPU's row has its UUID there)
        levels = levels.filter(pl.col("gpu").fill_null("") == "")
    if levels.is_empty():
        return None
    frame = levels.select(*INPUT_SCHEMA).cast(INPUT_SCHEMA)  # type: ignore[arg-type]
    frame = frame.drop_nulls(["job_id", "node", "excess"]).filter(pl.col("excess").is_finite())
    frame = frame.with_columns(
        pl.col("se").fill_null(1.0).clip(lower_bound=1e-4), pl.col("ts").fill_null(0.0)
    )
    if frame.is_empty():
        return None
    job_names = frame["job_id"].unique().sort()
    job_code = _codes(frame["job_id"], job_names)
    sizes = np.bincount(job_code)
    if (sizes[job_code] < 2).any():  # a job of one node says nothing about it
        frame = frame.filter(pl.Series(sizes[job_code] >= 2))
        if frame.is_empty():
            return None
        job_names = frame["job_id"].unique().sort()
        job_code = _codes(frame["job_id"], job_names)
    node_names = frame["node"].unique().sort()
    rows = _Rows(
        ids=frame.select("job_id", "node", "ts"),
        job_code=job_code,
        node_code=_codes(frame["node"], node_names),
        x=frame["excess"].to_numpy().astype(np.float64),
        se2=frame["se"].to_numpy().astype(np.float64) ** 2,
        ts=frame["ts"].to_numpy().astype(np.float64),
    )
    return rows, job_names, node_names


def _scores(r: Floats, sigma: Floats, config: FleetConfig) -> Floats:
    """Each row's evidence that its node is slower than the tolerance, clipped (sigmas)."""
    return np.clip((r - math.log1p(config.tolerance)) / sigma, -config.clip, config.clip)


def _node_figures(
    rows: _Rows,
    r: Floats,
    sigma: Floats,
    score: Floats,
    effect: Floats,
    num_nodes: int,
    null_var: float,
    prior2: float | None,
    config: FleetConfig,
) -> tuple[NDArray[np.bool_], _NodeFigures, float]:
    """Each row's current flag and each node's figures over its current period; the prior's
    variance, estimated from the nodes when `prior2` is None."""
    node_code = rows.node_code
    periods = _periods(node_code, rows.job_code, rows.ts, score, null_var, num_nodes, config)
    current = periods.current
    code_now, r_now, sigma2_now = node_code[current], r[current], sigma[current] ** 2
    effect_now = _huber(code_now, r_now, sigma2_now, num_nodes, start=effect, steps=4)
    n_now = np.bincount(code_now, minlength=num_nodes).astype(np.float64)
    sum_score = np.bincount(code_now, score[current], minlength=num_nodes)
    z = np.where(n_now > 0, sum_score / np.sqrt(np.maximum(n_now, 1.0) * null_var), 0.0)
    precision = np.bincount(code_now, 1.0 / sigma2_now, minlength=num_nodes)
    var = np.where(precision > 0, 1.0 / np.maximum(precision, 1e-300), np.inf)
    if prior2 is None:
        has = n_now >= config.min_jobs
        prior2 = float(np.mean(effect_now[has] ** 2 - var[has])) if has.any() else 0.0
        prior2 = max(prior2, math.log1p(config.tolerance) ** 2)
    shrunk = _huber(
        code_now, r_now, sigma2_now, num_nodes, start=effect_now, steps=4,
        prior_precision=1 / prior2,
    )  # fmt: skip
    figures = _NodeFigures(
        effect_now=effect_now,
        shrunk=shrunk,
        n_now=n_now,
        z=z,
        var=var,
        n_total=np.bincount(node_code, minlength=num_nodes).astype(np.float64),
        split=np.bincount(node_code[~current], minlength=num_nodes) > 0,
        first_ts=periods.first_ts,
        last_ts=periods.last_ts,
        first_current_ts=periods.first_current_ts,
    )
    return current, figures, prior2


def _health(state: FleetState) -> FleetHealth:
    """The frames of a fitted state."""
    config, f = state.config, state.figures
    num_nodes = len(state.node_names)
    p_one = np.array([1.0 - _PHI.cdf(float(s)) for s in f.z])
    confidence = np.clip(1.0 - p_one * num_nodes, 0.0, 1.0)
    rel = np.expm1(f.shrunk)
    suspect = (
        (f.n_now >= config.min_jobs)
        & (confidence >= config.min_confidence)
        & (rel >= config.min_effect)
    )
    jobs = state.rows.ids.with_columns(
        residual=pl.Series(np.expm1(state.r)),
        sigma=pl.Series(state.sigma),
        score=pl.Series(state.score),
        current=pl.Series(state.current),
    )
    nodes = pl.DataFrame(
        {
            "node": pl.Series(state.node_names, dtype=pl.String),
            "effect": rel,
            "raw_effect": np.expm1(f.effect_now),
            "se": np.sqrt(f.var),
            "confidence": confidence,
            "z": f.z,
            "num_jobs": f.n_now.astype(np.int64),
            "num_jobs_total": f.n_total.astype(np.int64),
            "since": np.where(f.split | suspect, f.first_current_ts, np.nan),
            "first_ts": f.first_ts,
            "last_ts": f.last_ts,
            "suspect": suspect,
        }
    ).with_columns(pl.col("since").fill_nan(None))
    nodes = nodes.sort(["suspect", "effect", "confidence"], descending=True)
    fit = pl.concat(
        [
            pl.DataFrame({"kind": "job", "name": state.job_names, "value": state.offset}),
            pl.DataFrame({"kind": "node", "name": state.node_names, "value": state.effect}),
        ]
    )
    return FleetHealth(
        nodes=nodes,
        jobs=jobs,
        tau=math.sqrt(state.tau2),
        prior_sd=math.sqrt(state.prior2),
        fit=fit,
        state=state,
    )


def _started(
    start: pl.DataFrame | None, node_names: pl.Series, job_names: pl.Series
) -> tuple[Floats | None, Floats | None]:
    """A previous fit's (effects, offsets) on these nodes and jobs (0 for new ones)."""
    if start is None or start.is_empty():
        return None, None
    out = []
    for kind, names in (("node", node_names), ("job", job_names)):
        values = np.zeros(names.len())
        known = start.filter(pl.col("kind") == kind, pl.col("name").is_in(names.implode()))
        at = known["name"].cast(pl.Enum(names)).to_physical().to_numpy()
        values[at] = known["value"].to_numpy()
        out.append(values)
    return out[0], out[1]


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
    """The normal-equivalent variance of `x` about 0 from its median absolute value (of at
    most about 100,000 of them, evenly spaced: plenty for a spread)."""
    sample = x[:: max(1, x.size // 100_000)]
    return float((MAD_TO_SIGMA * np.median(np.abs(sample))) ** 2)


def _huber(
    codes: NDArray[np.int64],
    r: Floats,
    sigma2: Floats,
    size: int,
    *,
    start: Floats | None = None,
    steps: int = 3,
    prior_precision: float = 0.0,
) -> Floats:
    """Per code, the Huber M-estimate of the location of `r` (weights 1/sigma2) by `steps`
    reweighting steps from `start` (the weighted means when None); with `prior_precision`,
    the posterior mode under a normal prior at 0 of that precision (one job then moves it
    at most Huber's k × sigma × its share of the precision: bounded influence). 0 where a
    code has no value."""
    w0 = 1.0 / sigma2
    if start is None:
        total = np.bincount(codes, w0, minlength=size) + prior_precision
        start = np.bincount(codes, w0 * r, minlength=size) / np.where(total > 0, total, 1.0)
    mu = start
    inv_sigma = np.sqrt(w0)
    for _ in range(steps):
        u = np.abs(r - np.take(mu, codes))
        u *= inv_sigma / _HUBER_K
        np.maximum(u, 1.0, out=u)
        w = w0 / u  # Huber's weights: 1 within k sigmas, k sigmas / |residual| beyond
        total = np.bincount(codes, w, minlength=size) + prior_precision
        mu = np.bincount(codes, w * r, minlength=size) / np.where(total > 0, total, 1.0)
    return mu


def _codes(values: pl.Series, names: pl.Series) -> NDArray[np.int64]:
    """Each value's index in `names` (its distinct values, sorted)."""
    return values.cast(pl.Enum(names)).to_physical().to_numpy().astype(np.int64)


@dataclass(kw_only=True, slots=True)
class _Periods:
    current: NDArray[np.bool_]
    """Per (job, node) row: after the node's change (every row of a node without one)."""
    first_ts: Floats
    last_ts: Floats
    first_current_ts: Floats
    """Per node."""


def _periods(
    codes: NDArray[np.int64],
    job_codes: NDArray[np.int64],
    ts: Floats,
    score: Floats,
    null_var: float,
    size: int,
    config: FleetConfig,
) -> _Periods:
    """Each node's current period: the jobs after its most significant change over time
    (all of them where there is none), a CUSUM split of the clipped scores in time order;
    and its first and last job's time. Every code 0..size-1 has a row."""
    # One integer sort by (node, job in time order): a job's ts is its start, one per job.
    num_jobs = int(job_codes.max()) + 1
    job_ts = np.zeros(num_jobs)
    job_ts[job_codes] = ts
    job_rank = np.empty(num_jobs, dtype=np.int64)
    job_rank[np.argsort(job_ts, kind="stable")] = np.arange(num_jobs)
    if ts.size < 2 or bool(np.all(ts[1:] >= ts[:-1])):
        # Rows already in time order (as the query layer keeps them): a stable sort by node
        # alone, a radix sort of small integers, keeps each node's jobs in time order.
        order = np.argsort(codes.astype(np.uint32), kind="stable")
    else:
        order = np.argsort(codes * num_jobs + np.take(job_rank, job_codes))
    c, s, t_sorted = codes[order], score[order], ts[order]
    n = np.bincount(c, minlength=size)
    starts = np.concatenate(([0], np.cumsum(n)[:-1])).astype(np.int64)
    ends = starts + n - 1
    k = np.arange(c.size) - np.take(starts, c) + 1.0  # jobs up to and including this one
    cum = np.cumsum(s)
    before = cum - np.take(cum[starts] - s[starts], c)
    total = np.take(np.bincount(c, s, minlength=size), c)
    nn = np.take(n.astype(np.float64), c)
    after_n = nn - k
    valid = (k >= config.min_side_jobs) & (after_n >= config.min_side_jobs)
    with np.errstate(invalid="ignore", divide="ignore"):
        diff = (total - before) / after_n - before / k
        t = np.where(valid, np.abs(diff) * np.sqrt(k * after_n / nn / null_var), 0.0)
    best = np.maximum.reduceat(t, starts)
    at_best = (t == np.take(best, c)) & (t >= config.split_z)
    cut = np.maximum.reduceat(np.where(at_best, k, -1.0), starts)
    keep_sorted = k > np.take(cut, c)
    current = np.empty(c.size, dtype=bool)
    current[order] = keep_sorted
    first_current = starts + np.maximum(cut, 0).astype(np.int64)
    return _Periods(
        current=current,
        first_ts=t_sorted[starts],
        last_ts=t_sorted[ends],
        first_current_ts=t_sorted[first_current],
    )
