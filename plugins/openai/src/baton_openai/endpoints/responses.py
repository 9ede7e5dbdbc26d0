"""POST /v1/responses, GET and DELETE /v1/responses/{id}: OpenAI's Responses API on the chat
pipeline.

A Responses request runs as a chat request (chat.start_chat): ``instructions`` as the
system message, then the stored conversation of ``previous_response_id`` (endpoints/response_store.py),
then the ``input`` items (``message`` items as messages, ``function_call`` items as an
assistant's ``tool_calls``, ``function_call_output`` items as ``tool`` messages); function
``tools`` and ``tool_choice`` as chat's (required and a named function enforced by the
grammar), ``text.format`` as chat's ``response_format``, ``max_output_tokens`` as
``max_completion_tokens``. The answer, read by the same reasoning and tool-call parsers,
comes back as output items (``reasoning``, ``message``, ``function_call``), or as the
Responses API's typed events, each with its ``sequence_number``.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal

from fastapi import APIRouter, Request, Response
from pydantic import BaseModel

from baton.errors import BatonError
from baton_openai.endpoints.chat import ChatRun, answer_steps, as_chat, start_chat
from baton_openai.endpoints.response_store import ResponseStore
from baton_openai.http.errors import OpenAIError
from baton_openai.http.json_body import PiecewiseJSONRoute
from baton_openai.http.openapi import GENERATION_ERRORS, error_responses, streaming_ok
from baton_openai.http.streaming import SSEResponse, sse_event
from baton_openai.pipeline.answer import ParsedAnswer
from baton_openai.pipeline.context import ServerContext
from baton_openai.pipeline.generation import Choice, to_openai_error
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
from baton_openai.protocol.responses import (
    DeletedResponse,
    FunctionCallItem,
    FunctionCallOutput,
    FunctionCallOutputItem,
    FunctionChoice,
    IncompleteDetails,
    InputItem,
    MessageItem,
    OutputItem,
    OutputMessage,
    OutputText,
    ReasoningOutput,
    ReasoningText,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)

router = APIRouter(route_class=PiecewiseJSONRoute)
#: chat's names for the request's fields -> the Responses API's (in error messages)
PARAMS = {
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
    "messages": "input",
}
Status = Literal["completed", "incomplete"]
ItemStatus = Literal["in_progress", "completed", "incomplete"]
ItemKind = Literal["reasoning", "message", "function_call"]
_PREFIX = {"reasoning": "rs", "message": "msg", "function_call": "fc"}


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def response_store(raw: Request) -> ResponseStore:
    """The app's store, made on first use from server.response_store_max_bytes / _ttl."""
    state = raw.app.state
    store: ResponseStore | None = getattr(state, "response_store", None)
    if store is None:
        srv = ServerContext.of(raw).engine.config.server
        store = state.response_store = ResponseStore(
            int(srv.response_store_max_bytes), srv.response_store_ttl
        )
    return store


def conversation(items: list[InputItem] | list[OutputItem]) -> list[ChatMessage]:
    """Input or output items as chat messages: consecutive calls join the assistant message
    before them as its ``tool_calls``."""
    out: list[dict[str, Any]] = []
    for item in items:
        if isinstance(item, MessageItem | OutputMessage):
            role = "system" if getattr(item, "role", "") == "developer" else item.role
            out.append({"role": role, "content": "\n".join(p.text for p in item.content)})
        elif isinstance(item, FunctionCallItem | FunctionCallOutput):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            text = "\n".join(p.text for p in item.output)
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": text})
        # reasoning items: an earlier turn's reasoning is not shown to the model again
    return [ChatMessage.model_validate(m) for m in out]


