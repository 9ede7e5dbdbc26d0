"""The child process that renders client-supplied chat templates, one at a time.

Started by templates/sandbox.py as ``python -m baton_openai.templates.worker
<address-space-limit-bytes> <max-output-chars>``. It imports only jinja2 (no
baton, no transformers), so it starts in a fraction of a second and a
replacement is cheap. Templates render in Jinja's immutable sandbox with the
names transformers' ``apply_chat_template`` gives them (raise_exception,
tojson, strftime_now, dict, namespace, the loopcontrols and ``generation``
tags, the tokenizer's special tokens as variables); the parent kills the
process when a render runs past its deadline, and the address-space limit
turns a template that builds huge strings into a MemoryError instead of a
machine-wide out-of-memory.

Frames on stdin/stdout: an 8-byte big-endian length, then ASCII JSON. The first
frame out is ``{"ready": true}``; then one reply per request:
``{"text": ...}`` or ``{"error": ...}``.
"""

from __future__ import annotations

import json
import os
import resource
import struct
import sys
from datetime import datetime
from functools import lru_cache
from typing import Any, BinaryIO

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

HEADER = struct.Struct(">Q")
#: Names a message's reasoning is passed under; templates read the first (as transformers aliases them).
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
#: An error message quoting a huge value is cut here.
MAX_ERROR_CHARS = 2000


def read_frame(stream: BinaryIO) -> Any | None:
    """The next JSON frame, or None at end of input."""
    head = stream.read(HEADER.size)
    if len(head) < HEADER.size:
        return None
    (size,) = HEADER.unpack(head)
    body = stream.read(size)
    if len(body) < size:
        return None
    return json.loads(body)


def write_frame(stream: BinaryIO, value: Any) -> None:
    body = json.dumps(value, ensure_ascii=True).encode(
        "ascii"
    )  # lone surrogates survive as escapes
    stream.write(HEADER.pack(len(body)) + body)
    stream.flush()


class _Generation(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (assistant-mask markers): rendered as their body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return str(caller())


class _TemplateDict:
    """``dict(...)`` for templates without dict's class attributes (as in transformers)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """``namespace(...)`` refusing underscore names, which lead to Python internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # self in args: namespace(self=...) works
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"a chat template may not store underscore attribute {name!r} on a namespace"
            )


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: Any = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # not jinja's own tojson, which HTML-escapes: templates expect plain JSON (as transformers does)
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _Namespace
    return env.from_string(source)


def render(
    template: str,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
    variables: dict[str, Any],
) -> str:
    """What ``apply_chat_template(..., tokenize=False)`` renders for one conversation."""
    chat = []
    for message in messages:
        # transformers drops None values (content=None breaks many templates) and aliases reasoning
        m = {k: v for k, v in message.items() if v is not None}
        reasoning = next((m[k] for k in REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        chat.append(m)
    variables = dict(variables)
    tools = variables.pop("tools", None)
    documents = variables.pop("documents", None)
    return compile_template(template).render(
        messages=chat,
        tools=tools,
        documents=documents,
        add_generation_prompt=add_generation_prompt,
        **variables,
    )


def serve(inp: BinaryIO, out: BinaryIO, max_output_chars: int) -> None:
    write_frame(out, {"ready": True})
    while (request := read_frame(inp)) is not None:
        try:
            text = render(
                request["template"],
                request["messages"],
                request["add_generation_prompt"],
                request["variables"],
            )
            if len(text) > max_output_chars:
                reply = {
                    "error": f"the rendered chat has {len(text)} characters, more than "
                    f"server.max_request_bytes ({max_output_chars}) allows"
                }
            else:
                reply = {"text": text}
        except MemoryError:
            reply = {"error": "the chat template ran out of memory"}
        except RecursionError:
            reply = {"error": "the chat template recursed too deeply"}
        except Exception as e:  # any template failure is the client's: report it, keep serving
            reply = {"error": f"{type(e).__name__}: {str(e)[:MAX_ERROR_CHARS]}"}
        write_frame(out, reply)


def main(argv: list[str]) -> int:
    memory_limit, max_output_chars = int(argv[1]), int(argv[2])
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard == resource.RLIM_INFINITY or memory_limit < hard:
        resource.setrlimit(resource.RLIMIT_AS, (memory_limit, hard))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    # the frames own fd 1; anything else that prints goes to stderr instead of corrupting them
    frames = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    serve(sys.stdin.buffer, frames, max_output_chars)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
