"""POST /v1/completions: one AsyncLLM request per prompt (text or token ids), n choices each."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import msgspec
from fastapi import APIRouter, Request, Response

from baton.errors import BatonError, InvalidRequestError
from baton.outputs import RequestOutput
from baton_openai.http.admission import Ticket
from baton_openai.http.errors import OpenAIError, from_baton_error
from baton_openai.http.json_body import PiecewiseJSONRoute
from baton_openai.http.openapi import GENERATION_ERRORS, error_responses, streaming_ok
from baton_openai.http.request_id import engine_request_id
from baton_openai.http.streaming import DISCONNECTED, DONE, SSEResponse, cancel_on_disconnect, sse
from baton_openai.pipeline.beam_search import (
    beam_search_params,
    beam_usage,
    finish_reason,
    run_beam_searches,
)
from baton_openai.pipeline.context import ServerContext
from baton_openai.pipeline.generation import (
    Accumulator,
    Item,
    collect,
    first_output,
    merge,
    to_openai_error,
)
from baton_openai.pipeline.logprobs import (
    completion_logprobs,
    echo_logprobs,
    joined,
    prompt_logprobs_field,
)
from baton_openai.pipeline.params import BuiltParams, build_params
from baton_openai.protocol.openai import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    Usage,
)

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
    if req.max_tokens == 0 and not req.echo:
        raise OpenAIError(
            "max_tokens=0 returns the prompt alone, which needs echo=true: set echo, or give "
            "max_tokens >= 1",
            param="max_tokens",
            code="invalid_value",
        )
    if req.stream and req.prompt_logprobs is not None:
        raise OpenAIError(
            "prompt_logprobs are not available with stream=true (as in vLLM): leave one out, "
            "or use echo with logprobs",
            param="prompt_logprobs",
            code="unsupported_parameter",
        )
    engine = ctx.engine
    prompts = _prompts(req.prompt)
    if req.kv_transfer_params is not None and len(prompts) > 1:
        raise OpenAIError(
            f"kv_transfer_params go with one prompt, but the request has {len(prompts)}: send "
            "one prompt per request",
            param="kv_transfer_params",
            code="invalid_value",
        )
    if req.use_beam_search:
        return await _beam_search(req, raw, ctx, prompts)
    # echo with logprobs scores the prompt (vLLM: prompt_logprobs = logprobs); max_tokens=0
    # generates one token that is not returned
    prompt_lps, prompt_lps_param = req.prompt_logprobs, "prompt_logprobs"
    if req.echo and req.logprobs is not None and (prompt_lps or 0) <= req.logprobs:
        prompt_lps, prompt_lps_param = req.logprobs, "logprobs"
    max_tokens = 1 if req.max_tokens == 0 else req.max_tokens

    def prepare() -> tuple[list[str | None], list[list[int]], list[BuiltParams]]:
        # tokenizing (and checking every token id) is work the client controls: on a worker thread
        texts, ids_list, built_list = [], [], []
        for prompt in prompts:
            try:  # a huge text is refused by a prefix, a long id list by its length
                ids = engine.tokenize(prompt)
            except InvalidRequestError as e:
                raise from_baton_error(e) from None
            built_list.append(
                build_params(
                    req,
                    prompt_token_ids=ids,
                    info=engine.info,
                    max_tokens=max_tokens,
                    max_tokens_param="max_tokens",
                    prompt_param="prompt",
                    logprobs=req.logprobs,
                    prompt_logprobs=prompt_lps,
                    prompt_logprobs_param=prompt_lps_param,
                )
            )
            text = prompt if isinstance(prompt, str) else None
            if req.echo and text is None:
                text = engine.get_tokenizer().decode(ids)
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
                    trace_headers=raw.headers,  # traceparent: the span's parent (tracing on)
                    lora_request=ctx.lora_for(req),
                )
            )
            for i, (t, ids, b) in enumerate(zip(texts, ids_list, built_list, strict=True))
        ]
    )
    acc = Accumulator([len(ids) for ids in ids_list], req.n)
    built = built_list[0]
    echo = Echo(texts, ids_list, engine.get_tokenizer().decode) if req.echo else None
    if not req.stream:
        done = await cancel_on_disconnect(raw, collect(stream, None, acc, built))
        if done is DISCONNECTED:
            return Response(status_code=499)
        return _response(request_id, ctx.answering_model(req), req, acc, echo)
    first = await cancel_on_disconnect(raw, first_output(stream, built))
    if first is DISCONNECTED:
        return Response(status_code=499)
    return SSEResponse(
        _chunks(request_id, ctx.answering_model(req), req, stream, first, acc, built, echo)
    )


async def _beam_search(
    req: CompletionRequest, raw: Request, ctx: ServerContext, prompts: list[Any]
) -> Response | CompletionResponse:
    """use_beam_search: each prompt's best n beams as its n choices, best first (vLLM's)."""
    params = beam_search_params(
        req, req.max_tokens, {"echo": req.echo, "logprobs": req.logprobs is not None}
    )
    ticket = ctx.queue.admit(len(prompts))  # a 429 when server.max_queued_requests are waiting
    try:
        try:
            ids_list = [ctx.engine.tokenize(p) for p in prompts]
        except InvalidRequestError as e:
            raise from_baton_error(e) from None
        outs = await run_beam_searches(ctx, raw, req, ids_list, params)
    finally:
        ticket.close()
    if outs is DISCONNECTED:
        return Response(status_code=499)
    choices = [
        CompletionChoice(
            index=p * req.n + i,
            text=seq.text or "",
            finish_reason=finish_reason(seq, len(ids), ctx, req.ignore_eos),
        )
        for p, (ids, out) in enumerate(zip(ids_list, outs, strict=True))
        for i, seq in enumerate(out.sequences)
    ]
    return CompletionResponse(
        id=engine_request_id(raw, "cmpl"),
        model=ctx.answering_model(req),
        choices=choices,
        usage=beam_usage(ids_list, outs),
    )


@dataclass
class Echo:
    """The prompts an echo request returns before (or, with max_tokens=0, instead of) its
    completions."""

    texts: list[str | None]
    token_ids: list[list[int]]
    decode: Callable[[list[int]], str]

    def text(self, prompt_index: int) -> str:
        return self.texts[prompt_index] or ""

    def logprobs(self, prompt_index: int, acc: Accumulator, top: int) -> CompletionLogprobs:
        lps = acc.prompt_logprobs.get(prompt_index)
        return echo_logprobs(self.token_ids[prompt_index], lps, top, self.decode)


def _response(
    request_id: str,
    model: str,
    req: CompletionRequest,
    acc: Accumulator,
    echo: Echo | None,
) -> CompletionResponse:
    top = req.logprobs
    echo_only = req.max_tokens == 0  # the one token generated is not returned
    choices = []
    for index in sorted(acc.choices):
        c = acc.choices[index]
        p = index // acc.n
        prefix = echo.text(p) if echo else ""
        logprobs = None
        if top is not None:
            start = len(prefix)
            logprobs = completion_logprobs([] if echo_only else c.token_ids, c.logprobs, top, start)
            if echo is not None:
                logprobs = joined(echo.logprobs(p, acc, top), logprobs)
        choices.append(
            CompletionChoice(
                index=index,
                text=prefix + ("" if echo_only else "".join(c.text)),
                logprobs=logprobs,
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
                prompt_logprobs=prompt_logprobs_field(acc.prompt_logprobs.get(p))
                if req.prompt_logprobs is not None
                else None,
            )
        )
    usage = acc.usage()
    if echo_only:
        usage.completion_tokens, usage.total_tokens = 0, usage.prompt_tokens
    return CompletionResponse(
        id=request_id,
        model=model,
        choices=choices,
        usage=usage,
        kv_transfer_params=acc.kv_transfer_params,
    )


def _delta_choices(
    p: int,
    out: RequestOutput,
    acc: Accumulator,
    req: CompletionRequest,
    offsets: dict[int, int],
    echo_only: bool,
) -> list[CompletionChoice]:
    """One streamed output of prompt ``p`` as chunk choices; ``offsets`` (text so far) advance."""
    choices = []
    for c in out.outputs:
        index = acc.index(p, c)
        if echo_only:  # the one token generated is not returned
            if c.finish_reason is not None:
                choices.append(
                    CompletionChoice(index=index, text="", finish_reason=c.finish_reason)
                )
            continue
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
    return choices


async def _chunks(
    request_id: str,
    model: str,
    req: CompletionRequest,
    stream: AsyncIterator[Item],
    first: Item | None,
    acc: Accumulator,
    built: BuiltParams,
    echo: Echo | None,
) -> AsyncIterator[bytes]:
    created = int(time.time())
    opts = req.stream_options
    include_usage = bool(opts and opts.include_usage)
    continuous = bool(opts and opts.continuous_usage_stats)
    offsets: dict[int, int] = {}
    # echo with logprobs: a prompt's chunk waits for its first output, which brings its scores
    echo_scored = echo is not None and req.logprobs is not None
    echo_only = req.max_tokens == 0
    echoed: set[int] = set()

    def chunk(choices: list[CompletionChoice], usage: Any = None) -> bytes:
        c = CompletionResponse(
            id=request_id, created=created, model=model, choices=choices, usage=usage
        )
        return sse(c.model_dump_json(exclude_none=True))

    def usage() -> Usage:
        u = acc.usage()
        if echo_only:
            u.completion_tokens, u.total_tokens = 0, u.prompt_tokens
        return u

    def echo_choices(p: int) -> list[CompletionChoice]:
        assert echo is not None
        echoed.add(p)
        lps = echo.logprobs(p, acc, req.logprobs) if req.logprobs is not None else None
        text = echo.text(p)
        for i in range(req.n):
            offsets[p * req.n + i] = len(text)
        return [
            CompletionChoice(index=p * req.n + i, text=text, logprobs=lps) for i in range(req.n)
        ]

    try:
        if echo is not None and not echo_scored:
            yield chunk([c for p in range(len(echo.texts)) for c in echo_choices(p)])
        item = first
        while item is not None:
            p, out = item
            acc.add(p, out, keep=False)
            if echo_scored and p not in echoed:
                yield chunk(echo_choices(p))
            choices = _delta_choices(p, out, acc, req, offsets, echo_only)
            if choices:
                yield chunk(choices, usage() if continuous else None)
            item = await anext(stream, None)
        if include_usage:
            yield chunk([], usage())
        yield DONE
    except BatonError as e:
        yield sse(json.dumps(to_openai_error(e, built).body()))
    finally:
        await stream.aclose()  # type: ignore[attr-defined]
