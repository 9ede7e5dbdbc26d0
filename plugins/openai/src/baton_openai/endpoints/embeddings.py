"""POST /v1/embeddings: one pooling request (``AsyncLLM.encode``) per input, OpenAI's shape.

``input`` is a text, a list of texts, a list of token ids or a list of such
lists; each becomes a pooling request that runs through the engine's steps
with the generation requests (``model.pooling_type``, normalised unless
``normalize: false``, vLLM's extra). ``encoding_format`` is ``float`` or
``base64`` (little-endian float32, as the openai client decodes it);
``dimensions`` is refused with a 400 unless the model was trained for it.
"""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import Coroutine, Mapping
from typing import Annotated, Any, Literal, TypeVar

import numpy as np
from fastapi import APIRouter, Request, Response
from pydantic import BaseModel, Field, PlainValidator
from pydantic_core import PydanticCustomError

from baton import PoolingParams, PoolingRequestOutput
from baton.errors import BatonError, InvalidRequestError
from baton.sampling_params import MAX_INT32
from baton.validation import PRIORITY_MAX, PRIORITY_MIN
from baton_openai.http.admission import Ticket
from baton_openai.http.errors import OpenAIError, from_baton_error
from baton_openai.http.json_body import PiecewiseJSONRoute
from baton_openai.http.openapi import GENERATION_ERRORS, error_responses
from baton_openai.http.request_id import engine_request_id
from baton_openai.http.streaming import DISCONNECTED, cancel_on_disconnect
from baton_openai.pipeline.context import ServerContext
from baton_openai.protocol.openai import PromptInput, _Model, prompt_shape

router = APIRouter(route_class=PiecewiseJSONRoute)
T = TypeVar("T")

#: baton's names -> the request's, in refusals
_PARAMS = {"prompt": "input", "pooling_params": "input"}


def input_shape(value: Any) -> str | list[Any]:
    """``prompt_shape`` for ``input``: a text, texts, token ids or lists of token ids."""
    try:
        return prompt_shape(value)
    except PydanticCustomError as e:
        raise PydanticCustomError(
            e.type, e.message().replace("prompt must", "input must", 1)
        ) from None


class EmbeddingRequest(_Model):
    model: str | None = None
    input: Annotated[Any, PlainValidator(input_shape, json_schema_input_type=PromptInput)]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1, lt=MAX_INT32)
    user: str | None = None
    # vLLM's extras
    add_special_tokens: bool = True
    normalize: bool | None = None
    priority: int = Field(0, ge=PRIORITY_MIN, le=PRIORITY_MAX)


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage


def _inputs(value: Any) -> list[Any]:
    if isinstance(value, str):
        return [value]
    if not value:
        raise OpenAIError("input must not be empty", param="input", code="invalid_value")
    if isinstance(value[0], int):
        return [value]
    return list(value)


def encoded(vec: Any, encoding_format: str) -> list[float] | str:
    """The vector as floats, or as base64 of its little-endian float32 bytes."""
    arr = np.ascontiguousarray(vec.numpy(), dtype="<f4")
    if encoding_format == "base64":
        return base64.b64encode(arr.tobytes()).decode("ascii")
    return arr.tolist()  # type: ignore[no-any-return]


@router.post(
    "/v1/embeddings",
    response_model=EmbeddingResponse,
    responses=error_responses(*GENERATION_ERRORS),
)
async def create_embedding(req: EmbeddingRequest, raw: Request) -> Response | EmbeddingResponse:
    ctx = ServerContext.of(raw)
    ctx.check_request(req)
    inputs = _inputs(req.input)
    try:
        params = PoolingParams(normalize=req.normalize, dimensions=req.dimensions)
    except InvalidRequestError as e:
        raise from_baton_error(e) from None
    engine = ctx.engine
    special = req.add_special_tokens

    def prepare() -> list[list[int]]:
        # tokenizing (and checking every token id) is work the client controls: on a worker thread
        return [engine.tokenize(item, add_special_tokens=special) for item in inputs]

    ticket = ctx.queue.admit(len(inputs))  # a 429 when server.max_queued_requests are waiting
    try:
        pre = ctx.preprocess
        try:
            ids_list = await pre.run(
                prepare, deadline=pre.deadline(), what="tokenizing the input", param="input"
            )
        except InvalidRequestError as e:
            raise from_baton_error(e, _PARAMS) from None
        request_id = engine_request_id(raw, "embd")
        work = _all(
            [
                _pool(ctx, ticket, ids, params, f"{request_id}-{i}", req, raw.headers)
                for i, ids in enumerate(ids_list)
            ]
        )
        done = await cancel_on_disconnect(raw, work)
    finally:
        ticket.close()
    if done is DISCONNECTED:
        return Response(status_code=499)
    data = [
        EmbeddingData(index=i, embedding=encoded(out.outputs.data, req.encoding_format))
        for i, out in enumerate(done)
    ]
    tokens = sum(len(ids) for ids in ids_list)
    return EmbeddingResponse(
        id=request_id,
        model=ctx.answering_model(req),
        data=data,
        usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens),
    )


async def _all(coros: list[Coroutine[Any, Any, T]]) -> list[T]:
    """Every result, in order; when one fails, the others are cancelled (their requests aborted)."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def _pool(
    ctx: ServerContext,
    ticket: Ticket,
    ids: list[int],
    params: PoolingParams,
    request_id: str,
    req: EmbeddingRequest,
    headers: Mapping[str, str],
) -> PoolingRequestOutput:
    """One input's finished pooling output; a BatonError as the 400 / 503 it maps to.
    ``headers``: the HTTP request's (its traceparent is the span's parent, tracing on)."""
    stream = ticket.track(
        ctx.engine.encode(
            {"prompt_token_ids": ids},
            params,
            request_id,
            priority=req.priority,
            user=req.user,
            trace_headers=headers,
            lora_request=ctx.lora_for(req),
        )
    )
    try:
        async for out in stream:
            if out.finished and out.outputs is not None:
                return out
        raise OpenAIError(
            f"request {request_id} ended without an embedding", 500, code="internal_error"
        )
    except BatonError as e:
        raise from_baton_error(e, _PARAMS) from None
    finally:
        await stream.aclose()  # type: ignore[attr-defined]
