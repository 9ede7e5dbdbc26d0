"""POST /v1/completions: one AsyncLLM request per prompt (text or token ids), n choices each."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from fastapi import APIRouter, Request, Response

from baton.errors import BatonError, InvalidRequestError
from baton_openai.admission import Ticket
from baton_openai.context import ServerContext
from baton_openai.errors import OpenAIError, from_baton_error
from baton_openai.generation import Accumulator, Item, collect, first_output, merge, to_openai_error
from baton_openai.json_body import PiecewiseJSONRoute
from baton_openai.logprobs import completion_logprobs
from baton_openai.openapi import GENERATION_ERRORS, error_responses, streaming_ok
from baton_openai.params import BuiltParams, build_params
from baton_openai.protocol import CompletionChoice, CompletionRequest, CompletionResponse
from baton_openai.request_id import engine_request_id
from baton_openai.streaming import DISCONNECTED, DONE, SSEResponse, cancel_on_disconnect, sse

#: Bodies decoded in pieces: a large one does not stop the event loop while it is parsed.
router = APIRouter(route_class=PiecewiseJSONRoute)


def _prompts(prompt: Any) -> list[Any]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise OpenAIError("prompt must not be empty", param="prompt", code="invalid_value")
    if isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)


@router.post(
    "/v1/completions",
    response_model=None,
    responses=streaming_ok(CompletionResponse, "text_completion chunk")
    | error_responses(*GENERATION_ERRORS),
)
async def create_completion(req: CompletionRequest, raw: Request) -> Response | CompletionResponse:
    ctx = ServerContext.of(raw)
    ctx.check_request(req)
    if req.suffix:
        raise OpenAIError(
            "suffix is not supported by baton", param="suffix", code="unsupported_parameter"
        )
    if req.best_of is not None and req.best_of != req.n:
        raise OpenAIError(
            "best_of other than n is not supported by baton",
            param="best_of",
            code="unsupported_parameter",
        )
    if req.echo and req.logprobs is not None:
        raise OpenAIError(
            "echo with logprobs (prompt logprobs) is not supported by baton",
            param="echo",
            code="unsupported_parameter",
        )
    engine = ctx.engine
    prompts = _prompts(req.prompt)

    def prepare() -> tuple[list[str | None], list[list[int]], list[BuiltParams]]:
        # tokenizing (and checking every token id) is work the client controls: on a worker thread
        texts, ids_list, built_list = [], [], []
        for prompt in prompts:
            try:  # a huge text is refused by a prefix, a long id list by its length
                text, ids = engine.input_processor.tokenize(prompt)
            except InvalidRequestError as e:
                raise from_baton_error(e) from None
            built_list.append(
                build_params(
                    req,
                    prompt_token_ids=ids,
                    info=engine.info,
                    max_tokens=req.max_tokens,
                    max_tokens_param="max_tokens",
                    prompt_param="prompt",
                    logprobs=req.logprobs,
                )
            )
            if req.echo and text is None:
                text = engine.tokenizer.decode(ids)
            texts.append(text)
            ids_list.append(ids)
        return texts, ids_list, built_list

    ticket = ctx.queue.admit(len(prompts))  # a 429 when server.max_queued_requests are waiting
    try:
        return await _generate(req, raw, ctx, prompts, prepare, ticket)
    finally:
        ticket.close()  # the first outputs are in (or the request failed): no longer queued


async def _generate(
    req: CompletionRequest,
    raw: Request,
    ctx: ServerContext,
    prompts: list[Any],
    prepare: Any,
    ticket: Ticket,
) -> Response | CompletionResponse:
    engine = ctx.engine
    pre = ctx.preprocess
    texts, ids_list, built_list = await pre.run(
        prepare, deadline=pre.deadline(), what="tokenizing the prompt", param="prompt"
    )
    request_id = engine_request_id(raw, "cmpl")
    stream = merge(
        [
            ticket.track(
                engine.generate(
                    msgspec.structs.replace(b.checked, prompt=t),  # checked once
                    request_id=f"{request_id}-{i}",
                )
            )
            for i, (t, ids, b) in enumerate(zip(texts, ids_list, built_list, strict=True))
        ]
    )
    acc = Accumulator([len(ids) for ids in ids_list], req.n)
    built = built_list[0]
    echo = texts if req.echo else None
    if not req.stream:
        done = await cancel_on_disconnect(raw, collect(stream, None, acc, built))
        if done is DISCONNECTED:
            return Response(status_code=499)
        return _response(request_id, ctx.model_name, acc, req.logprobs, echo)
    first = await cancel_on_disconnect(raw, first_output(stream, built))
    if first is DISCONNECTED:
        return Response(status_code=499)
    return SSEResponse(_chunks(request_id, ctx.model_name, req, stream, first, acc, built, echo))


def _response(
    request_id: str, model: str, acc: Accumulator, top: int | None, echo: list[str | None] | None
) -> CompletionResponse:
    choices = []
    for index in sorted(acc.choices):
        c = acc.choices[index]
        prefix = (echo[index // acc.n] or "") if echo else ""
        logprobs = completion_logprobs(c.token_ids, c.logprobs, top) if top is not None else None
        choices.append(
            CompletionChoice(
                index=index,
                text=prefix + "".join(c.text),
                logprobs=logprobs,
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
            )
        )
    return CompletionResponse(id=request_id, model=model, choices=choices, usage=acc.usage())


async def _chunks(
    request_id: str,
    model: str,
    req: CompletionRequest,
    stream: AsyncIterator[Item],
    first: Item | None,
    acc: Accumulator,
    built: BuiltParams,
    echo: list[str | None] | None,
) -> AsyncIterator[bytes]:
    created = int(time.time())
    opts = req.stream_options
    include_usage = bool(opts and opts.include_usage)
    continuous = bool(opts and opts.continuous_usage_stats)
    offsets: dict[int, int] = {}

    def chunk(choices: list[CompletionChoice], usage: Any = None) -> bytes:
        c = CompletionResponse(
            id=request_id, created=created, model=model, choices=choices, usage=usage
        )
        return sse(c.model_dump_json(exclude_none=True))

    try:
        if echo:
            yield chunk(
                [
                    CompletionChoice(index=p * req.n + i, text=t or "")
                    for p, t in enumerate(echo)
                    for i in range(req.n)
                ]
            )
        item = first
        while item is not None:
            p, out = item
            acc.add(p, out, keep=False)
            choices = []
            for c in out.outputs:
                index = acc.index(p, c)
                logprobs = None
                if req.logprobs is not None and c.logprobs:
                    logprobs = completion_logprobs(
                        c.token_ids, c.logprobs, req.logprobs, offsets.get(index, 0)
                    )
                offsets[index] = offsets.get(index, 0) + len(c.text)
                if c.text or c.finish_reason is not None or logprobs is not None:
                    choices.append(
                        CompletionChoice(
                            index=index,
                            text=c.text,
                            logprobs=logprobs,
                            finish_reason=c.finish_reason,
                            stop_reason=c.stop_reason,
                        )
                    )
            if choices:
                yield chunk(choices, acc.usage() if continuous else None)
            item = await anext(stream, None)
        if include_usage:
            yield chunk([], acc.usage())
        yield DONE
    except BatonError as e:
        yield sse(json.dumps(to_openai_error(e, built).body()))
    finally:
        await stream.aclose()  # type: ignore[attr-defined]
