"""``server.max_queued_requests``: a bounded queue in front of the engine, 429 when it is full.

A request counts as queued from the moment the server accepts it until its
first output arrives (waiting in the scheduler, or computing its prompt) or it
ends. When ``limit`` requests are queued, the next one is refused at once with
a 429 and ``Retry-After``, before any preprocessing; the refusal is counted in
``baton_requests_rejected_total{reason="queue_full"}``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import TypeVar

from baton_openai.http.errors import OpenAIError

T = TypeVar("T")
#: Seconds a refused client is told to wait before it retries.
RETRY_AFTER_S = 1


class QueueFull(OpenAIError):
    """The 429 a request gets when the queue is full."""

    def __init__(self, limit: int) -> None:
        super().__init__(
            f"the server has {limit} requests waiting for their first token "
            f"(server.max_queued_requests): retry after {RETRY_AFTER_S} s",
            429,
            code="queue_full",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )


class QueueGate:
    """Counts queued requests; ``admit`` refuses past the limit (None: unbounded)."""

    def __init__(self, limit: int | None, on_reject: Callable[[], None] | None = None) -> None:
        self.limit = limit
        self.queued = 0
        self._on_reject = on_reject

    def admit(self, count: int = 1) -> Ticket:
        """Hold ``count`` places (one per engine request) or raise QueueFull."""
        if self.limit is not None and self.queued >= self.limit:
            if self._on_reject is not None:
                self._on_reject()
            raise QueueFull(self.limit)
        self.queued += count
        return Ticket(self, count)


class Ticket:
    """Places held in the queue: each freed by its stream's first output, the rest by ``close``."""

    def __init__(self, gate: QueueGate, count: int) -> None:
        self._gate = gate
        self._held = count

    def release(self, count: int = 1) -> None:
        count = min(count, self._held)
        self._held -= count
        self._gate.queued -= count

    def close(self) -> None:
        self.release(self._held)

    async def track(self, stream: AsyncIterator[T]) -> AsyncIterator[T]:
        """``stream`` unchanged; its place is freed at its first item or when it ends."""
        held = True
        try:
            async for item in stream:
                if held:
                    held = False
                    self.release()
                yield item
        finally:
            if held:
                self.release()
            await stream.aclose()  # type: ignore[attr-defined]
