"""The tool-call and reasoning parsers (no server): streamed equals whole, however the text is cut;
the parser registry and its hooks (register_tool_parsers, register_reasoning_parsers), found
through a real entry point."""

from __future__ import annotations

import json
import re
import textwrap
import types
from pathlib import Path

import pytest

from baton.errors import ConfigError
from baton_openai.hookspecs import hookimpl
from baton_openai.parsing.reasoning import ThinkReasoningParser
from baton_openai.parsing.registry import ParserRegistry
from baton_openai.parsing.tool_parsers import HermesToolParser, JsonToolParser
from baton_openai.parsing.types import CallArguments, CallStart, ContentDelta
from baton_openai.pipeline.answer import AnswerReader

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def cuts(text: str) -> list[list[str]]:
    """The text whole, one character at a time, and in pieces of 3 and 7."""
    out = [[text], list(text)]
    for n in (3, 7):
        out.append([text[i : i + n] for i in range(0, len(text), n)])
    return out


def streamed(parser, pieces: list[str]) -> tuple[str, list[tuple[str, str]]]:
    s = parser.stream()
    events = [e for p in pieces for e in s.feed(p)] + s.end()
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    calls: list[tuple[str, str]] = []
    for e in events:
        if isinstance(e, CallStart):
            calls.append((e.name, ""))
        elif isinstance(e, CallArguments):
            calls[-1] = (calls[-1][0], calls[-1][1] + e.text)
    return content, calls


@pytest.mark.parametrize(
    "text, content, calls",
    [
        (CALL, None, [("get_weather", {"city": "Paris"})]),
        (f"Let me look.\n{CALL}", "Let me look.", [("get_weather", {"city": "Paris"})]),
        (
            f"{CALL}\n{CALL.replace('Paris', 'Rome')}",
            None,
            [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})],
        ),
        # SmolLM2's own form: a list inside one tag; "parameters" for "arguments"
        (
            '<tool_call>[{"name": "a", "parameters": {}}, {"name": "b", "arguments": {"x": 1}}]'
            "</tool_call>",
            None,
            [("a", {}), ("b", {"x": 1})],
        ),
        ("no calls here, < tool_call > neither", "no calls here, < tool_call > neither", []),
        ("<tool_call>not json</tool_call> tail", "<tool_call>not json</tool_call> tail", []),
        # cut by max_tokens before the closing tag: still a call when its JSON is whole
        ('<tool_call>{"name": "f", "arguments": {}}', None, [("f", {})]),
    ],
)
def test_hermes_parse_and_stream_agree(text, content, calls):
    parser = HermesToolParser()
    parsed = parser.parse(text)
    assert parsed.content == content
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == calls
    for pieces in cuts(text):
        got_content, got_calls = streamed(parser, pieces)
        assert (got_content.strip() or None) == content, pieces
        assert [(n, json.loads(a)) for n, a in got_calls] == calls


def test_hermes_stream_sends_content_before_the_call_arrives():
    s = HermesToolParser().stream()
    assert s.feed("Checking") == [ContentDelta(text="Checking")]
    assert s.feed(" now <tool") == [ContentDelta(text=" now ")]  # "<tool" held back
    assert s.feed('_call>{"name": "f", ') == []
    events = s.feed('"arguments": {}}</tool_call>')
    assert events == [CallStart(name="f"), CallArguments(text="{}")]


@pytest.mark.parametrize(
    "text, content, calls",
    [
        ('{"name": "f", "arguments": {"a": [1, 2]}}', None, [("f", {"a": [1, 2]})]),
        (
            ' [{"name": "f", "arguments": {}}, {"name": "g", "arguments": "{}"}]',
            None,
            [("f", {}), ("g", {})],
        ),
        ("plain words", "plain words", []),
        ('{"not": "a call"}', '{"not": "a call"}', []),
    ],
)
def test_json_parse_and_stream_agree(text, content, calls):
    parser = JsonToolParser()
    parsed = parser.parse(text)
    assert parsed.content == content
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == calls
    for pieces in cuts(text):
        got_content, got_calls = streamed(parser, pieces)
        assert (got_content or None) == content
        assert [(n, json.loads(a)) for n, a in got_calls] == calls


@pytest.mark.parametrize(
    "text, reasoning, content",
    [
        ("<think>step one\nstep two</think>\n\nThe answer.", "step one\nstep two", "The answer."),
        ("\n<think>only thinking, cut short", "only thinking, cut short", None),
        ("No thinking here.", None, "No thinking here."),
        ("<thin>not the tag</thin>", None, "<thin>not the tag</thin>"),
        ("<think></think>Quick.", "", "Quick."),
    ],
)
def test_think_split_and_stream_agree(text, reasoning, content):
    parser = ThinkReasoningParser()
    split = parser.split(text)
    assert (split.reasoning, split.content) == (reasoning, content)
    for pieces in cuts(text):
        s = parser.stream()
        events = [e for p in pieces for e in s.feed(p)] + s.end()
        got_r = "".join(e.text for e in events if e.kind == "reasoning")
        got_c = "".join(e.text for e in events if e.kind == "content")
        assert got_r == (reasoning or "") and (got_c or None) == content, pieces


def test_reasoning_then_tool_calls_in_one_answer():
    reader = AnswerReader(
        plan=None, tool_parser=HermesToolParser(), reasoning=ThinkReasoningParser()
    )
    parsed = reader.parse(f"<think>need weather</think>{CALL}")
    assert parsed.reasoning == "need weather" and parsed.calls == []  # no tool plan: no parse
    assert parsed.content == CALL


