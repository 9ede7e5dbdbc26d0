"""What tool-call and reasoning parsers take and return: the structs of the parser seams.

A parser reads a chat answer's text. Non-streamed it returns the whole split; streamed
it is fed the text deltas as they come and returns events (``feed``), then the rest
(``end``). The server turns calls into OpenAI's ``tool_calls`` (giving each an id and an
index) and reasoning into ``reasoning_content``.
"""

from __future__ import annotations

from typing import Literal, Protocol

from pydantic import BaseModel

from baton_openai.protocol.openai import ChatTool


class ToolCall(BaseModel):
    """One call the model made: the function's name and its arguments as JSON text."""

    name: str
    arguments: str


class ParsedTools(BaseModel):
    """An answer split into its text (None when only calls were made) and its calls."""

    content: str | None = None
    calls: list[ToolCall] = []


class ContentDelta(BaseModel):
    """Answer text that is not part of a call."""

    kind: Literal["content"] = "content"
    text: str


class CallStart(BaseModel):
    """A new call begins (its arguments follow as CallArguments)."""

    kind: Literal["call_start"] = "call_start"
    name: str


class CallArguments(BaseModel):
    """A fragment of the current call's arguments (JSON text; the fragments concatenate)."""

    kind: Literal["call_arguments"] = "call_arguments"
    text: str


ToolEvent = ContentDelta | CallStart | CallArguments


class ToolCallStream(Protocol):
    """The streamed form of one answer's parse."""

    def feed(self, text: str) -> list[ToolEvent]: ...

    def end(self) -> list[ToolEvent]: ...


class ToolParser(Protocol):
    """What ``register_tool_parsers`` factories return (``factory(tokenizer)``)."""

    def instructions(self, tools: list[ChatTool]) -> str:
        """How to call the tools, written into the system message when the chat template
        does not render ``tools`` itself."""
        ...

    def format_calls(self, calls: list[ToolCall]) -> str:
        """An assistant's earlier calls as the model writes them (for such templates too)."""
        ...

    def parse(self, text: str) -> ParsedTools: ...

    def stream(self) -> ToolCallStream: ...


class ReasoningSplit(BaseModel):
    """An answer split into its reasoning and its final content (either may be None)."""

    reasoning: str | None = None
    content: str | None = None


class ReasoningDelta(BaseModel):
    kind: Literal["reasoning", "content"]
    text: str


class ReasoningStream(Protocol):
    def feed(self, text: str) -> list[ReasoningDelta]: ...

    def end(self) -> list[ReasoningDelta]: ...


class ReasoningParser(Protocol):
    """What ``register_reasoning_parsers`` factories return (``factory(tokenizer)``)."""

    def split(self, text: str) -> ReasoningSplit: ...

    def stream(self) -> ReasoningStream: ...


def held_back(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` could be the start of ``tag`` (held back
    while streaming until the next delta says)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
