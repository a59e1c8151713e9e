"""A job's hang (#19): the open hang finding and the ranks by state."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel

from stepscope import query
from stepscope.api.deps import EngineDep, JobIdDep, ReadAuth
from stepscope.api.errors import JOB_RESPONSES
from stepscope.api.schemas import FindingRead
from stepscope.pipeline.hang_monitor import HangMonitor, current_hang
from stepscope.query.summary import StoredFinding

router = APIRouter(tags=["jobs"], responses=JOB_RESPONSES)


class HangRead(BaseModel):
    """A job's hang now."""

    job_id: str
    hang: FindingRead | None
    """The open hang finding; null when the job is not known to hang."""
    hanging: bool
    """Some rank reports a hang now (it may not be attributed yet)."""
    pending_ranks: list[int]
    """Ranks the attribution waits to hear from."""
    explained_by_phase: bool
    """The ranks held up are in a declared phase (checkpointing, compilation): no hang."""
    ranks_by_state: dict[str, Any]
    """waiting: {collective: {group_name, mesh_dim, op, seq, num_ranks, ranks}}, elsewhere
    and silent: ranks (at most 1,000 listed; num_elsewhere, num_silent count them all)."""
    num_reports: int
    """Ranks that sent a hang report or heartbeat."""
    attributed_at: float | None
    """When this server last attributed the job's hang (epoch s)."""
    attribution_pending: bool
    """Reports are stored that the attribution has not seen yet (it follows within a
    second): once a report's POST is answered, the hang includes it when this is false."""


async def _hang_settings(request: Request) -> tuple[float, HangMonitor]:
    return request.app.state.settings.hang_silent_after_s, request.app.state.hang_monitor


HangSettingsDep = Annotated[tuple[float, HangMonitor], Depends(_hang_settings)]


@router.get("/jobs/{job_id}/hang", summary="A job's hang now")
def job_hang(
    engine: EngineDep, job_id: JobIdDep, hang_settings: HangSettingsDep, _auth: ReadAuth
) -> HangRead:
    """The open hang finding (or null) and the ranks by state: waiting in which collective,
    elsewhere, silent."""
    silent_after_s, monitor = hang_settings
    view = current_hang(engine, job_id, silent_after_s=silent_after_s)
    if view is None:
        query.job_summary(engine, job_id)  # 404 for an unknown job
        return HangRead(
            job_id=job_id,
            hang=None,
            hanging=False,
            pending_ranks=[],
            explained_by_phase=False,
            ranks_by_state={"waiting": {}, "elsewhere": [], "silent": []},
            num_reports=0,
            attributed_at=monitor.attributed_at.get(job_id),
            attribution_pending=monitor.pending(job_id),
        )
    finding = None
    if view.finding is not None and view.finding_id is not None:
        finding = FindingRead.of(StoredFinding(**view.finding.to_dict(), id=view.finding_id))
    return HangRead(
        job_id=job_id,
        hang=finding,
        hanging=view.state.hanging,
        pending_ranks=view.state.pending[:1000],
        explained_by_phase=view.state.explained_by_phase,
        ranks_by_state=view.state.ranks_by_state,
        num_reports=view.num_reports,
        attributed_at=monitor.attributed_at.get(job_id),
        attribution_pending=monitor.pending(job_id),
    )
