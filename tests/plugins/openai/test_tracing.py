"""OpenTelemetry tracing through `baton serve`: one ``llm_request`` span per request, read with
the SDK's in-memory exporter behind the process's tracer provider (the server runs in this
process), a child of the HTTP request's ``traceparent``."""

from __future__ import annotations

import argparse
from collections.abc import Iterator

import httpx
import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import SpanKind, StatusCode

from baton.config import BatonConfig
from baton.frontend.detokenizer import IncrementalDetokenizer
from baton_openai.cli import add_serve_arguments, serve_overrides
from tests.otel_spans import span_exporter, stop_recording

from .conftest import ServerThread, running_server, wait_for

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01"
MESSAGES = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(autouse=True)
def _record_only_in_the_test():
    yield
    stop_recording()


@pytest.fixture(scope="module")
def server(model_dir: str) -> Iterator[ServerThread]:
    span_exporter()  # the global provider is set before the server makes its tracer
    with running_server(model_dir, observability={"tracing": True}) as srv:
        yield srv


@pytest.fixture
def exporter():
    return span_exporter()


def _requests(exporter) -> list[ReadableSpan]:
    """baton's spans (FastAPI makes spans of its own under a global tracer provider)."""
    return [s for s in exporter.get_finished_spans() if s.name == "llm_request"]


def _one_span(exporter) -> ReadableSpan:
    wait_for(lambda: _requests(exporter), what="the request's span")
    spans = _requests(exporter)
    assert len(spans) == 1, [dict(s.attributes) for s in spans]
    return spans[0]


def _check_timings(span: ReadableSpan) -> None:
    a = span.attributes
    queue = a["gen_ai.latency.time_in_queue"]
    ttft = a["gen_ai.latency.time_to_first_token"]
    e2e = a["gen_ai.latency.e2e"]
    assert 0 <= queue <= ttft <= e2e
    assert 0 <= a["gen_ai.latency.time_in_model_prefill"] <= ttft
    assert 0 <= a["gen_ai.latency.time_in_model_decode"] <= e2e
    assert span.end_time - span.start_time == pytest.approx(e2e * 1e9, abs=1e6)
    times = {e.name: e.timestamp for e in span.events}
    assert list(times) == ["queued", "scheduled", "first_token"]
    assert span.start_time <= times["queued"] <= times["scheduled"] <= times["first_token"]
    assert times["first_token"] <= span.end_time


def test_chat_request_makes_one_span_child_of_its_traceparent(server, exporter):
    r = server.client().chat.completions.create(
        model=server.model,
        messages=MESSAGES,
        max_tokens=6,
        temperature=0.5,
        top_p=0.9,
        extra_body={"ignore_eos": True},
        extra_headers={"traceparent": TRACEPARENT, "x-request-id": "trace-me"},
    )
    span = _one_span(exporter)
    assert span.kind == SpanKind.SERVER
    assert span.status.status_code == StatusCode.UNSET
    assert format(span.context.trace_id, "032x") == TRACE_ID
    assert span.parent is not None and span.parent.is_remote
    assert format(span.parent.span_id, "016x") == PARENT_SPAN_ID
    a = span.attributes
    assert a["gen_ai.request.id"].startswith("chatcmpl-trace-me-")
    assert a["gen_ai.request.id"] == r.id
    assert a["gen_ai.response.model"] == server.model
    assert a["gen_ai.request.max_tokens"] == 6
    assert a["gen_ai.request.temperature"] == pytest.approx(0.5)
    assert a["gen_ai.request.top_p"] == pytest.approx(0.9)
    assert a["gen_ai.usage.prompt_tokens"] == r.usage.prompt_tokens
    assert a["gen_ai.usage.completion_tokens"] == r.usage.completion_tokens == 6
    assert a["gen_ai.response.finish_reasons"] == ("length",)
    _check_timings(span)


