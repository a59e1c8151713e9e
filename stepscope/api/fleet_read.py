"""The fleet response models (#21): what GET /api/v1/nodes and /nodes/{node} answer."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from stepscope.query.fleet import NodeDetail, NodeList


class NodeRead(BaseModel):
    """One node's own effect on step time over its jobs (docs/fleet.md)."""

    node: str
    effect: float | None
    """Relative excess of its own time over its jobs' median rank, shrunk (0.05: 5 % slow)."""
    raw_effect: float | None
    """The same before shrinkage (its robust mean over its current jobs)."""
    se: float | None
    """Standard error of the effect (log units, about relative)."""
    confidence: float
    """0..1: 1 − the fleet-wide (Bonferroni) p-value that a healthy node looks this slow."""
    z: float
    """The robust score (sigmas) of effect > 0; one job adds at most 2."""
    num_jobs: int
    """Jobs since its last change (those the effect is from)."""
    num_jobs_total: int
    since: float | None
    """Epoch s of the first job of its current period (set for suspects and changed nodes)."""
    first_ts: float | None
    last_ts: float | None
    suspect: bool


class NodesPage(BaseModel):
    """Nodes in the order asked, and the fleet's figures."""

    nodes: list[NodeRead]
    num_nodes: int
    num_suspects: int
    num_jobs: int
    job_noise: float
    """Typical job-to-job variation of a node's excess (relative)."""
    prior_sd: float
    """Spread of the true node effects over the fleet (relative): the shrinkage's prior."""

    @classmethod
    def of(cls, page: NodeList) -> NodesPage:
        return cls(
            nodes=[NodeRead.model_validate(n) for n in page.nodes],
            num_nodes=page.num_nodes,
            num_suspects=page.num_suspects,
            num_jobs=page.num_jobs,
            job_noise=page.tau,
            prior_sd=page.prior_sd,
        )


class NodeJobRead(BaseModel):
    """The node in one job."""

    job_id: str
    name: str | None
    ts: float | None
    """The job's start (epoch s)."""
    ranks: str
    """Its ranks there (schema.compact_ranks)."""
    level: float
    """Its own time over the job's median rank − 1."""
    residual: float | None
    """The same, less the job's offset (what the model attributes to node and noise)."""
    score: float | None
    """Residual in sigmas, clipped: this job's weight of evidence."""
    current: bool | None
    """After the node's last change (counts toward its effect)."""


class NodeGpuRead(BaseModel):
    """One GPU (NVML UUID) of the node."""

    gpu: str
    ranks: str
    num_jobs: int
    median_excess: float
    last_excess: float
    last_ts: float | None


class NodeDetailRead(BaseModel):
    """One node: its effect, jobs over time, GPUs and the findings naming it."""

    node: NodeRead
    jobs: list[NodeJobRead]
    gpus: list[NodeGpuRead]
    findings: list[dict[str, Any]]

    @classmethod
    def of(cls, d: NodeDetail) -> NodeDetailRead:
        return cls(
            node=NodeRead.model_validate(d.node),
            jobs=[NodeJobRead.model_validate(j) for j in d.jobs],
            gpus=[NodeGpuRead.model_validate(g) for g in d.gpus],
            findings=d.findings,
        )
