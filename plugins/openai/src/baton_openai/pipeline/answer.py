"""One chat choice's answer text, read by the reasoning parser, then the tool-call parser.

The reasoning parser (``server.reasoning_parser``) takes the raw text first; what
it leaves as content goes to the tool plan (tools.py). Without either, the text is
the content, unchanged.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from pydantic import BaseModel

from baton_openai.parsing.types import (
    CallArguments,
    CallStart,
    ContentDelta,
    ReasoningParser,
    ReasoningStream,
    ToolCall,
    ToolCallStream,
    ToolEvent,
    ToolParser,
)
from baton_openai.pipeline.tools import ToolPlan
from baton_openai.protocol.openai import (
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    ToolCallItem,
)


class ParsedAnswer(BaseModel):
    content: str | None = None
    reasoning: str | None = None
    calls: list[ToolCall] = []


class AnswerDelta(BaseModel):
    """What one step adds: text, reasoning, and tool-call deltas in order (a call's name,
    then its argument fragments, each its own delta)."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[DeltaToolCall] = []


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_call_items(calls: list[ToolCall]) -> list[ToolCallItem]:
    return [
        ToolCallItem(id=call_id(), function=FunctionCall(name=c.name, arguments=c.arguments))
        for c in calls
    ]


@dataclass(frozen=True)
class AnswerReader:
    """How the answers of one request are read."""

    plan: ToolPlan | None
    tool_parser: ToolParser
    reasoning: ReasoningParser | None

    @property
    def active(self) -> bool:
        return self.plan is not None or self.reasoning is not None

    def parse(self, text: str) -> ParsedAnswer:
        reasoning = None
        content: str | None = text
        if self.reasoning is not None:
            split = self.reasoning.split(text)
            reasoning, content = split.reasoning, split.content
        if self.plan is None:
            return ParsedAnswer(content=content, reasoning=reasoning)
        parsed = self.plan.parse(self.tool_parser, content or "")
        return ParsedAnswer(content=parsed.content, reasoning=reasoning, calls=parsed.calls)

    def stream(self) -> AnswerStream:
        return AnswerStream(
            self.reasoning.stream() if self.reasoning is not None else None,
            self.plan.stream(self.tool_parser) if self.plan is not None else None,
        )


@dataclass
class AnswerStream:
    """One choice's answer, delta by delta; tool calls get their index and id here."""

    reasoning: ReasoningStream | None
    tools: ToolCallStream | None
    calls: int = 0
    _ended: bool = field(default=False, repr=False)

    def feed(self, text: str) -> AnswerDelta:
        return self._step(text, last=False)

    def step(self, text: str, last: bool) -> AnswerDelta:
        """``feed(text)``, then with ``last`` what ``end()`` adds."""
        d = self.feed(text)
        if last:
            end = self.end()
            d.content += end.content
            d.reasoning += end.reasoning
            d.tool_calls += end.tool_calls
        return d

    def end(self) -> AnswerDelta:
        if self._ended:
            return AnswerDelta()
        self._ended = True
        return self._step("", last=True)

    def _step(self, text: str, last: bool) -> AnswerDelta:
        out = AnswerDelta()
        pieces: list[str] = []
        if self.reasoning is None:
            pieces = [text] if text else []
        else:
            events = self.reasoning.feed(text) if text else []
            if last:
                events += self.reasoning.end()
            for e in events:
                if e.kind == "reasoning":
                    out.reasoning += e.text
                else:
                    pieces.append(e.text)
        if self.tools is None:
            out.content = "".join(pieces)
            return out
        tool_events: list[ToolEvent] = []
        for piece in pieces:
            tool_events += self.tools.feed(piece)
        if last:
            tool_events += self.tools.end()
        for e in tool_events:
            self._add(out, e)
        return out

    def _add(self, out: AnswerDelta, e: ToolEvent) -> None:
        if isinstance(e, ContentDelta):
            out.content += e.text
        elif isinstance(e, CallStart):
            self.calls += 1
            out.tool_calls.append(
                DeltaToolCall(
                    index=self.calls - 1,
                    id=call_id(),
                    type="function",
                    function=DeltaFunctionCall(name=e.name, arguments=""),
                )
            )
        elif isinstance(e, CallArguments) and self.calls and e.text:
            last = out.tool_calls[-1] if out.tool_calls else None
            if last is not None and last.index == self.calls - 1 and last.id is None:
                last.function.arguments = (last.function.arguments or "") + e.text
            else:
                out.tool_calls.append(
                    DeltaToolCall(
                        index=self.calls - 1, function=DeltaFunctionCall(arguments=e.text)
                    )
                )
