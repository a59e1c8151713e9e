"""Job-level findings from the step grid: data-bound jobs and ranks (dataloader_stall)."""

from __future__ import annotations

import warnings
from collections.abc import Set

import numpy as np
from numpy.typing import NDArray

from stepscope.analysis.config import AnalysisConfig
from stepscope.analysis.frames.grid import Ints, Matrix
from stepscope.analysis.stats.runs import offset, onset, runs
from stepscope.schema import Finding


def dataloader_findings(
    *,
    job_id: str,
    ranks: Ints,
    steps: Ints,
    data_s: Matrix,
    data_median_s: NDArray[np.float32],
    reference_step_s: NDArray[np.float32],
    data_straggler_ranks: Set[int],
    config: AnalysisConfig,
) -> list[Finding]:
    """dataloader_stall: the job waits for data in a large share of its steps, or some ranks do."""
    window = config.window_steps
    with np.errstate(all="ignore"):
        share = (data_median_s / reference_step_s).astype(np.float64)
    share = np.nan_to_num(share, nan=0.0)
    if share.size < window:
        return []
    usable = share.size // window * window
    stalled_windows = np.median(share[:usable].reshape(-1, window), axis=1) >= config.data_share
    flags = share >= config.data_share
    findings = []
    for w0, w1 in runs(stalled_windows):
        lo = onset(flags, max(0, (w0 - 1) * window), (w0 + 1) * window - 1, 0.5)
        ongoing = w1 == stalled_windows.size - 1
        hi = (
            share.size - 1
            if ongoing
            else offset(flags, lo, min((w1 + 2) * window, usable) - 1, 0.5)
        )
        observed = float(np.median(share[lo : hi + 1]))
        findings.append(
            _finding(job_id, [], steps[lo], None if ongoing else steps[hi], observed, config)
        )
    if findings:
        return findings

    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        rank_share = data_s / reference_step_s[:, None]
        mean_share = np.nanmean(rank_share, axis=0)
        candidates = np.flatnonzero(mean_share >= config.data_share)
        medians = np.nanmedian(rank_share[:, candidates], axis=0)
    stalled = [
        (int(ranks[r]), float(m))
        for r, m in zip(candidates, medians, strict=True)
        if m >= config.data_share and int(ranks[r]) not in data_straggler_ranks
    ]
    if not stalled:
        return []
    observed = float(np.median([m for _, m in stalled]))
    finding = _finding(job_id, [r for r, _ in stalled], steps[0], None, observed, config)
    finding.evidence["per_rank_data_share"] = dict(stalled)
    return [finding]


def _finding(
    job_id: str,
    ranks: list[int],
    first_step: np.int64,
    last_step: np.int64 | None,
    observed: float,
    config: AnalysisConfig,
) -> Finding:
    return Finding(
        job_id=job_id,
        kind="dataloader_stall",
        severity="critical" if observed >= config.critical_data_share else "warning",
        ranks=ranks,
        first_step=int(first_step),
        last_step=None if last_step is None else int(last_step),
        metric="data_share",
        expected=config.data_share,
        observed=observed,
        effect=observed / config.data_share - 1.0,
        cause="data",
        evidence={"data_share": observed, "scope": "ranks" if ranks else "job"},
    )