def chat_request(req: ResponsesRequest, history: list[ChatMessage]) -> ChatCompletionRequest:
    """The chat request this one runs as. With tool_choice required or a named function the
    answer is a call, which ``text.format`` (about text) does not constrain: it applies to
    the turns that answer in text (an agent's last)."""
    system = [ChatMessage(role="system", content=req.instructions)] if req.instructions else []
    text_format = _response_format(req)
    forced_call = bool(req.tools) and (
        req.tool_choice == "required" or isinstance(req.tool_choice, FunctionChoice)
    )
    fields: dict[str, Any] = {
        **req.sampler_fields(),
        "messages": [*system, *history, *conversation(req.input)],
        "max_completion_tokens": req.max_output_tokens,
        "parallel_tool_calls": req.parallel_tool_calls,
        "stream": req.stream,
        "user": req.user,
        "response_format": None if forced_call else text_format,
    }
    if req.tools:
        fields["tools"] = [
            ChatTool(
                type="function",
                function=FunctionDefinition(
                    name=t.name, description=t.description, parameters=t.parameters, strict=t.strict
                ),
            )
            for t in req.tools
        ]
    choice = req.tool_choice
    if isinstance(choice, FunctionChoice):
        fields["tool_choice"] = NamedToolChoice(
            type="function", function=NamedFunction(name=choice.name)
        )
    elif choice is not None:
        fields["tool_choice"] = choice
    return as_chat(fields)


def _response_format(req: ResponsesRequest) -> ResponseFormat | None:
    fmt = req.text.format if req.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return ResponseFormat(type="json_object")
    if fmt.json_schema is None:
        raise OpenAIError(
            "text.format of type json_schema needs schema (a JSON schema object)",
            param="text.format.schema",
            code="invalid_value",
        )
    schema = JsonSchemaFormat(name=fmt.name or "response", schema=fmt.json_schema)
    return ResponseFormat(type="json_schema", json_schema=schema)


def _refuse_unsupported(req: ResponsesRequest) -> None:
    if req.background:
        raise OpenAIError(
            "background responses are not supported: leave background out (or false)",
            param="background",
            code="unsupported_parameter",
        )
    if "conversation" in (req.model_extra or {}):
        raise OpenAIError(
            "conversations are not supported: continue a response with previous_response_id",
            param="conversation",
            code="unsupported_parameter",
        )


@router.post(
    "/v1/responses",
    response_model=None,
    response_model_exclude_none=True,
    responses=streaming_ok(ResponseObject, "response event", last="the last is response.completed")
    | error_responses(*GENERATION_ERRORS),
)
async def create_response(req: ResponsesRequest, raw: Request) -> Response | ResponseObject:
    ctx = ServerContext.of(raw)
    ctx.check_request(req)
    _refuse_unsupported(req)
    store = response_store(raw)
    history: list[ChatMessage] = []
    if req.previous_response_id is not None:
        previous = store.get(req.previous_response_id)
        if previous is None:
            raise _not_stored(req.previous_response_id, "previous_response_id")
        history = previous.history
    chat = chat_request(req, history)
    try:
        run = await start_chat(chat, raw, "resp")
    except OpenAIError as e:
        raise e.renamed(PARAMS) from None
    if run is None:
        return Response(status_code=499)
    turn = _Turn(req, run, store, [*history, *conversation(req.input)])
    if req.stream:
        return SSEResponse(_events(turn))
    choice = run.acc.choices.get(0, Choice())
    parsed = run.reader.parse("".join(choice.text))
    return turn.finish(_output(parsed, _status(choice.finish_reason)), choice.finish_reason)


def _status(finish: str | None) -> Status:
    return "incomplete" if finish == "length" else "completed"


def _output(parsed: ParsedAnswer, status: Status) -> list[OutputItem]:
    out: list[OutputItem] = []
    if parsed.reasoning:
        text = [ReasoningText(text=parsed.reasoning)]
        out.append(ReasoningOutput(id=_id("rs"), status=status, content=text))
    if parsed.content or not parsed.calls:
        text = [OutputText(text=parsed.content or "")]
        out.append(OutputMessage(id=_id("msg"), status=status, content=text))
    for call in parsed.calls:
        out.append(
            FunctionCallOutput(
                id=_id("fc"),
                call_id=_id("call"),
                name=call.name,
                arguments=call.arguments,
                status=status,
            )
        )
    return out


