"""Request bodies: at most ``server.max_request_bytes``, all in within ``server.body_timeout``.

This ASGI middleware reads the body before the app sees the request (as a
reverse proxy buffers it), so every route is covered, whether it reads its
body or not:

- a Content-Length over the limit is a 413 at once, the body never read;
- a chunked body that grows past the limit is a 413 as soon as it does;
- a body still incomplete ``body_timeout`` seconds after the headers is a 408
  (the whole body, not each read: a client sending a byte every two seconds
  is cut off, not kept alive forever).

All three answer in the API's error shape (OpenAI's; Anthropic's under /v1/messages) and close the connection (the rest of
the body may still be on its way). The app then reads the buffered body as usual.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from baton_openai.errors import error_body

log = logging.getLogger("baton_openai")


class _TooLarge(Exception):
    pass


def content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # h11 refuses a malformed Content-Length before we get here
    return None


async def send_error(send: Send, status: int, message: str, code: str, path: str = "") -> None:
    """An error in the shape of ``path``'s API (OpenAI's, or Anthropic's for /v1/messages)
    that closes the connection."""
    body = json.dumps(error_body(message, status, code=code, path=path)).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body, "more_body": False})


class RequestLimits:
    """Reads and bounds each HTTP request body, then hands the app a receive that replays it."""

    def __init__(self, app: ASGIApp, max_bytes: int, body_timeout: float) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.body_timeout = body_timeout

    def _too_large(self, size: str) -> str:
        return (
            f"the request body is {size} bytes, more than server.max_request_bytes "
            f"({self.max_bytes}): send a smaller request, or raise server.max_request_bytes"
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await send_error(
                send, 413, self._too_large(str(declared)), "request_too_large", scope["path"]
            )
            return
        try:
            body = await asyncio.wait_for(self._read(receive), self.body_timeout)
        except _TooLarge:
            await send_error(send, 413, self._too_large("over"), "request_too_large", scope["path"])
            return
        except TimeoutError:
            client = scope.get("client")
            log.info(
                "closing the connection from %s: request body incomplete after "
                "server.body_timeout (%g s)",
                f"{client[0]}:{client[1]}" if client else "?",
                self.body_timeout,
            )
            await send_error(
                send,
                408,
                f"the request body did not arrive within server.body_timeout "
                f"({self.body_timeout:g} s)",
                "request_timeout",
                scope["path"],
            )
            return
        if body is None:
            return  # the client left before its body was in: nobody to answer
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: only http.disconnect comes

        await self.app(scope, replay, send)

    async def _read(self, receive: Receive) -> bytes | None:
        chunks: list[Any] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                raise _TooLarge
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)
