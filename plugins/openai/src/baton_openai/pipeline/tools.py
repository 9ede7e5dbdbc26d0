"""A chat request's ``tools`` and ``tool_choice``: what the template gets, what constrains the
answer, how the answer is read.

- ``none`` (or no tools): the tools are not shown to the model, the answer is content.
- ``auto`` (the default with tools): the tools go to the chat template and the
  answer is read by the server's tool-call parser (``server.tool_call_parser``).
- ``required``: the answer is constrained by the structured-output backend to a
  JSON list of ``{"name", "arguments"}`` objects, each ``arguments`` valid against
  its function's ``parameters`` schema (one call with ``parallel_tool_calls=false``).
- a named function: the answer is constrained to that function's arguments.

A chat template that does not render ``tools`` itself (its source never names
them, as SmolLM2's) gets them in the system message instead, written as the
parser asks (``ToolParser.instructions``), and an assistant's earlier
``tool_calls`` written into its content (``ToolParser.format_calls``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from baton.sampling_params import StructuredOutputSpec
from baton_openai.http.errors import OpenAIError
from baton_openai.parsing.tool_parsers import calls_from_json
from baton_openai.parsing.types import (
    CallArguments,
    CallStart,
    ParsedTools,
    ToolCall,
    ToolCallStream,
    ToolEvent,
    ToolParser,
)
from baton_openai.protocol.openai import ChatCompletionRequest, ChatTool

#: The legacy function-calling fields, refused (they would otherwise be ignored).
LEGACY_FIELDS = ("functions", "function_call")


@dataclass(frozen=True)
class ToolPlan:
    mode: Literal["auto", "required", "named"]
    tools: list[ChatTool]
    name: str | None
    parallel: bool

    def spec(self) -> StructuredOutputSpec | None:
        """The constraint on the answer (required and named), None for auto."""
        if self.mode == "named":
            fn = next(t.function for t in self.tools if t.function.name == self.name)
            return StructuredOutputSpec(json=_parameters(fn.parameters))
        if self.mode == "required":
            schema: dict[str, Any] = {
                "type": "array",
                "minItems": 1,
                "items": {"anyOf": [_call_schema(t) for t in self.tools]},
            }
            if not self.parallel:
                schema["maxItems"] = 1
            return StructuredOutputSpec(json=schema)
        return None

    def template_tools(self) -> list[dict[str, Any]]:
        """The tools as chat templates read them (OpenAI's shape, as dicts)."""
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def parse(self, parser: ToolParser, text: str) -> ParsedTools:
        if self.mode == "auto":
            parsed = parser.parse(text)
        elif self.mode == "named":
            parsed = _named(self.name or "", text)
        else:
            parsed = _required(text)
        if not self.parallel and len(parsed.calls) > 1:
            parsed = ParsedTools(content=parsed.content, calls=parsed.calls[:1])
        return parsed

    def stream(self, parser: ToolParser) -> ToolCallStream:
        if self.mode == "auto":
            inner = parser.stream()
        elif self.mode == "named":
            inner = _NamedStream(self.name or "")
        else:
            inner = _RequiredStream()
        return inner if self.parallel else _FirstCallOnly(inner)


def plan_tools(req: ChatCompletionRequest) -> ToolPlan | None:
    """The request's tool plan (None: no tools in play); a 400 naming the field at fault."""
    extra = req.model_extra or {}
    for name in LEGACY_FIELDS:
        if name in extra:
            raise OpenAIError(
                f"{name} (the legacy function-calling API) is not supported: use tools and "
                "tool_choice",
                param=name,
                code="unsupported_parameter",
            )
    choice = req.tool_choice
    if not req.tools:
        if choice is not None and choice != "none":
            raise OpenAIError(
                "tool_choice needs tools: give the functions the model may call",
                param="tool_choice",
                code="invalid_value",
            )
        return None
    names = [t.function.name for t in req.tools]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise OpenAIError(
            f"two tools are named {dup!r}: function names must be unique",
            param="tools",
            code="invalid_value",
        )
    if choice == "none":
        return None
    if choice is None or choice == "auto":
        return ToolPlan("auto", req.tools, None, req.parallel_tool_calls)
    if choice == "required":
        return ToolPlan("required", req.tools, None, req.parallel_tool_calls)
    assert not isinstance(choice, str)
    name = choice.function.name
    if name not in names:
        raise OpenAIError(
            f"tool_choice names the function {name!r}, which is not among the tools "
            f"({', '.join(map(repr, names))})",
            param="tool_choice",
            code="invalid_value",
        )
    return ToolPlan("named", req.tools, name, req.parallel_tool_calls)


def template_renders_tools(template: Any) -> bool:
    """Whether a chat template's source names ``tools`` (a dict of named templates: any)."""
    if isinstance(template, dict):
        return any(template_renders_tools(t) for t in template.values())
    return isinstance(template, str) and "tools" in template


def with_tool_instructions(
    messages: list[dict[str, Any]], plan: ToolPlan, parser: ToolParser
) -> list[dict[str, Any]]:
    """Messages for a template that does not render tools: the parser's instructions in the
    system message (a new one first when there is none), earlier calls written as content."""
    out = [_calls_as_content(m, parser) for m in messages]
    note = parser.instructions(plan.tools)
    if out and out[0].get("role") == "system":
        first = out[0]
        text = first.get("content") or ""
        out[0] = {**first, "content": f"{text}\n\n{note}" if text else note}
    else:
        out.insert(0, {"role": "system", "content": note})
    return out


def _calls_as_content(message: dict[str, Any], parser: ToolParser) -> dict[str, Any]:
    calls = message.get("tool_calls")
    if not calls:
        return message
    parsed = []
    for call in calls if isinstance(calls, list) else [calls]:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise OpenAIError(
                "an assistant message's tool_calls must be [{'type': 'function', 'function': "
                "{'name', 'arguments'}}, ...]",
                param="messages",
                code="invalid_value",
            )
        args = fn.get("arguments", "{}")
        parsed.append(
            ToolCall(name=fn["name"], arguments=args if isinstance(args, str) else json.dumps(args))
        )
    text = message.get("content") or ""
    written = parser.format_calls(parsed)
    rest = {k: v for k, v in message.items() if k != "tool_calls"}
    return {**rest, "content": f"{text}\n{written}" if text else written}


def _parameters(schema: dict[str, Any] | None) -> dict[str, Any]:
    return schema if schema else {"type": "object"}


def _call_schema(tool: ChatTool) -> dict[str, Any]:
    fn = tool.function
    return {
        "type": "object",
        "properties": {
            "name": {"type": "string", "enum": [fn.name]},
            "arguments": _parameters(fn.parameters),
        },
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _named(name: str, text: str) -> ParsedTools:
    try:
        json.loads(text)
    except ValueError:  # cut short (max_tokens): not a call
        return ParsedTools(content=text or None)
    return ParsedTools(calls=[ToolCall(name=name, arguments=text.strip())])


def _required(text: str) -> ParsedTools:
    try:
        calls = calls_from_json(json.loads(text))
    except ValueError:
        calls = None
    return ParsedTools(calls=calls) if calls else ParsedTools(content=text or None)


class _NamedStream:
    """The answer is the named function's arguments: each delta is a fragment of them."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.started = False

    def feed(self, text: str) -> list[ToolEvent]:
        out: list[ToolEvent] = []
        if not self.started:
            self.started = True
            out.append(CallStart(name=self.name))
        if text:
            out.append(CallArguments(text=text))
        return out

    def end(self) -> list[ToolEvent]:
        return [] if self.started else [CallStart(name=self.name), CallArguments(text="")]


class _RequiredStream:
    """The answer is a JSON list of calls: each call goes out as soon as its object is complete."""

    def __init__(self) -> None:
        self.buf = ""
        self.pos = 0
        self.decoder = json.JSONDecoder()

    def feed(self, text: str) -> list[ToolEvent]:
        self.buf += text
        out: list[ToolEvent] = []
        while True:
            while self.pos < len(self.buf) and self.buf[self.pos] in " \t\r\n[,":
                self.pos += 1
            if self.pos >= len(self.buf) or self.buf[self.pos] != "{":
                return out
            try:
                value, end = self.decoder.raw_decode(self.buf, self.pos)
            except ValueError:
                return out  # the object is not complete yet
            self.pos = end
            for call in calls_from_json(value) or []:
                out += [CallStart(name=call.name), CallArguments(text=call.arguments)]

    def end(self) -> list[ToolEvent]:
        return []


class _FirstCallOnly:
    """parallel_tool_calls=false: the events of the first call (and content) only."""

    def __init__(self, inner: ToolCallStream) -> None:
        self.inner = inner
        self.calls = 0

    def _keep(self, events: list[ToolEvent]) -> list[ToolEvent]:
        out = []
        for e in events:
            if isinstance(e, CallStart):
                self.calls += 1
            if self.calls <= 1 or not isinstance(e, CallStart | CallArguments):
                out.append(e)
        return out

    def feed(self, text: str) -> list[ToolEvent]:
        return self._keep(self.inner.feed(text))

    def end(self) -> list[ToolEvent]:
        return self._keep(self.inner.end())
