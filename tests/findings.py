"""A stored straggler finding to build tests on: rank 5 on node-0001, compute +30% since step
20, costing the job its synchronous share."""

from __future__ import annotations

from stepscope.query import StoredFinding


def straggler(**kw: object) -> StoredFinding:
    base: dict[str, object] = {
        "id": 1,
        "job_id": "j",
        "kind": "straggler_rank",
        "severity": "critical",
        "ranks": [5],
        "node": "node-0001",
        "first_step": 20,
        "metric": "step_s",
        "expected": 0.5,
        "observed": 0.65,
        "effect": 0.3,
        "cause": "compute",
        "evidence": {
            "component": "compute_s",
            "rank_median_s": 0.62,
            "peers_median_s": 0.47,
            "synchronous": True,
        },
    }
    return StoredFinding(**{**base, **kw})  # type: ignore[arg-type]
