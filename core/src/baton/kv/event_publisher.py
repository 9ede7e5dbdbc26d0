"""Where an engine core's KV cache events go: the publisher ``[kv_events]`` asks for.

The engine core takes each step's events from its scheduler (``Scheduler.take_kv_events``) and
hands them to its publisher once per step that produced any. ``zmq`` publishes them in vLLM's
wire format (``baton.kv.zmq_event_publisher``, needs pyzmq); ``null`` drops them. With data
parallelism every engine core publishes on its own endpoint (``rank_endpoint``), its batches
stamped with its data-parallel rank.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Protocol

from baton.config.sections import endpoint_port
from baton.errors import ConfigError

if TYPE_CHECKING:
    from baton.config.sections import KVEventsSection
    from baton.kv.events import KVCacheEvent

log = logging.getLogger(__name__)


class KVEventPublisher(Protocol):
    """Sends batches of KV cache events out of the engine core; never blocks the step."""

    def publish(self, events: list[KVCacheEvent]) -> None:
        """One batch (a step's events, oldest first); the publisher owns the list from here."""
        ...

    def shutdown(self) -> None:
        """Stop: flush what it can, close its sockets, end its thread. Idempotent."""
        ...


class NullEventPublisher:
    """``publisher = "null"``: the events are recorded and dropped."""

    def publish(self, events: list[KVCacheEvent]) -> None:
        return None

    def shutdown(self) -> None:
        return None


def rank_endpoint(endpoint: str, data_parallel_rank: int) -> str:
    """The endpoint of the engine core of ``data_parallel_rank``: a TCP port plus the rank, an
    ipc path with ``_dp<rank>`` appended; rank 0's is ``endpoint`` itself (as vLLM's)."""
    if data_parallel_rank == 0:
        return endpoint
    port = endpoint_port(endpoint)
    if port is None:
        return f"{endpoint}_dp{data_parallel_rank}"
    return f"{endpoint.rsplit(':', 1)[0]}:{port + data_parallel_rank}"


def make_kv_event_publisher(
    section: KVEventsSection, data_parallel_rank: int, prefix_caching: bool = True
) -> KVEventPublisher | None:
    """The publisher ``section`` selects, started; None when KV events are off. Warns when
    the pool caches nothing (``prefix_caching`` false)."""
    if not section.enable_kv_cache_events:
        return None
    if not prefix_caching:
        log.warning(
            "kv_events.enable_kv_cache_events with prefix caching off "
            "(cache.enable_prefix_caching = false, or the executor's model cannot): the "
            "pool caches no block, so only AllBlocksCleared is ever published"
        )
    if section.publisher == "null":
        return NullEventPublisher()
    try:
        # pyzmq is optional (baton-core[kv-events]): imported only when events go over ZeroMQ
        from baton.kv.zmq_event_publisher import ZmqEventPublisher
    except ImportError as e:
        if e.name != "zmq":
            raise
        raise ConfigError(
            "kv_events.publisher = 'zmq' needs pyzmq, which is not installed: pip install "
            "'baton-core[kv-events]' (or pyzmq), or set kv_events.publisher = 'null'"
        ) from e
    return ZmqEventPublisher(section, data_parallel_rank)
