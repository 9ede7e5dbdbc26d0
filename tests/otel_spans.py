"""OpenTelemetry for tests: an in-memory exporter behind the process's tracer provider, and
an OTLP/HTTP receiver on 127.0.0.1.

OpenTelemetry lets a process set its global tracer provider once, so every test module that
reads spans shares this one; ``span_exporter()`` clears it before handing it out. baton's
tracer sends its spans to the global provider when one is set and no OTLP endpoint is
configured (``observability.tracing = true``), as it would in an instrumented application.
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry import trace
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

_EXPORTER: InMemorySpanExporter | None = None


class _Gate(SimpleSpanProcessor):
    """Exports only while a test records, so that the tests after this one (FastAPI makes
    spans of its own under a global provider) leave nothing behind."""

    open = False

    def on_end(self, span: ReadableSpan) -> None:
        if _Gate.open:
            super().on_end(span)


def span_exporter() -> InMemorySpanExporter:
    """The exporter behind the global tracer provider (set on first use), emptied and
    recording until ``stop_recording()``."""
    global _EXPORTER
    if _EXPORTER is None:
        exporter = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(_Gate(exporter))
        trace.set_tracer_provider(provider)
        assert trace.get_tracer_provider() is provider, "another global tracer provider was set"
        _EXPORTER = exporter
    _EXPORTER.clear()
    _Gate.open = True
    return _EXPORTER


def stop_recording() -> None:
    """Drop the spans that end from now on, and those recorded."""
    _Gate.open = False
    if _EXPORTER is not None:
        _EXPORTER.clear()


class OtlpReceiver:
    """A minimal OTLP/HTTP trace receiver on 127.0.0.1 (protobuf POSTs to /v1/traces).

    ``spans()`` lists what arrived as (service name, span) pairs, spans as the protobuf
    ``Span`` messages of opentelemetry-proto.
    """

    def __init__(self) -> None:
        self.requests: list[ExportTraceServiceRequest] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                receiver.requests.append(ExportTraceServiceRequest.FromString(body))
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200 if self.path == "/v1/traces" else 404)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/v1/traces"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> OtlpReceiver:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def spans(self) -> list[tuple[str, Any]]:
        out = []
        for request in self.requests:
            for rs in request.resource_spans:
                attrs = {a.key: a.value.string_value for a in rs.resource.attributes}
                for ss in rs.scope_spans:
                    out.extend((attrs.get("service.name", ""), s) for s in ss.spans)
        return out
