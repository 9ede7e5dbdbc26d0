"""vLLM's development endpoints: put the engine to sleep and wake it (behind the API key).

``POST /sleep?level=1`` frees the KV cache (level 2: the weights too), refused (400) while
requests are in flight; ``POST /wake_up`` brings them back; ``GET /is_sleeping``. While the
engine sleeps, generation requests are answered 503 (EngineSleepingError).
"""

from __future__ import annotations

from fastapi import APIRouter, Query, Request, Response

from baton_openai.context import ServerContext
from baton_openai.openapi import error_responses

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
