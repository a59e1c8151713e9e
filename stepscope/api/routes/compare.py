"""Two jobs compared."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from stepscope import query
from stepscope.api.deps import NO_NUL, EngineDep, ReadAuth
from stepscope.api.errors import JOB_RESPONSES
from stepscope.api.schemas import ComparisonRead
from stepscope.schema import MAX_ID_CHARS

router = APIRouter(tags=["jobs"], responses=JOB_RESPONSES)

JobParam = Annotated[str, Query(min_length=1, max_length=MAX_ID_CHARS, pattern=NO_NUL)]


@router.get("/compare", summary="Compare two jobs")
def compare(
    engine: EngineDep, _auth: ReadAuth, baseline: JobParam, candidate: JobParam
) -> ComparisonRead:
    """Both jobs' summaries and their differences per metric and per time component."""
    return ComparisonRead.of(query.compare(engine, baseline, candidate))
