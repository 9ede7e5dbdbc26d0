"""The OpenTelemetry request tracer: one ``llm_request`` span per finished request.

Imported only when tracing is on (``baton.metrics.tracing.make_tracer``). Attribute names are
vLLM's (the gen_ai.* semantic conventions and its ``gen_ai.latency.*`` additions), so
dashboards made for vLLM's traces read baton's.
"""

from __future__ import annotations

import os
import time
from typing import Any

from opentelemetry import context, propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from opentelemetry.trace import SpanKind, Status, StatusCode

from baton import __version__
from baton.errors import ConfigError
from baton.metrics.tracing import RequestTrace

SPAN_NAME = "llm_request"
SERVICE_NAME = "baton"
#: Finish reasons whose span has an error status.
ERROR_REASONS = frozenset({"abort", "error"})
EXPORTERS = ("otlp", "console", "none")
PROTOCOLS = ("grpc", "http/protobuf")


class OtelTracer:
    """A RequestTracer on an OpenTelemetry tracer; owns its provider when it made one."""

    def __init__(
        self, tracer: trace.Tracer, model: str, provider: TracerProvider | None = None
    ) -> None:
        self._tracer = tracer
        self._model = model
        self._provider = provider
        self._closed = False

    @classmethod
    def create(cls, endpoint: str | None, model: str) -> OtelTracer:
        """The application's tracer provider when it set one and no ``endpoint``
        (observability.otlp_traces_endpoint) is configured, else a provider of baton's own
        with the exporters the OTEL_* variables name; spans name ``model``."""
        current = trace.get_tracer_provider()
        if endpoint is None and not isinstance(current, trace.ProxyTracerProvider):
            return cls(current.get_tracer("baton", __version__), model)
        provider = TracerProvider(resource=service_resource())
        for exporter in span_exporters(endpoint):
            provider.add_span_processor(BatchSpanProcessor(exporter))
        return cls(provider.get_tracer("baton", __version__), model, provider)

    def parent(self, headers: dict[str, str] | None) -> context.Context | None:
        """The trace ``headers`` name (W3C traceparent), else the caller's current context
        (its current span, if any: an instrumented application's)."""
        if headers:
            ctx = propagate.extract(headers)
            if trace.get_current_span(ctx).get_span_context().is_valid:
                return ctx
        current = context.get_current()
        return current if trace.get_current_span(current).get_span_context().is_valid else None

    def finished(self, t: RequestTrace) -> None:
        """Record ``t`` as a span from its arrival to its end, a child of its trace headers."""
        offset = time.time() - time.monotonic()  # monotonic seconds -> epoch seconds

        def ns(seconds: float) -> int:
            return int((seconds + offset) * 1e9)

        end = max(t.finished_time, t.arrival_time)
        first_token = _within(t.first_token_time, t.arrival_time, end)
        # the engine's clock: kept between arrival and the first token (one clock on one host)
        scheduled = _within(t.first_scheduled_time, t.arrival_time, first_token or end)
        queued = _within(t.queued_time, t.arrival_time, scheduled or end)
        span = self._tracer.start_span(
            SPAN_NAME,
            context=t.parent,
            kind=SpanKind.SERVER,
            start_time=ns(t.arrival_time),
            attributes=self._attributes(t, end, scheduled, first_token),
        )
        for name, at in (
            ("queued", queued),
            ("scheduled", scheduled),
            ("first_token", first_token),
        ):
            if at is not None:
                span.add_event(name, timestamp=ns(at))
        if t.finish_reason in ERROR_REASONS:
            span.set_status(Status(StatusCode.ERROR, t.error or f"finish reason {t.finish_reason}"))
        span.end(end_time=ns(end))

    def _attributes(
        self, t: RequestTrace, end: float, scheduled: float | None, first_token: float | None
    ) -> dict[str, Any]:
        last_token = t.last_token_time
        queue = (
            t.first_scheduled_time - t.queued_time
            if t.first_scheduled_time is not None and t.queued_time is not None
            else None
        )
        attrs: dict[str, Any] = {
            "gen_ai.request.id": t.request_id,
            "gen_ai.response.model": self._model,
            "gen_ai.request.max_tokens": t.max_tokens,
            "gen_ai.request.temperature": t.temperature,
            "gen_ai.request.top_p": t.top_p,
            "gen_ai.request.n": t.n,
            "gen_ai.usage.prompt_tokens": t.prompt_tokens,
            "gen_ai.usage.completion_tokens": t.completion_tokens,
            "gen_ai.response.finish_reasons": (t.finish_reason,),
            "gen_ai.latency.time_in_queue": queue,
            "gen_ai.latency.time_to_first_token": _span(t.arrival_time, first_token),
            "gen_ai.latency.e2e": end - t.arrival_time,
            "gen_ai.latency.time_in_model_prefill": _span(scheduled, first_token),
            "gen_ai.latency.time_in_model_decode": _span(first_token, last_token),
            "gen_ai.latency.time_in_model_inference": _span(scheduled, last_token),
            "baton.request.index": t.index if t.n > 1 else None,
            "baton.request.num_preemptions": t.num_preemptions,
            "error.type": t.error.split(":", 1)[0] if t.error else None,
        }
        return {k: v for k, v in attrs.items() if v is not None}

    def shutdown(self) -> None:
        """Flush and stop baton's own provider; an application's provider is only flushed."""
        if self._closed:
            return
        self._closed = True
        if self._provider is not None:
            self._provider.shutdown()
            return
        flush = getattr(trace.get_tracer_provider(), "force_flush", None)
        if flush is not None:
            flush()


def _within(t: float | None, low: float, high: float) -> float | None:
    return None if t is None else min(max(t, low), high)


def _span(start: float | None, end: float | None) -> float | None:
    return None if start is None or end is None else max(end - start, 0.0)


def service_resource() -> Resource:
    """The SDK's resource (OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES); service name baton
    when neither names one."""
    resource = Resource.create()
    if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
        resource = resource.merge(Resource({"service.name": SERVICE_NAME}))
    return resource


def span_exporters(endpoint: str | None) -> list[SpanExporter]:
    """The exporters OTEL_TRACES_EXPORTER names (otlp by default); OTLP alone to ``endpoint``."""
    if endpoint is not None:
        return [otlp_exporter(endpoint)]
    names = os.environ.get("OTEL_TRACES_EXPORTER", "otlp")
    out: list[SpanExporter] = []
    for name in (n.strip().lower() for n in names.split(",") if n.strip()):
        if name == "otlp":
            out.append(otlp_exporter(None))
        elif name == "console":
            out.append(ConsoleSpanExporter())
        elif name != "none":
            raise ConfigError(
                f"OTEL_TRACES_EXPORTER={names!r}: baton knows {', '.join(EXPORTERS)}; set one of "
                "them, or set the tracer provider in the application for any other exporter"
            )
    return out


def otlp_exporter(endpoint: str | None) -> SpanExporter:
    """An OTLP exporter over the protocol OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL names (grpc by
    default); ``endpoint`` None: the exporter reads the OTEL_* endpoint variables itself."""
    protocol = os.environ.get(
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    )
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    elif protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (  # type: ignore[assignment]
            OTLPSpanExporter,
        )
    else:
        raise ConfigError(
            f"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL / OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r}: "
            f"baton's exporter speaks {' or '.join(PROTOCOLS)}"
        )
    return OTLPSpanExporter(endpoint=endpoint)
