"""POST /v1/chat/completions: chat template, then one AsyncLLM request with n choices.

The pipeline under the route (``start_chat``: tools, chat template, parameters, admission,
generation; ``answer_steps``: one choice's parsed deltas) is also what /v1/responses
(responses.py) and /v1/messages (messages.py) run their requests on, each written as a
chat request (``as_chat``).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pydantic
from fastapi import APIRouter, Request, Response

from baton.errors import BatonError, InvalidRequestError
from baton_openai.http.admission import Ticket
from baton_openai.http.errors import OpenAIError, from_baton_error
from baton_openai.http.json_body import PiecewiseJSONRoute
from baton_openai.http.openapi import GENERATION_ERRORS, error_responses, streaming_ok
from baton_openai.http.request_id import engine_request_id
from baton_openai.http.streaming import DISCONNECTED, DONE, SSEResponse, cancel_on_disconnect, sse
from baton_openai.pipeline.answer import AnswerDelta, AnswerReader, AnswerStream, tool_call_items
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
from baton_openai.pipeline.logprobs import chat_logprobs, prompt_logprobs_field
from baton_openai.pipeline.params import BuiltParams, build_params
from baton_openai.pipeline.tools import plan_tools, template_renders_tools, with_tool_instructions
from baton_openai.protocol.openai import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    ChatResponseMessage,
    DeltaMessage,
)

#: Bodies decoded in pieces: a large one does not stop the event loop while it is parsed.
router = APIRouter(route_class=PiecewiseJSONRoute)


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """OpenAI messages -> what a chat template reads (text parts joined; other parts refused)."""
    out = []
    for i, m in enumerate(messages):
        content = m.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise OpenAIError(
                        f"messages[{i}].content: only text parts are supported, got {part.get('type')!r}",
                        param="messages",
                        code="invalid_value",
                    )
                texts.append(part["text"])
            content = "\n".join(texts)
        msg = {**(m.model_extra or {}), "role": m.role, "content": content or ""}
        if m.name is not None:
            msg["name"] = m.name
        out.append(msg)
    return out


def client_chat_template(req: ChatCompletionRequest) -> tuple[str | None, dict[str, Any]]:
    """The client's own template (top-level ``chat_template`` as vLLM takes it, or in
    ``chat_template_kwargs``) and the template variables without it."""
    kwargs = dict(req.chat_template_kwargs or {})
    extra = req.model_extra if req.model_extra is not None else {}
    # popped from the extras so that check_request does not log it as ignored
    candidates = [
        ("chat_template", extra.pop("chat_template", None) or getattr(req, "chat_template", None)),
        ("chat_template_kwargs.chat_template", kwargs.pop("chat_template", None)),
    ]
    given = [(name, t) for name, t in candidates if t is not None]
    for name, template in given:
        if not isinstance(template, str):
            raise OpenAIError(
                f"{name} must be a Jinja template string, got {type(template).__name__}",
                param="chat_template",
                code="invalid_value",
            )
    if len(given) == 2 and given[0][1] != given[1][1]:
        raise OpenAIError(
            "two different chat templates (chat_template and chat_template_kwargs.chat_template): "
            "give one",
            param="chat_template",
            code="invalid_value",
        )
    return (given[0][1] if given else None), kwargs


def template_in_use(ctx: ServerContext, client_template: str | None) -> Any:
    """The template a chat renders with: the client's, server.chat_template, or the tokenizer's."""
    return (
        client_template
        or ctx.preprocess.chat_template
        or getattr(ctx.engine.get_tokenizer(), "chat_template", None)
    )


@router.post(
    "/v1/chat/completions",
    response_model=None,
    responses=streaming_ok(ChatCompletionResponse, "chat.completion.chunk")
    | error_responses(*GENERATION_ERRORS),
)
async def create_chat_completion(
    req: ChatCompletionRequest, raw: Request
) -> Response | ChatCompletionResponse:
    ctx = ServerContext.of(raw)
    client_template, template_kwargs = client_chat_template(req)
    ctx.check_request(req)
    if req.top_logprobs and not req.logprobs:
        raise OpenAIError(
            "top_logprobs needs logprobs=true", param="top_logprobs", code="invalid_value"
        )
    if req.stream and req.prompt_logprobs is not None:
        raise OpenAIError(
            "prompt_logprobs are not available with stream=true (as in vLLM): leave one out",
            param="prompt_logprobs",
            code="unsupported_parameter",
        )
    if req.use_beam_search:
        return await _beam_chat(req, raw, client_template, template_kwargs)
    run = await start_chat(req, raw, "chatcmpl", client_template, template_kwargs)
    if run is None:
        return Response(status_code=499)
    if not req.stream:
        return _response(run)
    return SSEResponse(_chunks(run, req))


def as_chat(fields: dict[str, Any]) -> ChatCompletionRequest:
    """The chat request another API's request runs as (its fields already checked; a field
    the chat request refuses is a 400 naming it all the same)."""
    try:
        return ChatCompletionRequest(**fields)
    except pydantic.ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise OpenAIError(
            f"{where}: {first['msg']}", param=str(first["loc"][0]), code="invalid_value"
        ) from None


@dataclass
class ChatRun:
    """A chat request on the engine. Not streamed: its answer is in ``acc`` already;
    streamed: ``first`` is its first output and ``stream`` the rest."""

    request_id: str
    #: The model name the answer carries (a LoRA adapter's when the request named one).
    model: str
    reader: AnswerReader
    acc: Accumulator
    built: BuiltParams
    #: top_logprobs when logprobs are on, else None.
    top: int | None
    stream: AsyncIterator[Item]
    first: Item | None = None


async def start_chat(
    req: ChatCompletionRequest,
    raw: Request,
    kind: str,
    client_template: str | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> ChatRun | None:
    """Run a checked chat request (``ctx.check_request`` done) on the engine: its tools, chat
    template and parameters, admission; None when the client left first. ``kind``: the
    request id's prefix. The chat route, /v1/responses and /v1/messages all run here."""
    ctx = ServerContext.of(raw)
    prompt = _ChatPrompt.of(req, ctx, client_template, template_kwargs)
    ticket = ctx.queue.admit()  # a 429 when server.max_queued_requests are waiting
    try:
        return await _generate(req, raw, ctx, ticket, prompt, kind)
    finally:
        ticket.close()  # the first output is in (or the request failed): no longer queued