@dataclass
class _Turn:
    """One request's response: its fields, and keeping it when ``store`` is on."""

    req: ResponsesRequest
    run: ChatRun
    store: ResponseStore
    #: The conversation before the answer (the earlier turns, this input).
    history: list[ChatMessage]
    created_at: int = field(default_factory=lambda: int(time.time()))

    def response(
        self,
        status: Literal["in_progress", "completed", "incomplete"],
        output: list[OutputItem],
        usage: bool,
    ) -> ResponseObject:
        req = self.req
        counts = self.run.acc.usage()
        cached = (counts.prompt_tokens_details or {}).get("cached_tokens", 0)
        return ResponseObject(
            id=self.run.request_id,
            created_at=self.created_at,
            status=status,
            model=self.run.model,
            output=output,
            instructions=req.instructions,
            max_output_tokens=req.max_output_tokens,
            parallel_tool_calls=req.parallel_tool_calls,
            previous_response_id=req.previous_response_id,
            temperature=req.temperature,
            top_p=req.top_p,
            tool_choice=req.tool_choice or "auto",
            tools=req.tools or [],
            text=(
                req.text.model_dump(by_alias=True, exclude_none=True)
                if req.text is not None and req.text.format is not None
                else {"format": {"type": "text"}}
            ),
            reasoning=req.reasoning,
            store=req.store,
            metadata=req.metadata or {},
            user=req.user,
            usage=ResponseUsage(
                input_tokens=counts.prompt_tokens,
                input_tokens_details={"cached_tokens": cached},
                output_tokens=counts.completion_tokens,
                output_tokens_details={"reasoning_tokens": 0},
                total_tokens=counts.total_tokens,
            )
            if usage
            else None,
            incomplete_details=(
                IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None
            ),
        )

    def finish(self, output: list[OutputItem], finish_reason: str | None) -> ResponseObject:
        """The finished response, kept in the store when the request asked for it."""
        response = self.response(_status(finish_reason), output, usage=True)
        if self.req.store:
            self.store.put(response, [*self.history, *conversation(output)])
        return response