def test_streamed_chat_makes_one_span(server, exporter):
    stream = server.client().chat.completions.create(
        model=server.model,
        messages=MESSAGES,
        max_tokens=5,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    usage = [c.usage for c in stream if c.usage is not None][-1]
    span = _one_span(exporter)
    # no traceparent: the handler's current span is the parent (FastAPI's own, under a global
    # tracer provider), never a remote one
    assert span.parent is None or not span.parent.is_remote
    assert span.status.status_code == StatusCode.UNSET
    a = span.attributes
    assert a["gen_ai.usage.completion_tokens"] == usage.completion_tokens == 5
    assert a["gen_ai.usage.prompt_tokens"] == usage.prompt_tokens
    _check_timings(span)


def test_completion_request_joins_the_trace(server, exporter):
    server.client().completions.create(
        model=server.model,
        prompt="Once upon a time",
        max_tokens=3,
        extra_headers={"traceparent": TRACEPARENT},
    )
    span = _one_span(exporter)
    assert format(span.context.trace_id, "032x") == TRACE_ID
    assert span.attributes["gen_ai.request.max_tokens"] == 3


def test_embedding_inputs_make_one_span_each(server, exporter):
    r = httpx.post(
        f"{server.url}/v1/embeddings",
        json={"model": server.model, "input": ["red", "green light"]},
        headers={"traceparent": TRACEPARENT},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    wait_for(lambda: len(_requests(exporter)) == 2, what="two spans")
    spans = sorted(_requests(exporter), key=lambda s: s.attributes["gen_ai.request.id"])
    assert [s.attributes["gen_ai.request.id"][-2:] for s in spans] == ["-0", "-1"]
    for span in spans:
        assert format(span.context.trace_id, "032x") == TRACE_ID
        assert span.status.status_code == StatusCode.UNSET
        assert span.attributes["gen_ai.usage.completion_tokens"] == 0
        assert span.attributes["gen_ai.response.finish_reasons"] == ("stop",)
    assert (
        sum(s.attributes["gen_ai.usage.prompt_tokens"] for s in spans)
        == (r.json()["usage"]["prompt_tokens"])
    )


def test_client_that_goes_away_gets_an_error_span(server, exporter):
    stream = server.client().chat.completions.create(
        model=server.model,
        messages=MESSAGES,
        max_tokens=900,
        stream=True,
        extra_body={"ignore_eos": True},
        extra_headers={"traceparent": TRACEPARENT},
    )
    for i, _ in enumerate(stream):
        if i == 2:
            break
    stream.close()  # drops the connection mid-stream: the server aborts the request
    span = _one_span(exporter)
    assert span.status.status_code == StatusCode.ERROR
    assert span.attributes["gen_ai.response.finish_reasons"] == ("abort",)
    assert 0 < span.attributes["gen_ai.usage.completion_tokens"] < 900
    assert format(span.context.trace_id, "032x") == TRACE_ID


def test_failed_request_gets_an_error_span(server, exporter, monkeypatch):
    def faulty(self, new_token_ids):
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected detokenizer fault")

    monkeypatch.setattr(IncrementalDetokenizer, "update", faulty)
    r = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={"model": server.model, "messages": MESSAGES, "max_tokens": 4},
        timeout=60,
    )
    assert r.status_code >= 500, r.text
    span = _one_span(exporter)
    assert span.status.status_code == StatusCode.ERROR
    assert "injected detokenizer fault" in span.status.description
    assert span.attributes["error.type"] == "UnicodeDecodeError"
    assert span.attributes["gen_ai.response.finish_reasons"] == ("error",)


def test_serve_flag_sets_the_otlp_endpoint():
    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    args = p.parse_args(["--otlp-traces-endpoint", "http://127.0.0.1:4317"])
    config = BatonConfig.load(**serve_overrides(args))
    assert config.observability.otlp_traces_endpoint == "http://127.0.0.1:4317"