@dataclass
class _ChatPrompt:
    """How a chat request's prompt is rendered: its tools in the template or the system
    message, and the reader of its answer (tool calls, reasoning)."""

    req: ChatCompletionRequest
    reader: AnswerReader
    build_messages: Any
    template_kwargs: dict[str, Any]
    client_template: str | None

    @classmethod
    def of(
        cls,
        req: ChatCompletionRequest,
        ctx: ServerContext,
        client_template: str | None,
        template_kwargs: dict[str, Any] | None,
    ) -> _ChatPrompt:
        kwargs = dict(template_kwargs or {})
        plan = plan_tools(req)
        build_messages = lambda: template_messages(req.messages)  # noqa: E731
        if plan is not None:
            if template_renders_tools(template_in_use(ctx, client_template)):
                kwargs = {**kwargs, "tools": plan.template_tools()}
            else:  # the template would drop them: the parser's instructions in the system message
                build_messages = lambda: with_tool_instructions(  # noqa: E731
                    template_messages(req.messages), plan, ctx.tool_parser
                )
        reader = AnswerReader(plan, ctx.tool_parser, ctx.reasoning_parser)
        return cls(req, reader, build_messages, kwargs, client_template)

    async def token_ids(self, ctx: ServerContext, deadline: float) -> list[int]:
        """The rendered, tokenized prompt (off the event loop); a 400 naming ``messages``."""
        try:
            return await ctx.preprocess.chat_ids(
                self.build_messages,
                self.req.add_generation_prompt,
                self.template_kwargs,
                self.client_template,
                deadline=deadline,
            )
        except InvalidRequestError as e:  # a ContextLengthError keeps its own code
            err = from_baton_error(e)
            err.param = err.param or "messages"
            raise err from None


