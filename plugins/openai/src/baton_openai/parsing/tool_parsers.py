"""The built-in tool-call parsers: ``hermes`` and ``json``.

- ``hermes`` (Hermes, Qwen2.5/3, SmolLM2): each call is
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (a JSON list of such
  objects inside one tag is read too); text outside the tags is the content. A tag
  whose body is not a call stays in the content. Streamed, text before a tag goes out
  at once and each call as soon as its closing tag arrives.
- ``json``: the whole answer is one ``{"name", "arguments"}`` object or a list of
  them; any other answer is content. Streamed, an answer that starts with ``{`` or
  ``[`` is held until it ends, any other streams as content.

``arguments`` may also be spelt ``parameters``; an object is written back as JSON
text, a string is kept as it is.
"""

from __future__ import annotations

import json
import re
from typing import Any

from baton_openai.parsing.types import (
    CallArguments,
    CallStart,
    ContentDelta,
    ParsedTools,
    ToolCall,
    ToolCallStream,
    ToolEvent,
    ToolParser,
    held_back,
)
from baton_openai.protocol.openai import ChatTool


def calls_from_json(value: Any) -> list[ToolCall] | None:
    """The calls a decoded JSON value holds (an object or a list of them), or None."""
    items = value if isinstance(value, list) else [value]
    if not items:
        return None
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        args = item.get("arguments", item.get("parameters", {}))
        if isinstance(args, str):
            text = args
        elif isinstance(args, dict):
            text = json.dumps(args, ensure_ascii=False)
        else:
            return None
        calls.append(ToolCall(name=item["name"], arguments=text))
    return calls


def parse_calls(text: str) -> list[ToolCall] | None:
    """``calls_from_json`` of ``text``; None when it is not JSON."""
    try:
        return calls_from_json(json.loads(text))
    except ValueError:
        return None


def call_events(calls: list[ToolCall]) -> list[ToolEvent]:
    out: list[ToolEvent] = []
    for c in calls:
        out += [CallStart(name=c.name), CallArguments(text=c.arguments)]
    return out


def tools_json(tools: list[ChatTool]) -> str:
    return "\n".join(t.model_dump_json(exclude_none=True) for t in tools)


class BufferedToolCallStream:
    """A stream for any parser: holds the whole answer and parses it at the end."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text: list[str] = []

    def feed(self, text: str) -> list[ToolEvent]:
        self.text.append(text)
        return []

    def end(self) -> list[ToolEvent]:
        parsed = self.parser.parse("".join(self.text))
        out: list[ToolEvent] = [ContentDelta(text=parsed.content)] if parsed.content else []
        return out + call_events(parsed.calls)


class HermesToolParser:
    """``<tool_call>{json}</tool_call>`` calls (see the module docstring)."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    _BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.S)

    def __init__(self, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer

    def instructions(self, tools: list[ChatTool]) -> str:
        return (
            "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{tools_json(tools)}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments "
            "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
        )

    def format_calls(self, calls: list[ToolCall]) -> str:
        return "\n".join(
            f'{self.OPEN}\n{{"name": {json.dumps(c.name)}, "arguments": {c.arguments}}}\n'
            f"{self.CLOSE}"
            for c in calls
        )

    def parse(self, text: str) -> ParsedTools:
        calls: list[ToolCall] = []
        kept: list[str] = []
        last = 0
        for m in self._BLOCK.finditer(text):
            found = parse_calls(m.group(1).strip())
            if found is None:
                continue  # not a call: the tag stays in the content
            kept.append(text[last : m.start()])
            last = m.end()
            calls += found
        kept.append(text[last:])
        content = "".join(kept).strip() if calls else text
        return ParsedTools(content=content or None, calls=calls)

    def stream(self) -> ToolCallStream:
        return _HermesStream()


class _HermesStream:
    def __init__(self) -> None:
        self.buf = ""
        self.inside = False
        self.calls = 0

    def feed(self, text: str) -> list[ToolEvent]:
        self.buf += text
        out: list[ToolEvent] = []
        while True:
            if not self.inside:
                i = self.buf.find(HermesToolParser.OPEN)
                if i < 0:
                    keep = held_back(self.buf, HermesToolParser.OPEN)
                    self._content(out, self.buf[: len(self.buf) - keep])
                    self.buf = self.buf[len(self.buf) - keep :]
                    return out
                self._content(out, self.buf[:i])
                self.buf = self.buf[i + len(HermesToolParser.OPEN) :]
                self.inside = True
            j = self.buf.find(HermesToolParser.CLOSE)
            if j < 0:
                return out
            self._block(out, self.buf[:j], closed=True)
            self.buf = self.buf[j + len(HermesToolParser.CLOSE) :]
            self.inside = False

    def end(self) -> list[ToolEvent]:
        out: list[ToolEvent] = []
        if self.inside:
            self._block(out, self.buf, closed=False)
        else:
            self._content(out, self.buf)
        self.buf = ""
        return out

    def _content(self, out: list[ToolEvent], text: str) -> None:
        # between and after calls only text that is not blank is content (as parse() strips)
        if text and (self.calls == 0 or text.strip()):
            out.append(ContentDelta(text=text))

    def _block(self, out: list[ToolEvent], body: str, closed: bool) -> None:
        calls = parse_calls(body.strip())
        if calls is None:
            close = HermesToolParser.CLOSE if closed else ""
            out.append(ContentDelta(text=f"{HermesToolParser.OPEN}{body}{close}"))
            return
        self.calls += len(calls)
        out += call_events(calls)


class JsonToolParser:
    """The whole answer is a ``{"name", "arguments"}`` object or a list of them."""

    def __init__(self, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer

    def instructions(self, tools: list[ChatTool]) -> str:
        return (
            "# Tools\n\nYou can call these functions:\n"
            f"{tools_json(tools)}\n\n"
            "To call functions, answer with only a JSON object "
            '{"name": <function-name>, "arguments": <args-json-object>}, or a JSON list of '
            "such objects, and nothing else."
        )

    def format_calls(self, calls: list[ToolCall]) -> str:
        items = [f'{{"name": {json.dumps(c.name)}, "arguments": {c.arguments}}}' for c in calls]
        return items[0] if len(items) == 1 else "[" + ", ".join(items) + "]"

    def parse(self, text: str) -> ParsedTools:
        calls = parse_calls(text.strip())
        if calls is None:
            return ParsedTools(content=text or None)
        return ParsedTools(calls=calls)

    def stream(self) -> ToolCallStream:
        return _JsonStream(self)


class _JsonStream:
    def __init__(self, parser: JsonToolParser) -> None:
        self.parser = parser
        self.buf = ""
        self.mode: str | None = None  # None: undecided, "json": held, "text": streamed

    def feed(self, text: str) -> list[ToolEvent]:
        if self.mode == "text":
            return [ContentDelta(text=text)] if text else []
        self.buf += text
        if self.mode is None:
            head = self.buf.lstrip()
            if not head:
                return []
            self.mode = "json" if head[0] in "{[" else "text"
            if self.mode == "text":
                out, self.buf = self.buf, ""
                return [ContentDelta(text=out)]
        return []

    def end(self) -> list[ToolEvent]:
        text, self.buf = self.buf, ""
        if not text:
            return []
        parsed = self.parser.parse(text)
        if parsed.calls:
            return call_events(parsed.calls)
        return [ContentDelta(text=text)]
