"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API on the chat pipeline.

A Messages request runs as a chat request (chat.start_chat): the system prompt first,
an assistant's ``tool_use`` blocks as its ``tool_calls``, each ``tool_result`` block as a
``tool`` message, ``tools`` as functions whose parameters are their ``input_schema``, and
``tool_choice`` auto / any / tool / none as chat's auto / required / the named function /
none (so ``any`` and ``tool`` are enforced by the structured-output grammar). The answer,
read by the same reasoning and tool-call parsers, comes back as content blocks
(``thinking``, ``text``, ``tool_use`` with its ``input`` an object), or as Anthropic's
stream of events. Errors are in Anthropic's shape (errors.ANTHROPIC_PATHS).
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request, Response

from baton.errors import BatonError
from baton_openai.endpoints.chat import ChatRun, answer_steps, as_chat, start_chat
from baton_openai.endpoints.tokenize import chat_prompt_ids
from baton_openai.http.errors import OpenAIError
from baton_openai.http.json_body import PiecewiseJSONRoute
from baton_openai.http.openapi import (
    GENERATION_ERRORS,
    AnthropicErrorResponse,
    error_responses,
    streaming_ok,
)
from baton_openai.http.streaming import SSEResponse, sse_event
from baton_openai.pipeline.context import ServerContext
from baton_openai.pipeline.generation import Choice, to_openai_error
from baton_openai.protocol.messages import (
    CountTokensRequest,
    CountTokensResponse,
    MessageResponse,
    MessagesRequest,
    MessagesUsage,
    StopReason,
    TextBlock,
    TextContent,
    ThinkingContent,
    ToolResultBlock,
    ToolUseBlock,
    ToolUseContent,
)
from baton_openai.protocol.openai import (
    ChatCompletionRequest,
    ChatMessage,
    ChatTool,
    FunctionDefinition,
    JsonSchemaFormat,
    NamedFunction,
    NamedToolChoice,
    ResponseFormat,
)

log = logging.getLogger("baton_openai")
router = APIRouter(route_class=PiecewiseJSONRoute)
#: chat's names for the request's fields -> the Messages API's (in error messages)
PARAMS = {
    "max_completion_tokens": "max_tokens",
    "response_format": "output_config.format",
    "stop": "stop_sequences",
}


def tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


def _text(blocks: str | list[TextBlock]) -> str:
    return blocks if isinstance(blocks, str) else "\n".join(b.text for b in blocks)


def chat_messages(req: CountTokensRequest) -> list[ChatMessage]:
    """The conversation as chat messages (blocks of one message in their order)."""
    out = []
    if req.system:
        out.append(ChatMessage(role="system", content=_text(req.system)))
    for i, m in enumerate(req.messages):
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        for j, block in enumerate(m.content):
            where = f"messages[{i}].content[{j}]"
            if isinstance(block, TextBlock):
                texts.append(block.text)
            elif isinstance(block, ToolUseBlock):
                if m.role != "assistant":
                    raise _misplaced(where, "tool_use", "an assistant")
                arguments = json.dumps(block.input, ensure_ascii=False)
                calls.append(
                    {
                        "id": block.id,
                        "type": "function",
                        "function": {"name": block.name, "arguments": arguments},
                    }
                )
            elif isinstance(block, ToolResultBlock):
                if m.role != "user":
                    raise _misplaced(where, "tool_result", "a user")
                if texts:  # text before the result stays before it
                    out.append(ChatMessage(role="user", content="\n".join(texts)))
                    texts = []
                result = {"role": "tool", "content": _text(block.content)}
                out.append(
                    ChatMessage.model_validate({**result, "tool_call_id": block.tool_use_id})
                )
            # thinking blocks: an earlier turn's reasoning is not shown to the model again
        if m.role == "assistant":
            message = {"role": "assistant", "content": "\n".join(texts)}
            out.append(
                ChatMessage.model_validate({**message, "tool_calls": calls} if calls else message)
            )
        elif texts:
            out.append(ChatMessage(role="user", content="\n".join(texts)))
    return out


def _misplaced(where: str, kind: str, role: str) -> OpenAIError:
    return OpenAIError(
        f"{where}: a {kind} block belongs in {role} message",
        param="messages",
        code="invalid_value",
    )