async def _generate(
    req: ChatCompletionRequest,
    raw: Request,
    ctx: ServerContext,
    ticket: Ticket,
    prompt: _ChatPrompt,
    kind: str,
) -> ChatRun | None:
    pre = ctx.preprocess
    deadline = pre.deadline()  # templating, tokenization and the checks: off the event loop
    ids = await prompt.token_ids(ctx, deadline)
    reader = prompt.reader
    if req.max_completion_tokens is not None:
        max_tokens, max_param = req.max_completion_tokens, "max_completion_tokens"
    else:
        max_tokens, max_param = req.max_tokens, "max_tokens"
    top = (req.top_logprobs or 0) if req.logprobs else None
    tool_spec = reader.plan.spec() if reader.plan is not None else None
    built = await pre.run(
        lambda: build_params(
            req,
            prompt_token_ids=ids,
            info=ctx.engine.info,
            max_tokens=max_tokens,
            max_tokens_param=max_param,
            prompt_param="messages",
            logprobs=top,
            logprobs_param="top_logprobs",
            tool_spec=tool_spec,
            prompt_logprobs=req.prompt_logprobs,
        ),
        deadline=deadline,
        what="checking the request",
        param="messages",
    )
    request_id = engine_request_id(raw, kind)
    stream = merge(
        [
            ticket.track(
                ctx.engine.generate(
                    built.checked,  # checked once, by build_params
                    request_id=request_id,
                    trace_headers=raw.headers,  # traceparent: the span's parent (tracing on)
                    lora_request=ctx.lora_for(req),
                )
            )
        ]
    )
    acc = Accumulator([len(ids)], req.n)
    run = ChatRun(request_id, ctx.answering_model(req), reader, acc, built, top, stream)
    if not req.stream:
        done = await cancel_on_disconnect(raw, collect(stream, None, acc, built))
        return None if done is DISCONNECTED else run
    first = await cancel_on_disconnect(raw, first_output(stream, built))
    if first is DISCONNECTED:
        return None
    run.first = first
    return run


@dataclass
class AnswerStep:
    """What one engine step adds to a one-choice answer, read by its AnswerStream."""

    delta: AnswerDelta
    finish_reason: str | None = None
    stop_reason: int | str | None = None


async def answer_steps(run: ChatRun) -> AsyncIterator[AnswerStep]:
    """A streamed one-choice run, step by step (usage counted in ``run.acc``); BatonError
    when the engine fails mid-stream. The caller closes ``run.stream``."""
    answer = run.reader.stream()
    item = run.first
    while item is not None:
        p, out = item
        run.acc.add(p, out, keep=False)
        for c in out.outputs:
            delta = answer.step(c.text, last=c.finish_reason is not None)
            yield AnswerStep(delta, c.finish_reason, c.stop_reason)
        item = await anext(run.stream, None)


def _finish_reason(reason: str | None, calls: int) -> str | None:
    """``tool_calls`` when the model stopped after calling tools (OpenAI's reason)."""
    return "tool_calls" if calls and reason == "stop" else reason


async def _beam_chat(
    req: ChatCompletionRequest,
    raw: Request,
    client_template: str | None,
    template_kwargs: dict[str, Any] | None,
) -> Response | ChatCompletionResponse:
    """use_beam_search: the n best beams as the n choices, best first (vLLM's)."""
    ctx = ServerContext.of(raw)
    prompt = _ChatPrompt.of(req, ctx, client_template, template_kwargs)
    params = beam_search_params(
        req,
        req.max_completion_tokens or req.max_tokens,
        {"logprobs": req.logprobs, "tools": prompt.reader.plan is not None},
    )
    ticket = ctx.queue.admit()  # a 429 when server.max_queued_requests are waiting
    try:
        ids = await prompt.token_ids(ctx, ctx.preprocess.deadline())
    finally:
        ticket.close()
    outs = await run_beam_searches(ctx, raw, req, [ids], params)
    if outs is DISCONNECTED:
        return Response(status_code=499)
    choices = []
    for index, seq in enumerate(outs[0].sequences):
        message, _ = _message(seq.text or "", prompt.reader)
        finish = finish_reason(seq, len(ids), ctx, req.ignore_eos)
        choices.append(ChatChoice(index=index, message=message, finish_reason=finish))
    return ChatCompletionResponse(
        id=engine_request_id(raw, "chatcmpl"),
        model=ctx.answering_model(req),
        choices=choices,
        usage=beam_usage([ids], outs),
    )


def _message(text: str, reader: AnswerReader) -> tuple[ChatResponseMessage, int]:
    """The answer's message (content, reasoning and tool calls parsed when a parser is on),
    and how many tool calls it has."""
    if not reader.active:
        return ChatResponseMessage(content=text), 0
    parsed = reader.parse(text)
    message = ChatResponseMessage(
        content=parsed.content,
        reasoning_content=parsed.reasoning,
        tool_calls=tool_call_items(parsed.calls) if parsed.calls else None,
    )
    return message, len(parsed.calls)


