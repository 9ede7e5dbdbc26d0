"""The OpenAPI schema says what the server returns: each route's statuses, errors in OpenAI's shape.

FastAPI documents a 422 in its own validation-error shape for every route with a
body, but baton answers a request that fails validation with a 400 in OpenAI's
shape (errors.py). So each route lists the error statuses it can return, with
``ErrorResponse`` as their body, and the 422s FastAPI adds are taken out: a
client generated from the schema, or a conformance checker (the test suite runs
schemathesis against it), sees what the server really sends.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel


class ErrorDetail(BaseModel):
    message: str
    """What went wrong and how to fix it."""
    type: str
    """invalid_request_error, authentication_error, not_found_error, service_unavailable, ..."""
    param: str | None = None
    """The request field at fault, as the client spelled it."""
    code: str | None = None
    """A machine-readable reason: invalid_value, context_length_exceeded, ..."""


class ErrorResponse(BaseModel):
    """Every error body: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorDetail


class AnthropicErrorDetail(BaseModel):
    type: str
    """invalid_request_error, authentication_error, not_found_error, overloaded_error, ..."""
    message: str
    """What went wrong (starting with the request field at fault) and how to fix it."""


class AnthropicErrorResponse(BaseModel):
    """Every error body of the Messages API: ``{"type": "error", "error": {"type", "message"}}``."""

    type: Literal["error"] = "error"
    error: AnthropicErrorDetail


_WHY = {
    400: "Invalid request: a parameter out of range or unsupported, a prompt too long for the "
    "model's context, a chat template that fails, preprocessing over server.preprocess_timeout",
    401: "Missing or wrong API key (when server.api_key is set)",
    404: "The request names a model this server does not serve, a stored response, file or "
    "batch that is not there",
    408: "The request's headers or body did not arrive within server.header_timeout / body_timeout",
    413: "The request body is larger than server.max_request_bytes (an upload: than "
    "server.max_file_bytes)",
    429: "server.max_queued_requests requests are waiting for their first token (Retry-After)",
    500: "An internal error (a bug: no request content leads here)",
    503: "The engine is dead or shutting down, or every preprocessing worker is busy",
}

#: The errors of a /v1 route that takes a JSON body and runs a generation.
GENERATION_ERRORS = (400, 401, 404, 408, 413, 429, 500, 503)


def error_responses(
    *statuses: int, model: type[BaseModel] = ErrorResponse
) -> dict[int | str, dict[str, Any]]:
    """``responses=`` for a route: each status with its reason and its error body (OpenAI's
    ErrorResponse; AnthropicErrorResponse for the Messages API)."""
    return {s: {"model": model, "description": _WHY[s]} for s in statuses}


def streaming_ok(
    model: type[BaseModel], chunk: str, last: str = "the last event is '[DONE]'"
) -> dict[int | str, dict[str, Any]]:
    """The 200 of a route that answers JSON, or server-sent events with ``"stream": true``
    (``last``: how the stream ends)."""
    event = {
        "type": "object",
        "required": ["data"],
        "properties": {
            "event": {"type": "string"},
            "data": {
                "type": "string",
                "description": f"A {chunk} as JSON; an error object if the request fails "
                f"mid-stream; {last}",
            },
        },
    }
    return {
        200: {
            "model": model,
            "description": f"The answer; with stream=true, server-sent events of {chunk}s",
            "content": {"text/event-stream": {"schema": event}},
        }
    }


def install_openapi(app: FastAPI) -> None:
    """Serve the app's schema without the 422 responses FastAPI adds (baton sends 400s)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(
                title=app.title, version=app.version, description=app.description, routes=app.routes
            )
            for path in schema.get("paths", {}).values():
                for operation in path.values():
                    operation.get("responses", {}).pop("422", None)
            components = schema.get("components", {}).get("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                components.pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
