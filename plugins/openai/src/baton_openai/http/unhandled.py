"""The last resort for an exception no handler took: one 500, one traceback, the connection kept.

Starlette's ServerErrorMiddleware answers an unhandled exception with a 500 but
then re-raises it, so uvicorn logs a second traceback and closes the
connection: the client's next request on that keep-alive connection fails.
This middleware sits just inside it and ends the story: before the response
has started, a 500 in OpenAI's shape goes out and the connection stays usable;
after it has started (a stream), the traceback is logged and the response is
left incomplete, so uvicorn closes the connection and the client sees a
truncated stream, as before. Nothing is re-raised.
"""

from __future__ import annotations

import json
import logging

from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from baton_openai.http.errors import from_baton_error

log = logging.getLogger("baton_openai")


class UnhandledErrors:
    """Pure ASGI middleware: unhandled exceptions become one logged 500, never a torn connection."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except ClientDisconnect:
            log.debug("client left during %s %s", scope.get("method"), scope.get("path"))
        except Exception as exc:
            where = f"{scope.get('method')} {scope.get('path')}"
            if started:
                log.error("unhandled error after the response to %s started", where, exc_info=exc)
                return
            log.error("unhandled error serving %s", where, exc_info=exc)
            err = from_baton_error(exc)
            body = json.dumps(err.body_for(scope.get("path", ""))).encode()
            await send(
                {
                    "type": "http.response.start",
                    "status": err.status,
                    "headers": [
                        (b"content-type", b"application/json"),
                        (b"content-length", str(len(body)).encode()),
                    ],
                }
            )
            await send({"type": "http.response.body", "body": body, "more_body": False})
