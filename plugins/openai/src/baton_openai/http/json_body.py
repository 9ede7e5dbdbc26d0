"""JSON request bodies decoded in pieces, the event loop running between them.

``json.loads`` of an 8 MiB body is one C call that holds the GIL for 0.1-0.2 s
(1.2M token ids: 0.18 s here), so the event loop, and /health, stop that long for
every such body; a thread does not help, it holds the same GIL. Here a large body
is decoded by the same C decoder in pieces of about ``PIECE`` characters: a value
that fits in a piece is decoded at once, a larger array or object is walked into,
its elements decoded in runs of about ``PIECE`` characters cut at a comma. The
result equals ``json.loads``'s (a run cut anywhere but between two elements is not
valid JSON, so it fails and is decoded element by element instead); so do the
errors' types.

One large body is decoded at a time (a lane per event loop), pausing for SLICE_S
after every ``SLICE_S`` seconds of work: however many arrive, the loop runs other
work every few milliseconds, and other threads get the GIL at least half the time.
Bodies up to ``PIECE`` bytes, nearly all, are decoded at once.
"""

from __future__ import annotations

import asyncio
import codecs
import json
import time
import weakref
from collections.abc import Callable, Generator
from json.decoder import scanstring
from typing import Any, TypeVar

from fastapi import Request, Response
from fastapi.routing import APIRoute

#: Characters decoded by one C call, about (~0.7 ms of dense token ids); a body up to this
#: size is decoded in one call.
PIECE = 32 * 1024
#: Bytes turned into text by one call.
TEXT_PIECE = 1024 * 1024
#: Seconds of decoding between two yields to the event loop.
SLICE_S = 0.002

_WS = " \t\n\r"
_SCAN = json.scanner.make_scanner(json.JSONDecoder())  # type: ignore[attr-defined]
_CLOSER = {"[": "]", "{": "}"}
_lanes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Lock] = (
    weakref.WeakKeyDictionary()
)

#: A decoding step: yields between pieces, returns (value, index after it).
Steps = Generator[None, None, tuple[Any, int]]
T = TypeVar("T")


async def decode_json(body: bytes | str, piece: int = PIECE) -> Any:
    """``json.loads(body)``; a body over ``piece`` is decoded in the loop's lane, in steps."""
    if len(body) <= piece:
        return json.loads(body)
    async with _lane():
        value, _ = await run_steps(decode_steps(body, piece))
        return value


async def run_steps(steps: Generator[None, None, T]) -> T:
    """Run ``steps`` to the end, pausing for SLICE_S after each SLICE_S of them."""
    started = time.perf_counter()
    try:
        while True:
            next(steps)
            if time.perf_counter() - started >= SLICE_S:
                # a pause, not just a turn: the loop sleeps in select, without the GIL, so
                # other threads (the engine's, tokenizers) are not kept waiting for it
                await asyncio.sleep(SLICE_S)
                started = time.perf_counter()
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]


def _lane() -> asyncio.Lock:
    """The running loop's lock for large bodies (asyncio.Lock wakes its waiters in order)."""
    loop = asyncio.get_running_loop()
    lock = _lanes.get(loop)
    if lock is None:
        lock = _lanes[loop] = asyncio.Lock()
    return lock


def decode_steps(body: bytes | str, piece: int = PIECE) -> Steps:
    """The decoding as steps (a generator): returns ``(json.loads(body), len)``."""
    s = body if isinstance(body, str) else (yield from _text(body))
    if s.startswith("\ufeff"):
        raise json.JSONDecodeError("Unexpected UTF-8 BOM (decode using utf-8-sig)", s, 0)
    value, end = yield from _value(s, _skip(s, 0), piece)
    if _skip(s, end) != len(s):
        raise json.JSONDecodeError("Extra data", s, _skip(s, end))
    return value, len(s)


def _text(body: bytes | bytearray) -> Generator[None, None, str]:
    """``body`` as json.loads decodes it (UTF-8, or UTF-16/32 told by their zero bytes)."""
    decoder = codecs.getincrementaldecoder(json.detect_encoding(body))("surrogatepass")
    view, parts = memoryview(body), []
    for i in range(0, len(body), TEXT_PIECE):
        parts.append(decoder.decode(view[i : i + TEXT_PIECE], final=i + TEXT_PIECE >= len(body)))
        yield
    return "".join(parts)


def _skip(s: str, i: int) -> int:
    while i < len(s) and s[i] in _WS:
        i += 1
    return i


