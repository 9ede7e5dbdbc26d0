"""One batch input line, run in-process through the HTTP handlers, and its result line.

A line is ``{"custom_id", "method": "POST", "url", "body"}`` (OpenAI's and
vLLM's format). Its body is validated by the endpoint's own request model and
answered by the endpoint's own handler, called directly with an internal
request (no socket, no HTTP): so a line gets exactly what the same request
over HTTP gets, errors in OpenAI's shape included. A line runs at the batch
priority (``server.batch_priority``, later than interactive requests with the
``priority`` scheduler policy) or later, if it asks for that.

The result line is vLLM's and OpenAI's: ``{"id", "custom_id", "response":
{"status_code", "request_id", "body"}, "error"}``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import pydantic
from fastapi import FastAPI
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from starlette.requests import Request
from starlette.types import Message

from baton.errors import BatonError
from baton_openai.endpoints.chat import create_chat_completion
from baton_openai.endpoints.completions import create_completion
from baton_openai.endpoints.embeddings import EmbeddingRequest, create_embedding
from baton_openai.http.errors import OpenAIError, from_baton_error, validation_error
from baton_openai.http.request_id import engine_request_id
from baton_openai.protocol.openai import ChatCompletionRequest, CompletionRequest

log = logging.getLogger("baton_openai")
Handler = Callable[[Any, Request], Awaitable[Any]]


@dataclass(frozen=True)
class Endpoint:
    model: type[pydantic.BaseModel]
    handler: Handler


#: The endpoints a batch may target.
ENDPOINTS: dict[str, Endpoint] = {
    "/v1/chat/completions": Endpoint(ChatCompletionRequest, create_chat_completion),
    "/v1/completions": Endpoint(CompletionRequest, create_completion),
    "/v1/embeddings": Endpoint(EmbeddingRequest, create_embedding),
}
#: Error codes that mean "the engine is going away", not "this line is bad": the line is left
#: undone (a restarted server runs it), not written to the error file.
ENGINE_GONE = ("engine_unavailable",)


class BatchLine(msgspec.Struct, forbid_unknown_fields=True):
    custom_id: str
    method: str
    url: str
    body: dict[str, Any]


class LineResponse(msgspec.Struct):
    status_code: int
    request_id: str | None
    body: Any


class LineError(msgspec.Struct):
    code: str
    message: str


class ResultLine(msgspec.Struct):
    id: str
    custom_id: str | None
    response: LineResponse | None
    error: LineError | None


class LineRejected(Exception):
    """A line that is not a request this batch can run; its message names the field."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def parse_line(raw: bytes, endpoint: str | None) -> BatchLine:
    """A line of the input file (``endpoint``: the URL every line must name; None: any of
    ENDPOINTS). LineRejected when it is not one."""
    try:
        line = msgspec.json.decode(raw, type=BatchLine)
    except msgspec.DecodeError as e:
        raise LineRejected("invalid_json", f"the line is not a JSON request line: {e}") from None
    except msgspec.ValidationError as e:
        raise LineRejected("invalid_request", f"the line is not a batch request: {e}") from None
    if line.method != "POST":
        raise LineRejected("invalid_method", f"method must be POST, got {line.method!r}")
    if endpoint is not None and line.url != endpoint:
        raise LineRejected(
            "invalid_url", f"url {line.url!r} is not the batch's endpoint {endpoint!r}"
        )
    if line.url not in ENDPOINTS:
        raise LineRejected("invalid_url", f"url {line.url!r} is not one of {', '.join(ENDPOINTS)}")
    if line.body.get("stream") is True:
        raise LineRejected("invalid_request", "body.stream: a batch line cannot stream")
    return line


def at_priority(body: dict[str, Any], priority: int) -> dict[str, Any]:
    """The body with its priority at ``priority`` or later (a bad value is left for the check)."""
    out = dict(body)
    given = out.get("priority", 0)
    if isinstance(given, int) and not isinstance(given, bool):
        out["priority"] = max(given, priority)
    sched = out.get("scheduling")
    if isinstance(sched, dict) and "priority" in sched:
        given = sched["priority"]
        if isinstance(given, int) and not isinstance(given, bool):
            out["scheduling"] = {**sched, "priority": max(given, priority)}
    return out


class EngineGone(Exception):
    """The engine died or is stopping: the line is not answered (it runs again after a restart)."""


def internal_request(app: FastAPI, path: str) -> Request:
    """A request for a handler called in-process: no headers, never disconnected."""
    scope = {
        "type": "http",
        "app": app,
        "method": "POST",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "headers": [],
        "state": {},
        "client": None,
        "server": None,
        "scheme": "http",
        "root_path": "",
        "http_version": "1.1",
    }

    async def receive() -> Message:
        await asyncio.Event().wait()  # no client to leave: waits until the handler is done
        raise AssertionError("unreachable")

    return Request(scope, receive)


@dataclass
class LineRunner:
    """Runs lines through the handlers of ``app`` (built by build_app), at ``priority`` or later."""

    app: FastAPI
    priority: int
    #: Seconds between tries of a line refused for a full queue (server.max_queued_requests).
    retry_s: float = 0.5

    async def run(self, line: BatchLine) -> tuple[LineResponse, bool]:
        """The line's response and whether it succeeded; EngineGone when the engine is."""
        while True:
            response = await self._once(line)
            if response.status_code != 429:
                return response, response.status_code == 200
            await asyncio.sleep(self.retry_s)  # the queue is full of interactive requests

    async def _once(self, line: BatchLine) -> LineResponse:
        endpoint = ENDPOINTS[line.url]
        raw = internal_request(self.app, line.url)
        try:
            req = endpoint.model.model_validate_json(
                msgspec.json.encode(at_priority(line.body, self.priority))
            )
            result = await endpoint.handler(req, raw)
        except pydantic.ValidationError as e:
            err = validation_error(RequestValidationError(e.errors()))
        except OpenAIError as e:
            err = e
        except BatonError as e:
            err = from_baton_error(e)
        except Exception as e:  # a bug: the line fails as the HTTP request would, with a 500
            log.exception("batch line %r failed", line.custom_id)
            err = from_baton_error(e)
        else:
            return LineResponse(200, response_id(raw), jsonable_encoder(result))
        if err.code in ENGINE_GONE:
            raise EngineGone(err.message)
        return LineResponse(err.status, response_id(raw), err.body())


def response_id(raw: Request) -> str | None:
    rid = raw.scope["state"].get("response_request_id")
    return rid if rid is not None else engine_request_id(raw, "batch")


def result_line(
    result_id: str, custom_id: str | None, response: LineResponse | None, ok: bool
) -> ResultLine:
    """A line's result; a failed response also says why in ``error`` (code and message)."""
    error = None
    if not ok and response is not None:
        detail = response.body.get("error", {}) if isinstance(response.body, dict) else {}
        error = LineError(
            code=str(detail.get("code") or response.status_code),
            message=str(detail.get("message", "")),
        )
    return ResultLine(result_id, custom_id, response, error)


def rejected_line(result_id: str, raw: bytes, rejected: LineRejected) -> ResultLine:
    """The result of a line that never ran (bad JSON, wrong url, ...): no response."""
    return ResultLine(
        result_id, custom_id_of(raw), None, LineError(rejected.code, rejected.message)
    )


def custom_id_of(raw: bytes) -> str | None:
    """A rejected line's custom_id, when it has a readable one."""
    try:
        value = msgspec.json.decode(raw)
    except msgspec.DecodeError:
        return None
    cid = value.get("custom_id") if isinstance(value, dict) else None
    return cid if isinstance(cid, str) else None
