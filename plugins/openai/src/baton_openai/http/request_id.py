"""``X-Request-Id``: taken from the request when it is safe, echoed on every response.

A client's id is used when it is 1-128 characters of letters, digits and
``._:-`` (it becomes part of the engine's request id and of log lines); any
other value is ignored and the server makes one. The id is echoed in the
``X-Request-Id`` response header; a generation's response carries its own id
(``chatcmpl-<client id>-<uuid>``), which handlers set with ``set_response_id``.
Log records made while a request is served carry it as ``record.request_id``.
"""

from __future__ import annotations

import contextvars
import logging
import re
import uuid

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

HEADER = "x-request-id"
_SAFE = re.compile(r"[A-Za-z0-9._:-]{1,128}")
#: The id of the request being served (for log records); None outside a request.
current_request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "baton_request_id", default=None
)


def safe_client_id(value: str | None) -> str | None:
    """The client's id when it may be used as given, else None."""
    return value if value is not None and _SAFE.fullmatch(value) else None


def client_request_id(request: Request) -> str | None:
    """The request's safe ``X-Request-Id``, if it sent one."""
    return request.scope.get("state", {}).get("client_request_id")


def engine_request_id(request: Request, kind: str) -> str:
    """A unique id for a generation, ``<kind>-<client id>-<uuid>`` or ``<kind>-<uuid>``; it
    becomes the response's ``X-Request-Id``."""
    client = client_request_id(request)
    rid = f"{kind}-{client}-{uuid.uuid4().hex}" if client else f"{kind}-{uuid.uuid4().hex}"
    set_response_id(request, rid)
    return rid


def set_response_id(request: Request, rid: str) -> None:
    request.scope.setdefault("state", {})["response_request_id"] = rid
    current_request_id.set(rid)


class RequestIdMiddleware:
    """Pure ASGI middleware: reads ``X-Request-Id``, echoes it (or the server's) on the response."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = next((v for k, v in scope.get("headers", ()) if k == b"x-request-id"), None)
        client = safe_client_id(given.decode("latin-1") if given is not None else None)
        state = scope.setdefault("state", {})
        state["client_request_id"] = client
        rid = client or uuid.uuid4().hex
        token = current_request_id.set(rid)

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                echoed = state.get("response_request_id") or rid
                headers = [(k, v) for k, v in message.get("headers", ()) if k != b"x-request-id"]
                headers.append((b"x-request-id", echoed.encode("latin-1")))
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            current_request_id.reset(token)


class RequestIdFilter(logging.Filter):
    """Adds ``record.request_id`` (None outside a request) to every record it sees."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            record.request_id = current_request_id.get()
        return True
