"""Request bodies decoded in pieces (baton_openai.http.json_body) give what json.loads gives.

Tiny pieces make every path run on small documents: values that fit, arrays and
objects walked into, runs cut between elements and inside them; mutated documents
must fail exactly when json.loads fails.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from baton_openai.http.json_body import decode_json, decode_steps

JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False)
    | st.text(st.characters(codec="utf-8"), max_size=12),
    lambda children: (
        st.lists(children, max_size=12) | st.dictionaries(st.text(max_size=6), children, max_size=8)
    ),
    max_leaves=60,
)
LAYOUTS = [
    {},
    {"separators": (",", ":")},
    {"indent": 1},
    {"ensure_ascii": False},
]


def steps_of(body: str | bytes, piece: int) -> tuple[Any, int]:
    """(the decoded value, how many steps it took)."""
    steps, n = decode_steps(body, piece), 0
    try:
        while True:
            next(steps)
            n += 1
    except StopIteration as done:
        return done.value[0], n


def outcome(decode: Any, text: str) -> tuple[str, Any]:
    try:
        return "ok", decode(text)
    except (ValueError, RecursionError) as e:
        return "error", type(e).__name__


@settings(max_examples=300, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(value=JSON, layout=st.sampled_from(LAYOUTS), piece=st.sampled_from([1, 4, 16, 64]))
def test_same_value_as_json_loads(value, layout, piece):
    text = json.dumps(value, **layout)
    assert steps_of(text, piece)[0] == json.loads(text)
    assert steps_of(text.encode(), piece)[0] == json.loads(text.encode())


@settings(max_examples=400, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    value=JSON,
    layout=st.sampled_from(LAYOUTS),
    piece=st.sampled_from([1, 4, 16]),
    at=st.floats(0, 1),
    edit=st.sampled_from(["delete", ",", "]", "}", '"', ":", "[", "{", "1", " "]),
)
def test_a_broken_document_fails_as_json_loads_fails(value, layout, piece, at, edit):
    text = json.dumps(value, **layout)
    i = int(at * len(text))
    broken = text[:i] + text[i + 1 :] if edit == "delete" else text[:i] + edit + text[i:]
    ours = outcome(lambda t: steps_of(t, piece)[0], broken)
    assert ours == outcome(json.loads, broken), broken


@pytest.mark.parametrize(
    "text",
    ["", " ", "[", "[1,]", "{,}", '{"a" 1}', '{"a":1,}', "[1 2]", "1 2", "\ufeff[1]", "[NaN]"],
)
def test_edge_cases_match(text):
    assert outcome(lambda t: steps_of(t, 1)[0], text) == outcome(json.loads, text)


def test_a_large_body_is_decoded_in_short_steps():
    """1.2M token ids (7.6 MiB): json.loads is one call of ~0.1-0.2 s; here no step is long."""
    body = json.dumps({"prompt": [i % 30000 for i in range(1_200_000)], "max_tokens": 1}).encode()
    steps, longest = decode_steps(body), 0.0
    try:
        while True:
            t0 = time.perf_counter()
            next(steps)
            longest = max(longest, time.perf_counter() - t0)
    except StopIteration as done:
        assert done.value[0] == json.loads(body)
    assert longest < 0.03, longest


def test_decode_json_yields_to_the_event_loop():
    body = json.dumps({"messages": [{"role": "user", "content": "x"}] * 100_000}).encode()
    ticks = 0

    async def main() -> Any:
        async def tick() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0)
                ticks += 1

        ticker = asyncio.create_task(tick())
        try:
            return await decode_json(body)
        finally:
            ticker.cancel()

    assert asyncio.run(main()) == json.loads(body)
    assert ticks > 10
