"""vLLM's development endpoints, behind the API key: sleep and wake, profile.

``POST /sleep?level=1`` frees the KV cache (level 2: the weights too), refused (400) while
requests are in flight; ``POST /wake_up`` brings them back; ``GET /is_sleeping``. While the
engine sleeps, generation requests are answered 503 (EngineSleepingError). With
``observability.profile_dir`` set, ``POST /start_profile`` and ``POST /stop_profile`` run the
torch profiler in every worker (one chrome trace per worker process in that folder).
"""

from __future__ import annotations

from fastapi import APIRouter, Query, Request, Response

from baton_openai.http.openapi import error_responses
from baton_openai.pipeline.context import ServerContext

router = APIRouter()


@router.post("/sleep", response_class=Response, responses=error_responses(400, 401, 500))
async def sleep(
    raw: Request, level: int = Query(1, description="1: free the KV cache; 2: the weights too")
) -> Response:
    await ServerContext.of(raw).engine.sleep(level)
    return Response(status_code=200)


@router.post("/wake_up", response_class=Response, responses=error_responses(401, 500))
async def wake_up(raw: Request) -> Response:
    await ServerContext.of(raw).engine.wake_up()
    return Response(status_code=200)


@router.get("/is_sleeping", responses=error_responses(401, 500))
async def is_sleeping(raw: Request) -> dict[str, bool]:
    return {"is_sleeping": await ServerContext.of(raw).engine.is_sleeping()}


#: Mounted only when observability.profile_dir is set (vLLM's VLLM_TORCH_PROFILER_DIR).
profile_router = APIRouter()


@profile_router.post(
    "/start_profile", response_class=Response, responses=error_responses(400, 401, 500)
)
async def start_profile(raw: Request) -> Response:
    """Start the torch profiler in every worker."""
    await ServerContext.of(raw).engine.start_profile()
    return Response(status_code=200)


@profile_router.post("/stop_profile", responses=error_responses(400, 401, 500))
async def stop_profile(raw: Request) -> dict[str, list[str]]:
    """Stop it; the chrome traces written, one per worker process."""
    return {"traces": await ServerContext.of(raw).engine.stop_profile()}
