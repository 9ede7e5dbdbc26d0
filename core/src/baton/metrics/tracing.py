"""The request-tracing seam: what a finished request's span is made of, and the tracer's maker.

This module never imports opentelemetry: with tracing off (``observability.tracing`` false
and no ``observability.otlp_traces_endpoint``) ``make_tracer`` returns None and the output
processor only tests for it. The OpenTelemetry tracer lives in ``baton.metrics.otel``,
imported when tracing is on (``pip install 'baton-core[otel]'``).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

import msgspec

from baton.errors import ConfigError

if TYPE_CHECKING:
    from baton.config import ObservabilitySection

#: The headers that carry a caller's trace context (W3C Trace Context), as vLLM forwards them.
TRACE_HEADERS = ("traceparent", "tracestate")
#: The distributions tracing needs (the ``otel`` extra of baton-core).
OTEL_MODULES = ("opentelemetry.sdk", "opentelemetry.exporter.otlp")
INSTALL_HINT = "pip install 'baton-core[otel]'"


class RequestTrace(msgspec.Struct, frozen=True, kw_only=True):
    """One finished request (one sequence of it when n > 1), as its span reports it.

    Times are ``time.monotonic()`` seconds: ``arrival_time``, ``first_token_time``,
    ``last_token_time`` and ``finished_time`` of the frontend; ``queued_time`` and
    ``first_scheduled_time`` of the engine process (the same clock on one host). ``parent``:
    what the tracer's ``parent`` returned when the request arrived.
    """

    request_id: str
    index: int = 0
    finish_reason: str
    error: str | None = None
    prompt_tokens: int
    completion_tokens: int
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    num_preemptions: int = 0
    arrival_time: float
    queued_time: float | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float
    parent: Any = None


class RequestTracer(Protocol):
    """Turns finished requests into spans."""

    def parent(self, headers: dict[str, str] | None) -> Any:
        """The parent of the span of a request arriving now: the trace its ``headers``
        (traceparent) name, else the caller's current span, else None (a root span)."""

    def finished(self, trace: RequestTrace) -> None:
        """Report one finished request (called on the frontend's output path: keep it cheap)."""

    def shutdown(self) -> None:
        """Send what is buffered; called once, when the LLM / AsyncLLM shuts down."""


def tracing_enabled(obs: ObservabilitySection) -> bool:
    """Whether the observability section asks for tracing."""
    return obs.tracing or obs.otlp_traces_endpoint is not None


def pick_trace_headers(headers: Mapping[str, str] | None) -> dict[str, str] | None:
    """The trace-context headers among ``headers`` (names in any case), or None when none."""
    if not headers:
        return None
    found = {k.lower(): v for k, v in headers.items() if k.lower() in TRACE_HEADERS}
    return found or None


def check_tracing(obs: ObservabilitySection) -> None:
    """Refuse tracing asked for (``obs``) when the OpenTelemetry packages are missing."""
    if not tracing_enabled(obs):
        return
    for module in OTEL_MODULES:
        try:
            found = importlib.util.find_spec(module) is not None
        except ImportError:  # its parent package is missing (or blocked)
            found = False
        if not found:
            raise ConfigError(
                f"observability.tracing needs the OpenTelemetry packages ({module} is not "
                f"installed): {INSTALL_HINT}, or turn tracing off (observability.tracing = "
                "false, observability.otlp_traces_endpoint unset)"
            )


def make_tracer(obs: ObservabilitySection, model: str) -> RequestTracer | None:
    """The tracer ``obs`` asks for, its spans naming ``model`` (the served model name), or None
    with tracing off (opentelemetry not imported)."""
    if not tracing_enabled(obs):
        return None
    check_tracing(obs)
    try:
        from baton.metrics.otel import OtelTracer  # OpenTelemetry: optional (baton-core[otel])
    except ImportError as e:  # installed but broken (a missing dependency of theirs)
        raise ConfigError(
            f"observability.tracing: the OpenTelemetry packages failed to import ({e}): "
            f"{INSTALL_HINT}"
        ) from e
    return OtelTracer.create(obs.otlp_traces_endpoint, model)
