"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` with the right status.

Request validation (pydantic) and baton's typed errors both become 400s naming
the parameter; a dead or stopping engine is a 503. The Anthropic Messages API's routes
(``ANTHROPIC_PATHS``) answer the same errors in Anthropic's shape,
``{"type": "error", "error": {"type", "message"}}``, the parameter named in the message.
"""

from __future__ import annotations

import logging
import re
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from baton.errors import (
    BatonError,
    ContextLengthError,
    EngineDeadError,
    EngineShuttingDownError,
    EngineSleepingError,
    InvalidRequestError,
    StructuredOutputError,
)
from baton.sampling_params import show_value

log = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    503: "service_unavailable",
}
#: Anthropic's error types by status (its API's documented ones; 408 and 503 by their meaning).
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}
#: Path prefixes whose errors are Anthropic-shaped (the Messages API and its count_tokens).
ANTHROPIC_PATHS = ("/v1/messages",)
_SAMPLING_FIELD = re.compile(r"SamplingParams\.(\w+)")


class OpenAIError(Exception):
    """An error response; raise it anywhere in a handler."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        #: Extra response headers (Retry-After on a 429).
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.status, self.param, self.code)

    def renamed(self, names: dict[str, str]) -> OpenAIError:
        """This error with its param as another API spells it (max_completion_tokens ->
        max_output_tokens, ...), in the message too."""
        new = names.get(self.param) if self.param is not None else None
        if new is None or self.param is None:
            return self
        message = self.message.replace(self.param, new)
        return OpenAIError(message, self.status, new, self.code, self.headers)

    def body_for(self, path: str) -> dict[str, Any]:
        """The body in the shape of the API that ``path`` belongs to."""
        return error_body(self.message, self.status, self.param, self.code, path=path)


def error_body(
    message: str,
    status: int,
    param: str | None = None,
    code: str | None = None,
    path: str | None = None,
) -> dict[str, Any]:
    """OpenAI's error body, or Anthropic's when ``path`` is one of ANTHROPIC_PATHS."""
    if path is not None and path.startswith(ANTHROPIC_PATHS):
        return anthropic_error_body(message, status, param)
    kind = _TYPES.get(status) or (
        "server_error" if status >= 500 else HTTPStatus(status).phrase.replace(" ", "_").lower()
    )
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def anthropic_error_body(message: str, status: int, param: str | None = None) -> dict[str, Any]:
    """``{"type": "error", "error": {"type", "message"}}``: Anthropic's shape has no param
    field, so the message starts with it when it does not name it already."""
    kind = _ANTHROPIC_TYPES.get(status) or (
        "api_error" if status >= 500 else "invalid_request_error"
    )
    if param and param not in message:
        message = f"{param}: {message}"
    return {"type": "error", "error": {"type": kind, "message": message}}


def from_baton_error(e: BaseException, param_names: dict[str, str] | None = None) -> OpenAIError:
    """Map a baton error to its response.

    An InvalidRequestError's field is its ``param`` or, for one rebuilt from a message,
    the ``SamplingParams.<field>`` it names; ``param_names`` renames it to the request's
    field (max_tokens -> max_completion_tokens, prompt -> messages, ...), in the message too.
    """
    message = str(e)
    if isinstance(e, EngineDeadError | EngineShuttingDownError):
        return OpenAIError(message, 503, code="engine_unavailable")
    if isinstance(e, EngineSleepingError):
        return OpenAIError(message, 503, code="engine_sleeping")
    if isinstance(e, StructuredOutputError):
        return OpenAIError(message, 400, param="response_format", code="invalid_value")
    if isinstance(e, InvalidRequestError):
        m = _SAMPLING_FIELD.search(message)
        field = e.param or (m.group(1) if m else None)
        param = (param_names or {}).get(field, field) if field is not None else None
        if field is not None and param is not None:
            message = message.replace(f"SamplingParams.{field}", param)
        code = "context_length_exceeded" if isinstance(e, ContextLengthError) else "invalid_value"
        return OpenAIError(message, 400, param=param, code=code)
    if isinstance(e, BatonError):
        return OpenAIError(f"{type(e).__name__}: {message}", 500, code="internal_error")
    return OpenAIError(f"internal error: {type(e).__name__}: {message}", 500, code="internal_error")


#: Validation errors spelled out in a message; the rest are counted (4096 bad messages
#: would make a 400 of 400 KB).
MAX_ERROR_LINES = 10


def validation_error(exc: RequestValidationError) -> OpenAIError:
    lines, param = [], None
    errors = exc.errors()
    for err in errors[:MAX_ERROR_LINES]:
        if err.get("type") == "json_invalid":
            return OpenAIError(
                f"the request body is not valid JSON: {err.get('msg')}", 400, code="invalid_json"
            )
        raw_loc = [p for p in err.get("loc", ()) if p != "body"]
        loc = [str(p) for p in raw_loc]
        where = ".".join(loc) or "body"
        param = param or (loc[0] if raw_loc and isinstance(raw_loc[0], str) else None)
        value = err.get("input")
        shown = "" if isinstance(value, dict | list) else f" (got {show_value(value)})"
        lines.append(f"{where}: {err.get('msg')}{shown}")
    if len(errors) > MAX_ERROR_LINES:
        lines.append(f"and {len(errors) - MAX_ERROR_LINES} more errors")
    return OpenAIError(
        "; ".join(lines) or "invalid request", 400, param=param, code="invalid_value"
    )


def install_error_handlers(app: FastAPI) -> None:
    def respond(request: Request, err: OpenAIError) -> JSONResponse:
        return JSONResponse(
            err.body_for(request.url.path), status_code=err.status, headers=err.headers
        )

    @app.exception_handler(OpenAIError)
    async def _openai(request: Request, exc: OpenAIError) -> JSONResponse:
        return respond(request, exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return respond(request, validation_error(exc))

    @app.exception_handler(BatonError)
    async def _baton(request: Request, exc: BatonError) -> JSONResponse:
        return respond(request, from_baton_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return respond(request, OpenAIError(str(exc.detail), exc.status_code))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error serving %s", request.url.path)
        return respond(request, from_baton_error(exc))
