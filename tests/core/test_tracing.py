"""OpenTelemetry tracing in the frontend: one ``llm_request`` span per finished request.

The spans are read with the SDK's in-memory exporter (behind the process's tracer provider
for LLM, behind a provider of the test's own for the tracer alone). What must hold without
the packages, or with tracing off, runs in a fresh interpreter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
    OTLPSpanExporter as GrpcExporter,
)
from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
    OTLPSpanExporter as HttpExporter,
)
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
    InMemorySpanExporter,
)
from opentelemetry.trace import StatusCode

from baton import LLM, AsyncLLM, BatonConfig, SamplingParams
from baton.errors import ConfigError, EngineShuttingDownError
from baton.metrics.otel import OtelTracer, service_resource, span_exporters
from baton.metrics.tracing import RequestTrace, make_tracer, pick_trace_headers
from baton.testing.tiny_model import tiny_model
from tests.otel_spans import OtlpReceiver, span_exporter, stop_recording

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
TRACEPARENT = f"00-{TRACE_ID}-b7ad6b7169203331-01"


@pytest.fixture(autouse=True)
def _record_only_in_the_test():
    yield
    stop_recording()


@pytest.fixture(scope="module")
def traced_llm():
    span_exporter()  # the global provider, set before the LLM makes its tracer
    llm = LLM(model=str(tiny_model("llama")), observability={"tracing": True})
    yield llm
    llm.shutdown()


def test_llm_spans_join_the_callers_trace_one_per_sequence(traced_llm):
    exporter = span_exporter()
    params = SamplingParams(max_tokens=4, n=2, temperature=0.7, ignore_eos=True)
    (out,) = traced_llm.generate(
        ["hello there"], params, use_tqdm=False, trace_headers={"TraceParent": TRACEPARENT}
    )
    spans = sorted(exporter.get_finished_spans(), key=lambda s: s.attributes["baton.request.index"])
    assert [s.name for s in spans] == ["llm_request", "llm_request"]
    for i, span in enumerate(spans):
        a = span.attributes
        assert format(span.context.trace_id, "032x") == TRACE_ID
        assert a["gen_ai.request.id"] == out.request_id
        assert a["gen_ai.request.n"] == 2 and a["baton.request.index"] == i
        assert a["gen_ai.request.temperature"] == pytest.approx(0.7)
        assert a["gen_ai.usage.prompt_tokens"] == len(out.prompt_token_ids)
        assert a["gen_ai.usage.completion_tokens"] == len(out.outputs[i].token_ids) == 4
        assert span.status.status_code == StatusCode.UNSET
        queue, ttft = a["gen_ai.latency.time_in_queue"], a["gen_ai.latency.time_to_first_token"]
        assert 0 <= queue <= ttft <= a["gen_ai.latency.e2e"]
        assert a["gen_ai.latency.time_in_model_inference"] == pytest.approx(
            a["gen_ai.latency.time_in_model_prefill"] + a["gen_ai.latency.time_in_model_decode"]
        )


def test_without_trace_headers_the_span_is_a_root(traced_llm):
    exporter = span_exporter()
    traced_llm.generate("hi", SamplingParams(max_tokens=2), use_tqdm=False)
    (span,) = exporter.get_finished_spans()
    assert span.parent is None


def test_the_callers_current_span_is_the_parent(traced_llm):
    exporter = span_exporter()
    with trace.get_tracer("app").start_as_current_span("evaluation") as job:
        traced_llm.generate("hi", SamplingParams(max_tokens=2), use_tqdm=False)
    request, evaluation = exporter.get_finished_spans()
    assert (request.name, evaluation.name) == ("llm_request", "evaluation")
    assert request.parent.span_id == job.get_span_context().span_id
    assert request.context.trace_id == job.get_span_context().trace_id


async def test_requests_cut_off_by_shutdown_get_error_spans():
    exporter = span_exporter()
    llm = await AsyncLLM.create(model=str(tiny_model("llama")), observability={"tracing": True})
    params = SamplingParams(max_tokens=500, ignore_eos=True)
    stream = llm.generate("hi", params, request_id="cut-off")
    await stream.__anext__()  # running
    llm.shutdown()
    with pytest.raises(EngineShuttingDownError):
        async for _ in stream:
            pass
    (span,) = exporter.get_finished_spans()
    assert span.attributes["gen_ai.request.id"] == "cut-off"
    assert span.status.status_code == StatusCode.ERROR
    assert span.attributes["error.type"] == "EngineShuttingDownError"
    assert 0 < span.attributes["gen_ai.usage.completion_tokens"] < 500


def _memory_tracer() -> tuple[OtelTracer, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return OtelTracer(provider.get_tracer("test"), "m", provider), exporter


def test_failed_request_span_has_error_status_and_type():
    tracer, exporter = _memory_tracer()
    t0 = time.monotonic()
    tracer.finished(
        RequestTrace(
            request_id="r1",
            finish_reason="error",
            error="RuntimeError: the grammar failed",
            prompt_tokens=3,
            completion_tokens=1,
            arrival_time=t0,
            queued_time=t0 + 0.01,
            first_scheduled_time=t0 + 0.02,
            first_token_time=t0 + 0.05,
            last_token_time=t0 + 0.05,
            finished_time=t0 + 0.06,
        )
    )
    (span,) = exporter.get_finished_spans()
    assert span.status.status_code == StatusCode.ERROR
    assert span.status.description == "RuntimeError: the grammar failed"
    assert span.attributes["error.type"] == "RuntimeError"
    assert span.attributes["gen_ai.latency.time_in_queue"] == pytest.approx(0.01)
    assert span.attributes["gen_ai.latency.time_in_model_prefill"] == pytest.approx(0.03)
    assert span.end_time - span.start_time == pytest.approx(0.06e9, abs=1e3)


def test_request_aborted_while_queued_has_no_token_timings():
    tracer, exporter = _memory_tracer()
    t0 = time.monotonic()
    tracer.finished(
        RequestTrace(
            request_id="r2",
            finish_reason="abort",
            prompt_tokens=3,
            completion_tokens=0,
            arrival_time=t0,
            queued_time=t0 - 5.0,  # another clock: kept within the span
            finished_time=t0 + 0.5,
        )
    )
    (span,) = exporter.get_finished_spans()
    assert span.status.status_code == StatusCode.ERROR
    assert span.status.description == "finish reason abort"
    a = span.attributes
    assert "gen_ai.latency.time_to_first_token" not in a
    assert "gen_ai.latency.time_in_queue" not in a  # never scheduled
    assert a["gen_ai.latency.e2e"] == pytest.approx(0.5)
    assert [(e.name, e.timestamp) for e in span.events] == [("queued", span.start_time)]


def test_pick_trace_headers_keeps_trace_context_only():
    headers = {"TraceParent": TRACEPARENT, "tracestate": "a=1", "authorization": "secret"}
    assert pick_trace_headers(headers) == {"traceparent": TRACEPARENT, "tracestate": "a=1"}
    assert pick_trace_headers({"content-type": "application/json"}) is None
    assert pick_trace_headers(None) is None


def test_exporters_from_the_otel_variables(monkeypatch):
    for name in ("OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console, none")
    assert [type(e) for e in span_exporters(None)] == [ConsoleSpanExporter]
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://127.0.0.1:9/v1/traces")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    (http,) = span_exporters(None)
    assert isinstance(http, HttpExporter) and http._endpoint == "http://127.0.0.1:9/v1/traces"
    # an endpoint in the config: OTLP there, whatever OTEL_TRACES_EXPORTER says
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")
    assert [type(e) for e in span_exporters("http://127.0.0.1:9")] == [GrpcExporter]
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "zipkin")
    with pytest.raises(ConfigError, match=r"OTEL_TRACES_EXPORTER=.zipkin.*otlp, console, none"):
        span_exporters(None)
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/json")
    with pytest.raises(ConfigError, match=r"'http/json'.*grpc or http/protobuf"):
        span_exporters(None)


def test_service_name_from_otel_service_name(monkeypatch):
    monkeypatch.delenv("OTEL_RESOURCE_ATTRIBUTES", raising=False)
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    assert service_resource().attributes["service.name"] == "baton"
    monkeypatch.setenv("OTEL_SERVICE_NAME", "my-llm")
    assert service_resource().attributes["service.name"] == "my-llm"


def test_configured_endpoint_gets_a_provider_of_its_own():
    span_exporter()  # a global provider is set: the configured endpoint still wins
    config = BatonConfig.load(observability={"otlp_traces_endpoint": "http://127.0.0.1:9"})
    tracer = make_tracer(config.observability, config.served_model_name)
    assert isinstance(tracer, OtelTracer) and tracer._provider is not None
    tracer.shutdown()  # nothing buffered: sends nothing
    assert make_tracer(BatonConfig.load().observability, "m") is None


def _run_fresh(script: str, **env: str) -> dict:
    """Run ``script`` in a fresh interpreter (``env`` added to this one's); it prints one
    JSON line last."""
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, **env},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_tracing_off_imports_no_opentelemetry():
    result = _run_fresh(
        """
        import json, sys
        from baton import LLM, SamplingParams
        from baton.testing.tiny_model import tiny_model
        llm = LLM(model=str(tiny_model("llama")))
        llm.generate("hi", SamplingParams(max_tokens=2), use_tqdm=False,
                     trace_headers={"traceparent": "00-%s-%s-01" % ("1" * 32, "2" * 16)})
        llm.shutdown()
        print(json.dumps({"otel": sorted(m for m in sys.modules if m.startswith("opentelemetry"))}))
        """
    )
    assert result == {"otel": []}


def test_tracing_without_the_packages_is_a_clear_config_error():
    result = _run_fresh(
        """
        import json, sys
        sys.modules["opentelemetry"] = None  # as if baton-core[otel] were not installed
        from baton import LLM
        from baton.errors import ConfigError
        from baton.testing.tiny_model import tiny_model
        try:
            LLM(model=str(tiny_model("llama")), observability={"tracing": True})
        except ConfigError as e:
            print(json.dumps({"error": str(e)}))
        """
    )
    assert "pip install 'baton-core[otel]'" in result["error"]
    assert "observability.tracing" in result["error"]


def test_spans_reach_the_otlp_endpoint_in_the_config(monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    monkeypatch.delenv("OTEL_RESOURCE_ATTRIBUTES", raising=False)
    with OtlpReceiver() as receiver:
        llm = LLM(
            model=str(tiny_model("llama")),
            observability={"otlp_traces_endpoint": receiver.url},
        )
        llm.generate(
            "hi",
            SamplingParams(max_tokens=3),
            use_tqdm=False,
            trace_headers={"traceparent": TRACEPARENT},
        )
        llm.shutdown()  # flushes the batch processor: the span is posted before it returns
        ((service, span),) = receiver.spans()
    assert (service, span.name) == ("baton", "llm_request")
    assert span.trace_id.hex() == TRACE_ID
    attrs = {a.key: a.value for a in span.attributes}
    assert attrs["gen_ai.usage.completion_tokens"].int_value == 3


def test_otel_variables_pick_the_exporter_endpoint_and_service():
    with OtlpReceiver() as receiver:
        _run_fresh(
            """
            import json
            from baton import LLM, SamplingParams
            from baton.testing.tiny_model import tiny_model
            llm = LLM(model=str(tiny_model("llama")), observability={"tracing": True})
            llm.generate(["a", "b"], SamplingParams(max_tokens=2), use_tqdm=False)
            llm.shutdown()
            print(json.dumps({}))
            """,
            OTEL_TRACES_EXPORTER="otlp",
            OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=receiver.url,
            OTEL_EXPORTER_OTLP_TRACES_PROTOCOL="http/protobuf",
            OTEL_SERVICE_NAME="svc-from-env",
        )
        spans = receiver.spans()
    assert [(service, span.name) for service, span in spans] == [
        ("svc-from-env", "llm_request")
    ] * 2