def _scan(s: str, i: int) -> tuple[Any, int]:
    """The value at ``s[i]`` by the C scanner (strings and numbers: linear, cheap)."""
    try:
        return _SCAN(s, i)
    except StopIteration as e:
        raise json.JSONDecodeError("Expecting value", s, e.value) from None


def _fits(s: str, i: int, width: int) -> tuple[Any, int] | None:
    """The array or object at ``s[i]`` if it ends within ``width`` characters, else None.

    A container cut short is never valid JSON, so success means it is all there; a
    failure for any other reason is found again (and raised) by the walk.
    """
    try:
        value, end = _SCAN(s[i : i + width], 0)
    except (StopIteration, ValueError, RecursionError):
        return None
    return value, i + end


def _value(s: str, i: int, piece: int) -> Steps:
    if i >= len(s) or s[i] not in _CLOSER:
        return _scan(s, i)
    for width in (min(256, piece), piece):  # most are small: do not copy a piece for each
        if (found := _fits(s, i, width)) is not None:
            yield
            return found
    return (yield from _container(s, i, piece))


def _container(s: str, i: int, piece: int) -> Steps:
    """The array or object at ``s[i]``, larger than a piece: its elements in runs, or one by one."""
    is_array = s[i] == "["
    out: Any = [] if is_array else {}
    closer = _CLOSER[s[i]]
    j = _skip(s, i + 1)
    if j < len(s) and s[j] == closer:
        return out, j + 1
    separator = ","  # what ends the elements seen so far, e.g. "}," (fewer false cuts)
    runs_from = j  # after a failed run, elements one by one up to here
    backoff = 0
    while True:
        if j >= runs_from:
            run = _run(s, j, closer, separator, piece)
            if run is not None:
                part, cut = run
                out.extend(part) if is_array else out.update(part)
                yield
                if s[cut] == closer:
                    return out, cut + 1
                backoff = 0
                j = _skip(s, cut + 1)
                continue
            backoff = max(piece, 2 * backoff)
            runs_from = j + backoff
        j = yield from _element(s, j, out, piece)
        end = _skip(s, j)
        if end < len(s) and s[end] == closer:
            return out, end + 1
        if end >= len(s) or s[end] != ",":
            raise json.JSONDecodeError("Expecting ',' delimiter", s, end)
        separator = s[j - 1 : j + 1] if j == end and s[j - 1] in '}]"' else ","
        j = _skip(s, end + 1)


def _run(s: str, j: int, closer: str, separator: str, piece: int) -> tuple[Any, int] | None:
    """Elements from ``s[j]`` decoded at once: up to the container's closer if it comes within
    a piece, else up to the first separator a piece on. (Them, the index of the closer or
    comma), or None when neither cut falls between two elements (or after the last)."""
    reach = j + 2 * piece + len(separator)
    cuts = []
    at = s.find(separator, j + piece, reach)
    close = s.find(closer, j + 1, reach)
    if close >= 0 and (at < 0 or close < at):
        cuts.append(close)
    if at >= 0:
        cuts.append(at + len(separator) - 1)
    for cut in cuts:
        text = s[j:cut]  # starts at an element (s[j] is not blank), so never empty
        try:
            return json.loads(f"[{text}]" if closer == "]" else f"{{{text}}}"), cut
        except (ValueError, RecursionError):
            continue
    return None


def _element(s: str, j: int, out: Any, piece: int) -> Generator[None, None, int]:
    """Decode one element (an array item, or an object's ``"key": value``) into ``out``."""
    if isinstance(out, list):
        value, end = yield from _value(s, j, piece)
        out.append(value)
        return end
    if j >= len(s) or s[j] != '"':
        raise json.JSONDecodeError("Expecting property name enclosed in double quotes", s, j)
    key, end = scanstring(s, j + 1)
    end = _skip(s, end)
    if end >= len(s) or s[end] != ":":
        raise json.JSONDecodeError("Expecting ':' delimiter", s, end)
    value, end = yield from _value(s, _skip(s, end + 1), piece)
    out[key] = value
    return end


class PiecewiseJSONRequest(Request):
    """A request whose JSON body is decoded by ``decode_json``.

    What a large body decoded to is freed at once when the request ends (1.2M ints:
    ~15 ms of the loop, once per body), which is short enough not to need pieces.
    """

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = await decode_json(await self.body())
        return self._json


class PiecewiseJSONRoute(APIRoute):
    """A route whose JSON body is decoded in pieces (see the module docstring)."""

    def get_route_handler(self) -> Callable[[Request], Any]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            return await handler(PiecewiseJSONRequest(request.scope, request.receive))

        return route