class _Upper:
    """A parser whose calls are lines 'CALL name {json}'."""

    def instructions(self, tools):
        return "Write CALL <name> <json>."

    def format_calls(self, calls):
        return "\n".join(f"CALL {c.name} {c.arguments}" for c in calls)

    def parse(self, text):
        from baton_openai.parsing.types import ParsedTools, ToolCall

        calls = [
            ToolCall(name=line.split()[1], arguments=line.split(maxsplit=2)[2])
            for line in text.splitlines()
            if line.startswith("CALL ")
        ]
        rest = "\n".join(line for line in text.splitlines() if not line.startswith("CALL "))
        return ParsedTools(content=rest or None, calls=calls)

    def stream(self):
        from baton_openai.parsing.tool_parsers import BufferedToolCallStream

        return BufferedToolCallStream(self)


class _Plugin:
    @hookimpl
    def register_tool_parsers(self, register):
        register("upper", lambda tokenizer: _Upper())

    @hookimpl
    def register_reasoning_parsers(self, register):
        register("none-at-all", lambda tokenizer: ThinkReasoningParser(tokenizer))


def test_hook_register_tool_parsers():
    registry = ParserRegistry.load(extra=[_Plugin()], autoload=False)
    assert registry.names("tool") == ["hermes", "json", "upper"]
    parser = registry.tool_parser("upper")
    parsed = parser.parse('hi\nCALL f {"a": 1}')
    assert parsed.content == "hi" and parsed.calls[0].name == "f"
    _, calls = streamed(parser, ["hi\nCALL f ", '{"a": 1}'])
    assert calls == [("f", '{"a": 1}')]
    with pytest.raises(ConfigError, match="no such tool parser; installed: hermes, json, upper"):
        registry.check("nope", None)


def test_hook_register_reasoning_parsers():
    registry = ParserRegistry.load(extra=[_Plugin()], autoload=False)
    assert registry.names("reasoning") == ["none-at-all", "think"]
    assert registry.reasoning_parser(None) is None
    assert registry.reasoning_parser("none-at-all").split("<think>a</think>b").content == "b"
    with pytest.raises(ConfigError, match=r"server\.reasoning_parser = 'x'"):
        registry.check("hermes", "x")


def test_a_name_registered_twice_names_both_distributions():
    class Again:
        @hookimpl
        def register_tool_parsers(self, register):
            register("hermes", HermesToolParser)

    with pytest.raises(ConfigError, match="'hermes' is registered by both"):
        ParserRegistry.load(extra=[Again()], autoload=False)


def write_parser_distribution(root) -> None:
    """A distribution 'baton-parsers-demo' on ``root`` whose entry point registers 'upper'."""
    (root / "demo_parsers.py").write_text(
        textwrap.dedent(
            """
            from baton_openai.hookspecs import hookimpl
            from baton_openai.parsing.types import ParsedTools, ToolCall
            from baton_openai.parsing.tool_parsers import BufferedToolCallStream


            class Upper:
                def instructions(self, tools):
                    return "Write CALL <name> <json>."

                def format_calls(self, calls):
                    return "\\n".join(f"CALL {c.name} {c.arguments}" for c in calls)

                def parse(self, text):
                    calls, rest = [], []
                    for line in text.splitlines():
                        if line.startswith("CALL "):
                            _, name, args = line.split(" ", 2)
                            calls.append(ToolCall(name=name, arguments=args))
                        else:
                            rest.append(line)
                    return ParsedTools(content="\\n".join(rest) or None, calls=calls)

                def stream(self):
                    return BufferedToolCallStream(self)


            @hookimpl
            def register_tool_parsers(register):
                register("upper", lambda tokenizer: Upper())
            """
        )
    )
    info = root / "baton_parsers_demo-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: baton-parsers-demo\nVersion: 0.1\n"
    )
    (info / "entry_points.txt").write_text("[baton_openai]\ndemo = demo_parsers\n")


def test_parsers_are_found_through_the_entry_point_group(tmp_path, monkeypatch):
    write_parser_distribution(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    registry = ParserRegistry.load(autoload=True)
    assert "upper" in registry.names("tool")
    assert registry.entries["tool"]["upper"].distribution == "baton-parsers-demo"
    assert "upper" not in ParserRegistry.load(autoload=False).names("tool")


def docs_examples() -> list[types.ModuleType]:
    """The python examples of docs/hooks.md's baton-plugin-openai section, as modules."""
    text = (Path(__file__).parents[3] / "docs" / "hooks.md").read_text()
    section = text.split("## Hooks of baton-plugin-openai", 1)[1]
    modules = []
    for i, code in enumerate(re.findall(r"^```python\n(.*?)^```", section, re.S | re.M)):
        module = types.ModuleType(f"baton_openai_docs_example_{i}")
        exec(compile(code, f"docs/hooks.md:openai-{i}", "exec"), module.__dict__)
        modules.append(module)
    return modules


def test_hooks_md_parser_examples_run():
    tool_example, reasoning_example = docs_examples()
    registry = ParserRegistry.load(extra=[tool_example, reasoning_example], autoload=False)
    lines = registry.tool_parser("lines")
    parsed = lines.parse('Sure.\nCALL get_weather {"city": "Paris"}')
    assert parsed.content == "Sure." and parsed.calls[0].name == "get_weather"
    _, calls = streamed(lines, ["Sure.\nCALL get_", 'weather {"city": "Paris"}'])
    assert calls == [("get_weather", '{"city": "Paris"}')]
    analysis = registry.reasoning_parser("analysis")
    assert analysis.split("think a bit\nFINAL: 42").model_dump() == {
        "reasoning": "think a bit",
        "content": "42",
    }
    s = analysis.stream()
    events = s.feed("x FINAL") + s.feed(": y") + s.end()
    assert [(e.kind, e.text) for e in events] == [("reasoning", "x"), ("content", "y")]