class _Events:
    """The stream's events, numbered from 0 (``sequence_number``)."""

    def __init__(self) -> None:
        self.seq = 0

    def __call__(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return sse_event(kind, json.dumps(payload, ensure_ascii=False))


def _dump(model: BaseModel) -> dict[str, Any]:
    return model.model_dump(exclude_none=True)


@dataclass
class _OpenItem:
    kind: ItemKind
    index: int
    id: str
    text: str = ""
    call_id: str = ""
    name: str = ""


class _Output:
    """The output items of a streamed answer: each added, its deltas, then done."""

    def __init__(self, emit: _Events) -> None:
        self.emit = emit
        self.items: list[OutputItem] = []
        self.open: _OpenItem | None = None

    def _item(self, o: _OpenItem, status: ItemStatus) -> OutputItem:
        """The item as it stands (in progress: without its text, which the deltas carry)."""
        if o.kind == "reasoning":
            text = [ReasoningText(text=o.text)] if status != "in_progress" else []
            return ReasoningOutput(id=o.id, status=status, content=text)
        if o.kind == "message":
            parts = [OutputText(text=o.text)] if status != "in_progress" else []
            return OutputMessage(id=o.id, status=status, content=parts)
        return FunctionCallOutput(
            id=o.id, call_id=o.call_id, name=o.name, arguments=o.text, status=status
        )

    def start(self, kind: ItemKind, **names: str) -> list[bytes]:
        out = self.close("completed")
        o = self.open = _OpenItem(kind, len(self.items), _id(_PREFIX[kind]), **names)
        added = _dump(self._item(o, "in_progress"))
        out.append(self.emit("response.output_item.added", output_index=o.index, item=added))
        part = {"reasoning": ReasoningText(text=""), "message": OutputText(text="")}.get(kind)
        if part is not None:
            out.append(
                self.emit(
                    "response.content_part.added",
                    item_id=o.id,
                    output_index=o.index,
                    content_index=0,
                    part=_dump(part),
                )
            )
        return out

    def delta(self, kind: ItemKind, text: str) -> list[bytes]:
        out = [] if self.open is not None and self.open.kind == kind else self.start(kind)
        o = self.open
        assert o is not None
        o.text += text
        where = {"item_id": o.id, "output_index": o.index}
        if kind == "reasoning":
            out.append(
                self.emit("response.reasoning_text.delta", **where, content_index=0, delta=text)
            )
        elif kind == "message":
            out.append(
                self.emit(
                    "response.output_text.delta", **where, content_index=0, delta=text, logprobs=[]
                )
            )
        else:
            out.append(self.emit("response.function_call_arguments.delta", **where, delta=text))
        return out

    def close(self, status: ItemStatus) -> list[bytes]:
        o = self.open
        if o is None:
            return []
        self.open = None
        item = self._item(o, status)
        self.items.append(item)
        where = {"item_id": o.id, "output_index": o.index}
        out = []
        if o.kind == "reasoning":
            out.append(
                self.emit("response.reasoning_text.done", **where, content_index=0, text=o.text)
            )
            part = _dump(ReasoningText(text=o.text))
        elif o.kind == "message":
            out.append(
                self.emit(
                    "response.output_text.done", **where, content_index=0, text=o.text, logprobs=[]
                )
            )
            part = _dump(OutputText(text=o.text))
        else:
            out.append(
                self.emit(
                    "response.function_call_arguments.done", **where, name=o.name, arguments=o.text
                )
            )
            part = None
        if part is not None:
            out.append(self.emit("response.content_part.done", **where, content_index=0, part=part))
        out.append(self.emit("response.output_item.done", output_index=o.index, item=_dump(item)))
        return out


async def _events(turn: _Turn) -> AsyncIterator[bytes]:
    """response.created, response.in_progress, each output item's events, response.completed
    (response.incomplete when max_output_tokens cut the answer short)."""
    emit = _Events()
    output = _Output(emit)
    run = turn.run
    finish: str | None = None
    try:
        started = _dump(turn.response("in_progress", [], usage=False))
        yield emit("response.created", response=started)
        yield emit("response.in_progress", response=started)
        async for step in answer_steps(run):
            d = step.delta
            chunks = []
            if d.reasoning:
                chunks += output.delta("reasoning", d.reasoning)
            if d.content:
                chunks += output.delta("message", d.content)
            for t in d.tool_calls:
                if t.id is not None:  # a new call
                    chunks += output.start(
                        "function_call", call_id=t.id, name=t.function.name or ""
                    )
                if t.function.arguments:
                    chunks += output.delta("function_call", t.function.arguments)
            for chunk in chunks:
                yield chunk
            finish = step.finish_reason or finish
        if not output.items and output.open is None:  # an empty answer: one empty message
            for chunk in output.start("message"):
                yield chunk
        for chunk in output.close(_status(finish)):
            yield chunk
        response = turn.finish(output.items, finish)
        kind = "response.completed" if response.status == "completed" else "response.incomplete"
        yield emit(kind, response=_dump(response))
    except BatonError as e:  # e.g. the engine died mid-stream: an error event ends the stream
        err = to_openai_error(e, run.built).renamed(PARAMS)
        yield emit("error", code=err.code, message=err.message, param=err.param)
    finally:
        await run.stream.aclose()  # type: ignore[attr-defined]


def _not_stored(response_id: str, param: str = "response_id") -> OpenAIError:
    return OpenAIError(
        f"no stored response {response_id!r}: responses are kept only with store: true, for "
        "server.response_store_ttl seconds and within server.response_store_max_bytes",
        404,
        param=param,
        code="response_not_found",
    )


@router.get(
    "/v1/responses/{response_id}",
    response_model_exclude_none=True,
    responses=error_responses(401, 404, 500),
)
async def get_response(response_id: str, raw: Request) -> ResponseObject:
    entry = response_store(raw).get(response_id)
    if entry is None:
        raise _not_stored(response_id)
    return entry.response


@router.delete("/v1/responses/{response_id}", responses=error_responses(401, 404, 500))
async def delete_response(response_id: str, raw: Request) -> DeletedResponse:
    if not response_store(raw).delete(response_id):
        raise _not_stored(response_id)
    return DeletedResponse(id=response_id)
