"""The REST query API under /api/v1: thin routes over stepscope.query."""

from fastapi import APIRouter

from stepscope.api.routes import captures, charts, compare, exports, goodput, hangs, jobs, nodes

router = APIRouter(prefix="/api/v1")
for module in (jobs, hangs, goodput, charts, exports, compare, nodes, captures):
    router.include_router(module.router)