def chat_fields(req: CountTokensRequest) -> dict[str, Any]:
    """The chat request's messages, tools and tool choice."""
    fields: dict[str, Any] = {"messages": chat_messages(req)}
    if req.tools:
        fields["tools"] = [
            ChatTool(
                type="function",
                function=FunctionDefinition(
                    name=t.name, description=t.description, parameters=t.input_schema
                ),
            )
            for t in req.tools
        ]
    choice = req.tool_choice
    if choice is not None:
        if choice.type == "tool":
            assert choice.name is not None  # ToolChoice checks it
            named = NamedToolChoice(type="function", function=NamedFunction(name=choice.name))
            fields["tool_choice"] = named
        else:
            fields["tool_choice"] = {"any": "required"}.get(choice.type, choice.type)
        fields["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    return fields


def chat_request(req: MessagesRequest) -> ChatCompletionRequest:
    """The chat request this one runs as; ``output_config.format`` does not constrain an
    answer that tool_choice any / tool makes a call (as in responses.chat_request)."""
    user = (req.metadata or {}).get("user_id")
    output = req.output_config.format if req.output_config is not None else None
    if req.tools and req.tool_choice is not None and req.tool_choice.type in ("any", "tool"):
        output = None
    schema = JsonSchemaFormat(schema=output.json_schema) if output is not None else None
    return as_chat(
        {
            **req.sampler_fields(),
            **chat_fields(req),
            "max_completion_tokens": req.max_tokens,
            "stop": req.stop_sequences,
            "stream": req.stream,
            "user": user if isinstance(user, str) else None,
            "response_format": (
                ResponseFormat(type="json_schema", json_schema=schema) if schema else None
            ),
        }
    )


def stop_reason(
    finish: str | None, stop: int | str | None, calls: int
) -> tuple[StopReason | None, str | None]:
    """Anthropic's stop_reason (and stop_sequence) for the engine's finish."""
    if finish == "length":
        return "max_tokens", None
    if calls:
        return "tool_use", None
    if finish == "stop" and isinstance(stop, str):
        return "stop_sequence", stop
    return ("end_turn", None) if finish is not None else (None, None)


def call_input(name: str, arguments: str) -> dict[str, Any]:
    """A call's arguments as the object ``tool_use.input`` is; a call whose arguments are not
    an object (a parser kept a string the model wrote) gets ``{}``, with a warning."""
    try:
        value = json.loads(arguments)
    except ValueError:
        value = None
    if isinstance(value, dict):
        return value
    log.warning(
        "the model called %s with arguments that are not a JSON object: %r", name, arguments
    )
    return {}


@router.post(
    "/v1/messages",
    response_model=None,
    response_model_exclude_none=True,
    responses=streaming_ok(MessageResponse, "message event", last="the last is message_stop")
    | error_responses(*GENERATION_ERRORS, model=AnthropicErrorResponse),
)
async def create_message(req: MessagesRequest, raw: Request) -> Response | MessageResponse:
    ctx = ServerContext.of(raw)
    ctx.check_request(req)
    try:
        run = await start_chat(chat_request(req), raw, "msg")
    except OpenAIError as e:
        raise e.renamed(PARAMS) from None
    if run is None:
        return Response(status_code=499)
    if req.stream:
        return SSEResponse(_events(run))
    return _message(run)


def _message(run: ChatRun) -> MessageResponse:
    choice = run.acc.choices.get(0, Choice())
    parsed = run.reader.parse("".join(choice.text))
    content: list[ThinkingContent | TextContent | ToolUseContent] = []
    if parsed.reasoning:
        content.append(ThinkingContent(thinking=parsed.reasoning))
    if parsed.content or not parsed.calls:
        content.append(TextContent(text=parsed.content or ""))
    for call in parsed.calls:
        content.append(
            ToolUseContent(
                id=tool_use_id(), name=call.name, input=call_input(call.name, call.arguments)
            )
        )
    reason, sequence = stop_reason(choice.finish_reason, choice.stop_reason, len(parsed.calls))
    return MessageResponse(
        id=run.request_id,
        model=run.model,
        content=content,
        stop_reason=reason,
        stop_sequence=sequence,
        usage=_usage(run),
    )


def _usage(run: ChatRun) -> MessagesUsage:
    usage = run.acc.usage()
    cached = (usage.prompt_tokens_details or {}).get("cached_tokens")
    return MessagesUsage(
        input_tokens=usage.prompt_tokens,
        output_tokens=usage.completion_tokens,
        cache_read_input_tokens=cached,
    )


class _Blocks:
    """The content blocks of a streamed answer, opened and closed as its deltas come."""

    def __init__(self) -> None:
        self.count = 0
        self.open: str | None = None  # the kind of the block in progress

    def start(self, kind: str, block: dict[str, Any]) -> list[bytes]:
        out = self.stop()
        self.open = kind
        out.append(_event("content_block_start", index=self.count, content_block=block))
        return out

    def delta(self, kind: str, delta: dict[str, Any]) -> list[bytes]:
        out = [] if self.open == kind else self.start(kind, _EMPTY[kind])
        out.append(_event("content_block_delta", index=self.count, delta=delta))
        return out

    def stop(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        self.count += 1
        return [_event("content_block_stop", index=self.count - 1)]


_EMPTY = {
    "thinking": {"type": "thinking", "thinking": "", "signature": ""},
    "text": {"type": "text", "text": ""},
}


def _event(kind: str, **fields: Any) -> bytes:
    return sse_event(kind, json.dumps({"type": kind, **fields}, ensure_ascii=False))


async def _events(run: ChatRun) -> AsyncIterator[bytes]:
    """message_start, each block's start, deltas and stop, message_delta, message_stop."""
    start = MessageResponse(
        id=run.request_id, model=run.model, content=[], usage=MessagesUsage(**_counts(run))
    )
    blocks = _Blocks()
    calls = 0
    reason: tuple[StopReason | None, str | None] = (None, None)
    try:
        yield _event("message_start", message=start.model_dump(exclude_none=True))
        async for step in answer_steps(run):
            d = step.delta
            for chunk in [
                *(blocks.delta("thinking", _delta("thinking", d.reasoning)) if d.reasoning else []),
                *(blocks.delta("text", _delta("text", d.content)) if d.content else []),
            ]:
                yield chunk
            for t in d.tool_calls:
                if t.id is not None:  # a new call
                    calls += 1
                    block = {"type": "tool_use", "id": tool_use_id(), "name": t.function.name}
                    for chunk in blocks.start("tool_use", {**block, "input": {}}):
                        yield chunk
                if t.function.arguments:
                    json_delta = {"type": "input_json_delta", "partial_json": t.function.arguments}
                    for chunk in blocks.delta("tool_use", json_delta):
                        yield chunk
            if step.finish_reason is not None:
                reason = stop_reason(step.finish_reason, step.stop_reason, calls)
        if blocks.count == 0 and blocks.open is None:  # an empty answer: one empty text block
            for chunk in blocks.start("text", _EMPTY["text"]):
                yield chunk
        for chunk in blocks.stop():
            yield chunk
        yield _event(
            "message_delta",
            delta={"stop_reason": reason[0], "stop_sequence": reason[1]},
            usage=_counts(run),
        )
        yield _event("message_stop")
    except BatonError as e:  # e.g. the engine died mid-stream: Anthropic's error event
        err = to_openai_error(e, run.built).renamed(PARAMS)
        yield sse_event("error", json.dumps(err.body_for("/v1/messages")))
    finally:
        await run.stream.aclose()  # type: ignore[attr-defined]


def _delta(kind: str, text: str) -> dict[str, Any]:
    return {"type": f"{kind}_delta", kind: text}


def _counts(run: ChatRun) -> dict[str, int]:
    usage = run.acc.usage()
    return {"input_tokens": usage.prompt_tokens, "output_tokens": usage.completion_tokens}


@router.post(
    "/v1/messages/count_tokens",
    responses=error_responses(400, 401, 404, 408, 413, 500, 503, model=AnthropicErrorResponse),
)
async def count_tokens(req: CountTokensRequest, raw: Request) -> CountTokensResponse:
    """The prompt's tokens as /v1/messages would render it (system prompt and tools included)."""
    ctx = ServerContext.of(raw)
    ctx.check_request(req)
    ids = await chat_prompt_ids(as_chat(chat_fields(req)), ctx)
    return CountTokensResponse(input_tokens=len(ids))
