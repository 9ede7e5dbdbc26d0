"""Request and response models of OpenAI's Responses API (POST /v1/responses), shaped as the
openai SDK sends and reads them.

``input`` is a text (one user message) or a list of items told apart by ``type``
(``message``, the default; ``function_call``; ``function_call_output``; ``reasoning``):
an unknown type is a 400 naming the item. Bounded like protocol/openai.py's models. Fields an
item may carry that baton does not use (``id``, ``status``, ``annotations``) are
accepted and ignored.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Tag

from baton.sampling_params import MAX_INT32
from baton_openai.protocol.openai import MAX_MESSAGES, STRICT, Bounded, SamplerFields


class _Item(BaseModel):
    model_config = STRICT | ConfigDict(extra="allow")


class TextPart(_Item):
    """A message's text: ``input_text`` (user, system, developer) or ``output_text``
    (assistant)."""

    type: Literal["input_text", "output_text"]
    text: str


def _as_parts(value: Any) -> Any:
    return [{"type": "input_text", "text": value}] if isinstance(value, str) else value


Parts = Annotated[
    list[TextPart],
    Bounded,
    BeforeValidator(_as_parts, json_schema_input_type=str | list[TextPart]),
]


class MessageItem(_Item):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Parts


class FunctionCallItem(_Item):
    """A call the model made earlier (the output of an earlier response)."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(_Item):
    """What the client's function answered to ``call_id``."""

    type: Literal["function_call_output"]
    call_id: str
    output: Parts


class ReasoningItem(_Item):
    """Earlier reasoning: accepted, not shown to the model again (as chat templates do)."""

    type: Literal["reasoning"]


def _item_type(value: Any) -> str | None:
    if isinstance(value, dict):
        kind = value.get("type", "message")
        return kind if isinstance(kind, str) else None
    return getattr(value, "type", None)


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(
        _item_type,
        custom_error_type="invalid_item_type",
        custom_error_message="unknown item type: give one of message, function_call, "
        "function_call_output, reasoning",
    ),
]


def _as_items(value: Any) -> Any:
    return [{"role": "user", "content": value}] if isinstance(value, str) else value


class FunctionTool(_Item):
    type: Literal["function"]
    name: str = Field(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")
    description: str | None = None
    parameters: Annotated[dict[str, Any], Bounded] | None = None
    strict: bool | None = None


class FunctionChoice(BaseModel):
    model_config = STRICT

    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    model_config = STRICT | ConfigDict(populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    json_schema: Annotated[dict[str, Any], Bounded] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(BaseModel):
    model_config = STRICT | ConfigDict(extra="allow")

    format: TextFormat | None = None


ToolChoice = Literal["none", "auto", "required"] | FunctionChoice


class ResponsesRequest(SamplerFields):
    input: Annotated[
        list[InputItem],
        Field(min_length=1, max_length=MAX_MESSAGES),
        BeforeValidator(_as_items, json_schema_input_type=str | list[InputItem]),
    ]
    instructions: str | None = None
    """A system message first; not carried to a later response (as OpenAI does)."""
    tools: Annotated[list[FunctionTool], Bounded] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    max_output_tokens: int | None = Field(None, ge=1, lt=MAX_INT32)
    text: TextConfig | None = None
    reasoning: Annotated[dict[str, Any], Bounded] | None = None
    """Accepted; the answer's reasoning is split out by server.reasoning_parser."""
    store: bool = True
    stream: bool = False
    previous_response_id: str | None = None
    background: bool = False
    include: Annotated[list[str], Bounded] | None = None
    """Accepted (the SDKs send it); no extra output is included."""
    metadata: Annotated[dict[str, str], Bounded] | None = None
    user: str | None = None


# ---------------------------------------------------------------------- responses


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningOutput(BaseModel):
    type: Literal["reasoning"] = "reasoning"
    id: str
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText]


class FunctionCallOutput(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


OutputItem = OutputMessage | ReasoningOutput | FunctionCallOutput


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: dict[str, int]
    output_tokens: int
    output_tokens_details: dict[str, int]
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    instructions: str | None = None
    max_output_tokens: int | None = None
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    tool_choice: ToolChoice = "auto"
    tools: list[FunctionTool] = Field(default_factory=list)
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    reasoning: dict[str, Any] | None = None
    store: bool = True
    metadata: dict[str, str] = Field(default_factory=dict)
    user: str | None = None
    usage: ResponseUsage | None = None
    incomplete_details: IncompleteDetails | None = None
    error: dict[str, Any] | None = None


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response"] = "response"
    deleted: bool = True
