"""Request and response models of Anthropic's Messages API (POST /v1/messages and
/v1/messages/count_tokens), shaped as the anthropic SDK sends and reads them.

Bounded like protocol/openai.py's models (a request of a million blocks costs what one at the
bound does). Content blocks are told apart by ``type``; an unknown one is a 400 naming
it. Fields a block may carry that baton does not use (``cache_control``, ``citations``)
are accepted and ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from baton.sampling_params import MAX_INT32
from baton_openai.protocol.openai import (
    MAX_MESSAGES,
    STRICT,
    Bounded,
    SamplerFields,
    _message_fields_bounded,
    _Model,
)


class _Block(BaseModel):
    model_config = STRICT | ConfigDict(extra="allow")


class TextBlock(_Block):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Block):
    """An assistant's earlier call."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: Annotated[dict[str, Any], Bounded]


class ToolResultBlock(_Block):
    """A user's answer to a call (``tool_use_id``)."""

    type: Literal["tool_result"]
    tool_use_id: str
    content: str | Annotated[list[TextBlock], Bounded] = ""
    is_error: bool = False


class ThinkingBlock(_Block):
    """An assistant's earlier reasoning (not shown to the model again, as chat templates do)."""

    type: Literal["thinking"]
    thinking: str
    signature: str = ""


class RedactedThinkingBlock(_Block):
    type: Literal["redacted_thinking"]
    data: str


InputBlock = Annotated[
    TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
    Field(discriminator="type"),
]


def _as_blocks(value: Any) -> Any:
    """A message's text content as the one text block it stands for."""
    return [{"type": "text", "text": value}] if isinstance(value, str) else value


class MessageParam(BaseModel):
    model_config = STRICT

    role: Literal["user", "assistant"]
    content: Annotated[
        list[InputBlock],
        Bounded,
        BeforeValidator(_as_blocks, json_schema_input_type=str | list[InputBlock]),
    ]


class AnthropicTool(_Block):
    """A client tool: ``input_schema`` is the JSON schema of its ``input``."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")
    description: str | None = None
    input_schema: Annotated[dict[str, Any], Bounded]
    type: Literal["custom"] | None = None


class ToolChoice(BaseModel):
    model_config = STRICT

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    """The tool to call (type ``tool``)."""
    disable_parallel_tool_use: bool = False

    @model_validator(mode="after")
    def _named(self) -> ToolChoice:
        if (self.type == "tool") != (self.name is not None):
            raise ValueError('name is given with type "tool", and only then')
        return self


Messages = Annotated[
    list[MessageParam],
    Field(min_length=1, max_length=MAX_MESSAGES),
    BeforeValidator(_message_fields_bounded),
]


class CountTokensRequest(_Model):
    """What a prompt is made of: the conversation, the system prompt, the tools."""

    model: str | None = None
    messages: Messages
    system: str | Annotated[list[TextBlock], Bounded] | None = None
    tools: Annotated[list[AnthropicTool], Bounded] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Annotated[dict[str, Any], Bounded] | None = None
    """Accepted; an answer's reasoning is split out by server.reasoning_parser."""


class JsonOutputFormat(BaseModel):
    model_config = STRICT | ConfigDict(populate_by_name=True)

    type: Literal["json_schema"]
    json_schema: Annotated[dict[str, Any], Bounded] = Field(alias="schema")


class OutputConfig(BaseModel):
    model_config = STRICT

    format: JsonOutputFormat | None = None
    """The answer's text is JSON valid against this schema (the structured-output backend)."""
    effort: str | None = None
    """Accepted, not used."""


class MessagesRequest(SamplerFields, CountTokensRequest):
    max_tokens: int = Field(ge=1, lt=MAX_INT32)
    stop_sequences: Annotated[list[str], Bounded] | None = None
    stream: bool = False
    metadata: Annotated[dict[str, Any], Bounded] | None = None
    """``user_id`` is the request's user (as OpenAI's ``user``)."""
    output_config: OutputConfig | None = None


# ---------------------------------------------------------------------- responses


class TextContent(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ToolUseContent(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class ThinkingContent(BaseModel):
    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""


class MessagesUsage(BaseModel):
    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int | None = None


StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class MessageResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[ThinkingContent | TextContent | ToolUseContent]
    stop_reason: StopReason | None = None
    stop_sequence: str | None = None
    usage: MessagesUsage


class CountTokensResponse(BaseModel):
    input_tokens: int
