"""A client that goes away aborts its request in the engine: counted as an abort, its KV blocks freed."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from .conftest import metric, wait_for

MESSAGES = [{"role": "user", "content": "Tell me a very long story."}]
LONG = 900  # far more tokens than the test waits for


def _engine_idle(server) -> bool:
    stats = server.call(server.server.engine.get_stats())
    return (
        stats.num_running_reqs == 0
        and stats.num_waiting_reqs == 0
        and stats.num_free_blocks == stats.num_total_blocks
    )


def test_disconnect_mid_stream_aborts_the_request(server, client):
    before = server.metrics()
    stream = client.chat.completions.create(
        model=server.model,
        messages=MESSAGES,
        max_tokens=LONG,
        stream=True,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    received = 0
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            received += 1
            if received == 3:
                break
    stream.close()  # drops the connection mid-stream

    def aborted() -> bool:
        m = server.metrics()
        return (
            metric(m, "baton_request_success_total", finished_reason="abort")
            - metric(before, "baton_request_success_total", finished_reason="abort")
            == 1
        )

    wait_for(aborted, what="the abort in /metrics")
    wait_for(lambda: _engine_idle(server), what="the engine to free the request's KV blocks")
    after = server.metrics()
    generated = metric(after, "baton_generation_tokens_total") - metric(
        before, "baton_generation_tokens_total"
    )
    assert 3 <= generated < LONG  # stopped early, not run to completion
    assert metric(after, "baton_num_requests_running") == 0
    assert metric(after, "baton_kv_cache_usage_perc") == 0
    assert metric(after, "baton_request_success_total", finished_reason="length") == metric(
        before, "baton_request_success_total", finished_reason="length"
    )
    assert server.call(server.server.engine.engine.call_utility_async("list_requests")) == []


def test_disconnect_while_waiting_for_a_non_streaming_answer_aborts_it(server):
    before = server.metrics()
    body = {
        "model": server.model,
        "messages": MESSAGES,
        "max_tokens": LONG,
        "ignore_eos": True,
        "temperature": 0,
    }

    def running() -> bool:
        return bool(server.call(server.server.engine.engine.call_utility_async("list_requests")))

    async def give_up_early() -> None:
        # the client gives up once the engine runs the request (not after a timer, which a
        # fast enough engine beats)
        async with httpx.AsyncClient(base_url=server.url) as http:
            post = asyncio.ensure_future(http.post("/v1/chat/completions", json=body, timeout=60))
            while not running():
                assert not post.done(), "the request ended before the engine ran it"
                await asyncio.sleep(0.005)
            assert not post.done(), "the request finished before the client gave up"
            post.cancel()
            with pytest.raises(asyncio.CancelledError):
                await post

    asyncio.run(give_up_early())
    wait_for(
        lambda: (
            metric(server.metrics(), "baton_request_success_total", finished_reason="abort")
            - metric(before, "baton_request_success_total", finished_reason="abort")
            == 1
        ),
        what="the abort",
    )
    wait_for(lambda: _engine_idle(server), what="the engine to free the request's KV blocks")


def test_disconnect_of_one_n2_stream_aborts_both_choices(server, client):
    before = server.metrics()
    stream = client.chat.completions.create(
        model=server.model,
        messages=MESSAGES,
        max_tokens=LONG,
        stream=True,
        n=2,
        extra_body={"ignore_eos": True},
    )
    for i, _ in enumerate(stream):
        if i == 4:
            break
    stream.close()
    wait_for(
        lambda: (
            metric(server.metrics(), "baton_request_success_total", finished_reason="abort")
            - metric(before, "baton_request_success_total", finished_reason="abort")
            == 2
        ),
        what="two aborts",
    )
    wait_for(lambda: _engine_idle(server), what="the engine to free the KV blocks")


#: /v1/responses and /v1/messages streams of a long answer (a regex makes it long whatever
#: the model, as ignore_eos does for chat above), and the event that carries its text
AGENT_STREAMS = {
    "/v1/responses": (
        {"input": "Tell me a story.", "max_output_tokens": LONG},
        "output_text.delta",
    ),
    "/v1/messages": (
        {"messages": MESSAGES, "max_tokens": LONG},
        "content_block_delta",
    ),
}


@pytest.mark.parametrize("path", sorted(AGENT_STREAMS))
def test_disconnect_mid_stream_on_the_agent_apis_aborts_the_request(server, path):
    before = server.metrics()
    fields, text_event = AGENT_STREAMS[path]
    body = {
        "model": server.model,
        "stream": True,
        "temperature": 0,
        "structured_outputs": {"regex": "(ab ){400}"},
        **fields,
    }
    received = 0
    with httpx.stream("POST", f"{server.url}{path}", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("event:") and text_event in line:
                received += 1
                if received == 3:
                    break  # leaving the block drops the connection mid-stream

    def aborted() -> bool:
        m = server.metrics()
        return (
            metric(m, "baton_request_success_total", finished_reason="abort")
            - metric(before, "baton_request_success_total", finished_reason="abort")
            == 1
        )

    wait_for(aborted, what="the abort in /metrics")
    wait_for(lambda: _engine_idle(server), what="the engine to free the request's KV blocks")
    generated = metric(server.metrics(), "baton_generation_tokens_total") - metric(
        before, "baton_generation_tokens_total"
    )
    assert 3 <= generated < LONG
