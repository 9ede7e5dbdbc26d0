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

from baton_openai.http.errors import error_body

log = logging.getLogger("baton_openai")


class _TooLarge(Exception):
    pass


#: What a file upload's body may hold besides the file: the multipart framing and fields.
UPLOAD_OVERHEAD = 64 * 1024


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
    """Reads and bounds each HTTP request body, then hands the app a receive that replays it.

    ``uploads``: paths whose bodies are bounded by their own limit (and the setting that
    names it) and passed through as they arrive, not buffered (file uploads, spooled to disk
    by the route): past the limit or the timeout, the app's response is replaced by the 413
    or 408.
    """

    def __init__(
        self,
        app: ASGIApp,
        max_bytes: int,
        body_timeout: float,
        uploads: dict[str, tuple[int, str]] | None = None,
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.body_timeout = body_timeout
        self.uploads = uploads or {}

    def _too_large(self, size: str, limit: int, setting: str) -> str:
        return (
            f"the request body is {size} bytes, more than {setting} ({limit}): send a smaller "
            f"request, or raise {setting}"
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit, setting = self.uploads.get(
            scope.get("path", ""), (self.max_bytes, "server.max_request_bytes")
        )
        declared = content_length(scope)
        if declared is not None and declared > limit:
            message = self._too_large(str(declared), limit, setting)
            await send_error(send, 413, message, "request_too_large", scope["path"])
            return
        if scope.get("path") in self.uploads:
            await self._pass_through(scope, receive, send, limit, setting)
            return
        try:
            body = await asyncio.wait_for(self._read(receive), self.body_timeout)
        except _TooLarge:
            message = self._too_large("over", limit, setting)
            await send_error(send, 413, message, "request_too_large", scope["path"])
            return
        except TimeoutError:
            await self._timed_out(scope, send)
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

    async def _timed_out(self, scope: Scope, send: Send) -> None:
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
            f"the request body did not arrive within server.body_timeout ({self.body_timeout:g} s)",
            "request_timeout",
            scope["path"],
        )

    async def _pass_through(
        self, scope: Scope, receive: Receive, send: Send, limit: int, setting: str
    ) -> None:
        """The app reads the body as it comes; past ``limit`` or the timeout, the route's
        answer (whatever the failed read made of it) is replaced by a 413 or 408."""
        deadline = asyncio.get_running_loop().time() + self.body_timeout
        size = 0
        failed: str | None = None  # "large" or "slow"
        started = False

        async def counted() -> Message:
            nonlocal size, failed
            left = deadline - asyncio.get_running_loop().time()
            try:
                message = await asyncio.wait_for(receive(), max(left, 0.0))
            except TimeoutError:
                failed = "slow"
                raise
            size += len(message.get("body", b""))
            if size > limit:
                failed = "large"
                raise _TooLarge
            return message

        async def answer() -> None:
            if failed == "large":
                message = self._too_large("over", limit, setting)
                await send_error(send, 413, message, "request_too_large", scope["path"])
            else:
                await self._timed_out(scope, send)

        async def guarded(message: Message) -> None:
            nonlocal started
            if failed is None:
                started = True
                await send(message)
            elif not started and message["type"] == "http.response.start":
                started = True
                await answer()

        try:
            await self.app(scope, counted, guarded)
        except (_TooLarge, TimeoutError):
            if not started:
                await answer()

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
