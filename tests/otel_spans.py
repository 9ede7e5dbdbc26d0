"""An in-memory OpenTelemetry exporter behind the process's tracer provider (tests only).

OpenTelemetry lets a process set its global tracer provider once, so every test module that
reads spans shares this one; ``span_exporter()`` clears it before handing it out. baton's
tracer sends its spans to the global provider when one is set and no OTLP endpoint is
configured (``observability.tracing = true``), as it would in an instrumented application.
"""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

_EXPORTER: InMemorySpanExporter | None = None


def span_exporter() -> InMemorySpanExporter:
    """The exporter behind the global tracer provider (set on first use), emptied."""
    global _EXPORTER
    if _EXPORTER is None:
        exporter = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        trace.set_tracer_provider(provider)
        assert trace.get_tracer_provider() is provider, "another global tracer provider was set"
        _EXPORTER = exporter
    _EXPORTER.clear()
    return _EXPORTER