def _response(run: ChatRun) -> ChatCompletionResponse:
    acc, top, reader = run.acc, run.top, run.reader
    choices = []
    for index in sorted(acc.choices):
        c = acc.choices[index]
        logprobs = chat_logprobs(c.token_ids, c.logprobs, top) if top is not None else None
        message, calls = _message("".join(c.text), reader)
        finish = _finish_reason(c.finish_reason, calls)
        choices.append(
            ChatChoice(
                index=index,
                message=message,
                logprobs=logprobs,
                finish_reason=finish,
                stop_reason=c.stop_reason,
            )
        )
    return ChatCompletionResponse(
        id=run.request_id,
        model=run.model,
        choices=choices,
        usage=acc.usage(),
        prompt_logprobs=prompt_logprobs_field(acc.prompt_logprobs.get(0)),
        kv_transfer_params=acc.kv_transfer_params,
    )


async def _chunks(run: ChatRun, req: ChatCompletionRequest) -> AsyncIterator[bytes]:
    request_id, model, stream, acc, top, reader = (
        run.request_id,
        run.model,
        run.stream,
        run.acc,
        run.top,
        run.reader,
    )
    created = int(time.time())
    opts = req.stream_options
    include_usage = bool(opts and opts.include_usage)
    continuous = bool(opts and opts.continuous_usage_stats)
    answers: dict[int, AnswerStream] = {}

    def chunk(choices: list[ChatChunkChoice], usage: Any = None) -> bytes:
        c = ChatCompletionChunk(
            id=request_id, created=created, model=model, choices=choices, usage=usage
        )
        return sse(c.model_dump_json(exclude_none=True))

    try:
        yield chunk(
            [
                ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
                for i in range(req.n)
            ]
        )
        item = run.first
        while item is not None:
            p, out = item
            acc.add(p, out, keep=False)
            groups: list[list[ChatChunkChoice]] = []
            for c in out.outputs:
                index = acc.index(p, c)
                if reader.active:
                    answer = answers.setdefault(index, reader.stream())
                    groups.append(_parsed_deltas(index, c, top, answer))
                else:
                    delta = _delta(index, c, top)
                    groups.append([delta] if delta is not None else [])
            # one chunk per step with each choice's first delta; tool-call deltas after it
            for k in range(max((len(g) for g in groups), default=0)):
                choices = [g[k] for g in groups if len(g) > k]
                yield chunk(choices, acc.usage() if continuous and k == 0 else None)
            item = await anext(stream, None)
        if include_usage:
            yield chunk([], acc.usage())
        yield DONE
    except BatonError as e:  # e.g. the engine died mid-stream: tell the client, end without [DONE]
        yield sse(json.dumps(to_openai_error(e, run.built).body()))
    finally:
        await stream.aclose()  # type: ignore[attr-defined]


def _delta(index: int, c: Any, top: int | None) -> ChatChunkChoice | None:
    if not c.text and c.finish_reason is None and not (top is not None and c.logprobs):
        return None
    logprobs = (
        chat_logprobs(c.token_ids, c.logprobs, top) if top is not None and c.logprobs else None
    )
    return ChatChunkChoice(
        index=index,
        delta=DeltaMessage(content=c.text),
        logprobs=logprobs,
        finish_reason=c.finish_reason,
        stop_reason=c.stop_reason,
    )


def _parsed_deltas(
    index: int, c: Any, top: int | None, answer: AnswerStream
) -> list[ChatChunkChoice]:
    """One output of a choice read by its AnswerStream: a delta with its text, reasoning and
    logprobs, then one delta per tool-call piece; the finish reason on the last."""
    d = answer.step(c.text, last=c.finish_reason is not None)
    logprobs = (
        chat_logprobs(c.token_ids, c.logprobs, top) if top is not None and c.logprobs else None
    )
    out = []
    if d.content or d.reasoning or logprobs is not None:
        delta = DeltaMessage(content=d.content or None, reasoning_content=d.reasoning or None)
        out.append(ChatChunkChoice(index=index, delta=delta, logprobs=logprobs))
    out += [ChatChunkChoice(index=index, delta=DeltaMessage(tool_calls=[t])) for t in d.tool_calls]
    if c.finish_reason is not None:
        if not out:
            out.append(ChatChunkChoice(index=index, delta=DeltaMessage()))
        out[-1].finish_reason = _finish_reason(c.finish_reason, answer.calls)
        out[-1].stop_reason = c.stop_reason
    return out
