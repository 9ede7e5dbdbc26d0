"""The HTTP/1.1 connection: uvicorn's h11 protocol with the timeouts a public server needs.

uvicorn times out only idle keep-alive connections (``timeout_keep_alive``).
This protocol adds:

- a header timeout: from the first byte of a request until its headers are
  complete, at most ``server.header_timeout`` seconds; then a 408 and the
  connection is closed (a slowloris client sending a byte every few seconds
  holds a connection no longer than that);
- an idle timeout before the first request: a connection that sends nothing
  is closed after ``timeout_keep_alive``, like one idle between requests;
- a lingering close: when the server closes a connection while the client is
  still sending a body (a 413 or a 408 from limits.py), it sends its response
  and a FIN, then reads and drops what still comes for a moment, so the client
  reads the response instead of a connection reset.

The body's own size and deadline are enforced by the ASGI middleware in
limits.py, which can still answer with a response.
"""

from __future__ import annotations

import asyncio
import json
import logging
from http import HTTPStatus
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from baton_openai.http.errors import error_body

log = logging.getLogger("baton_openai")

#: How long a connection closed mid-body keeps reading (and dropping) the client's data.
LINGER_S = 2.0


def raw_error_response(status: int, message: str, code: str) -> bytes:
    """A complete HTTP/1.1 error response in OpenAI's shape that closes the connection."""
    body = json.dumps(error_body(message, status, code=code)).encode()
    head = (
        f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\n"
        "content-type: application/json\r\n"
        f"content-length: {len(body)}\r\n"
        "connection: close\r\n\r\n"
    )
    return head.encode("latin-1") + body


class _LingeringTransport:
    """The connection's transport as uvicorn sees it: ``close()`` lingers while a body is coming."""

    def __init__(self, transport: asyncio.Transport, protocol: BoundedH11Protocol) -> None:
        self._transport = transport
        self._protocol = protocol
        self._closing = False
        self.lingering = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    def is_closing(self) -> bool:
        return self._closing or self._transport.is_closing()

    def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        t = self._transport
        if self._protocol.client_is_sending_body() and not t.is_closing() and t.can_write_eof():
            self.lingering = True
            t.write_eof()  # after what is buffered: the response reaches the client, then a FIN
            t.resume_reading()
            self._protocol.loop.call_later(LINGER_S, t.close)
        else:
            t.close()

    def pause_reading(self) -> None:
        if not self.lingering:  # a lingering connection must keep draining the client's data
            self._transport.pause_reading()

    def resume_reading(self) -> None:
        if not self.is_closing() or self.lingering:
            self._transport.resume_reading()


class BoundedH11Protocol(H11Protocol):
    """H11Protocol with a header timeout, an idle timeout before the first request, lingering close."""

    #: Seconds from a request's first byte to the end of its headers (set by ``protocol_class``).
    header_timeout: float = 30.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:  # type: ignore[override]
        self._header_timer: asyncio.TimerHandle | None = None
        self._lingering = _LingeringTransport(transport, self)  # type: ignore[arg-type]
        super().connection_made(self._lingering)  # type: ignore[arg-type]
        # uvicorn arms its keep-alive timer only after a response: a silent new connection too
        self.timeout_keep_alive_task = self.loop.call_later(
            self.timeout_keep_alive, self.timeout_keep_alive_handler
        )

    def client_is_sending_body(self) -> bool:
        return self.conn.their_state is h11.SEND_BODY

    def data_received(self, data: bytes) -> None:
        if self._lingering.lingering:
            return  # the response is sent and the connection closing: drop the rest of the body
        super().data_received(data)
        self._watch_headers()

    def _watch_headers(self) -> None:
        # IDLE after new bytes: a request has begun but its headers are not complete yet
        waiting = self.conn.their_state is h11.IDLE and not self.transport.is_closing()
        if waiting and self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout, self._headers_timed_out)
        elif not waiting and self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_timed_out(self) -> None:
        self._header_timer = None
        if self.conn.their_state is not h11.IDLE or self.transport.is_closing():
            return
        log.info(
            "closing the connection from %s: request headers incomplete after "
            "server.header_timeout (%g s)",
            f"{self.client[0]}:{self.client[1]}" if self.client else "?",
            self.header_timeout,
        )
        self.transport.write(
            raw_error_response(
                408,
                f"the request headers did not arrive within server.header_timeout "
                f"({self.header_timeout:g} s)",
                "request_timeout",
            )
        )
        self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        super().connection_lost(exc)


def protocol_class(header_timeout: float) -> type[BoundedH11Protocol]:
    """The protocol class to give ``uvicorn.Config(http=...)`` for one server's settings."""
    return type("BatonH11Protocol", (BoundedH11Protocol,), {"header_timeout": header_timeout})
