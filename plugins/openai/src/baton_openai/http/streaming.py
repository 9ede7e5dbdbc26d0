"""Server-sent events and client disconnects.

A client that goes away must abort its request in the engine. ``SSEResponse``
listens for ``http.disconnect`` while it streams (whatever the ASGI spec
version) and cancels the stream; ``cancel_on_disconnect`` does the same for a
response that is still being computed. Cancelling the stream closes the
AsyncLLM generator, whose ``finally`` aborts the request.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import Any, TypeVar

import anyio
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

T = TypeVar("T")
DONE = b"data: [DONE]\n\n"
#: What cancel_on_disconnect returns when the client left first.
DISCONNECTED: Any = object()


def sse(payload: str) -> bytes:
    return b"data: " + payload.encode() + b"\n\n"


def sse_event(event: str, payload: str) -> bytes:
    """A named event (``event:`` line), as the Responses and Messages APIs stream them."""
    return b"event: " + event.encode() + b"\ndata: " + payload.encode() + b"\n\n"


class SSEResponse(StreamingResponse):
    media_type = "text/event-stream"

    def __init__(self, content: Any, **kwargs: Any) -> None:
        headers = {
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",
            **kwargs.pop("headers", {}),
        }
        super().__init__(content, headers=headers, **kwargs)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tg:

                async def stream() -> None:
                    with contextlib.suppress(OSError):  # the client left mid-write
                        await self.stream_response(send)
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()  # the client left: cancel the stream, which aborts the request
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


async def wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``; if the client disconnects first, cancel it and return DISCONNECTED."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        return DISCONNECTED
    return task.result()
