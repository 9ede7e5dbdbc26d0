"""KV cache events over ZeroMQ, framed as vLLM's ``ZmqEventPublisher`` frames them.

- PUB on ``endpoint``: one multipart message per batch, ``[topic, seq, payload]``: ``seq`` the
  batch's sequence number (8 bytes, big-endian, from 0), ``payload`` a msgpack ``KVEventBatch``
  (ts, events, data_parallel_rank). Block hashes go out as vLLM sends them by default: the low
  64 bits of the digest as an unsigned integer (``int_block_hashes``; off: the digest's bytes).
- ROUTER on ``replay_endpoint`` (optional): a client (REQ, or DEALER sending an empty delimiter
  frame first) sends the 8-byte big-endian sequence number to start from and gets
  ``[seq, payload]`` for every buffered batch from there (the last ``buffer_steps``), then the
  end marker ``[(-1).to_bytes(8, "big", signed=True), b""]``.

A background thread owns both sockets (ZeroMQ sockets are not thread-safe): the engine's step
only puts the batch in a bounded queue (``publish``), and a full queue drops the batch with a
warning rather than stall the engine. ``shutdown`` lets the thread send what is queued (for up
to ``SHUTDOWN_S``), closes the sockets with linger 0 and ends the thread.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import deque
from itertools import islice
from typing import TYPE_CHECKING

import msgspec
import zmq

from baton.errors import ConfigError, TransportError
from baton.kv.event_publisher import rank_endpoint
from baton.kv.events import BlockRemoved, BlockStored, KVEventBatch, int_block_hash

if TYPE_CHECKING:
    from baton.config.sections import KVEventsSection
    from baton.kv.events import KVCacheEvent

log = logging.getLogger(__name__)

#: The sequence number that ends a replay (its payload frame is empty).
END_SEQ = (-1).to_bytes(8, "big", signed=True)
#: How long the thread waits for a batch before it looks at replay requests again.
POLL_S = 0.05
#: How long ``shutdown`` lets the thread send what is still queued.
SHUTDOWN_S = 2.0


def _seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


def _with_int_hashes(batch: KVEventBatch) -> None:
    """Turn the batch's block hashes into integers, in place (the publisher owns the batch)."""
    for event in batch.events:
        if type(event) is BlockStored:
            event.block_hashes = [int_block_hash(h) for h in event.block_hashes]
            if event.parent_block_hash is not None:
                event.parent_block_hash = int_block_hash(event.parent_block_hash)
        elif type(event) is BlockRemoved:
            event.block_hashes = [int_block_hash(h) for h in event.block_hashes]


class ZmqEventPublisher:
    """PUB + replay ROUTER for one engine core; see the module docstring."""

    def __init__(self, section: KVEventsSection, data_parallel_rank: int = 0) -> None:
        self.data_parallel_rank = data_parallel_rank
        self.endpoint = rank_endpoint(section.endpoint, data_parallel_rank)
        self.replay_endpoint = (
            None
            if section.replay_endpoint is None
            else rank_endpoint(section.replay_endpoint, data_parallel_rank)
        )
        self.max_queue_size = section.max_queue_size
        #: Batches dropped because the queue was full (each logged as a warning at 1, 2, 4, ...).
        self.dropped = 0
        self._hwm = section.hwm
        self._topic = section.topic.encode()
        self._int_hashes = section.int_block_hashes
        self._queue: queue.Queue[KVEventBatch | None] = queue.Queue(section.max_queue_size)
        #: (seq, payload) of the newest published batches, for replay; seqs are consecutive.
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=section.buffer_steps)
        self._next_seq = 0
        self._stop = threading.Event()
        self._closed = False
        self._ready = threading.Event()
        self._bind_error: BaseException | None = None
        self._ctx = zmq.Context()
        self._thread = threading.Thread(
            target=self._run, name=f"kv-events-dp{data_parallel_rank}", daemon=True
        )
        self._thread.start()
        self._ready.wait()
        if self._bind_error is not None:
            self._thread.join()
            self._ctx.term()
            self._closed = True
            if isinstance(self._bind_error, ConfigError):
                raise self._bind_error
            raise TransportError(
                f"KV events: the publisher on {self.endpoint} could not start: "
                f"{type(self._bind_error).__name__}: {self._bind_error}"
            ) from self._bind_error
        log.info(
            "KV events: publishing on %s%s (data-parallel rank %d)",
            self.endpoint,
            f", replay on {self.replay_endpoint}" if self.replay_endpoint else "",
            data_parallel_rank,
        )

    # ----------------------------------------------------------------- engine side

    def publish(self, events: list[KVCacheEvent]) -> None:
        """Queue one batch for the thread; dropped (with a warning) when the queue is full."""
        if self._closed:
            raise TransportError(f"the KV event publisher on {self.endpoint} is shut down")
        batch = KVEventBatch(
            ts=time.time(), events=events, data_parallel_rank=self.data_parallel_rank
        )
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self.dropped += 1
            if self.dropped & (self.dropped - 1) == 0:
                log.warning(
                    "KV events: the publisher's queue is full (kv_events.max_queue_size=%d); "
                    "%d batches dropped so far, subscribers miss them",
                    self.max_queue_size,
                    self.dropped,
                )

    def shutdown(self) -> None:
        """Send what is queued (up to SHUTDOWN_S), close the sockets, end the thread."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        # wakes the thread at once; with a full queue it wakes within POLL_S anyway
        with contextlib.suppress(queue.Full):
            self._queue.put_nowait(None)
        self._thread.join(SHUTDOWN_S + 1.0)
        if self._thread.is_alive():  # the thread closes its own sockets; never term under it
            log.warning("KV events: the publisher thread did not stop within %.0fs", SHUTDOWN_S)
            return
        self._ctx.term()

    # ----------------------------------------------------------------- the thread

    def _bind(self) -> tuple[zmq.Socket, zmq.Socket | None]:
        pub = self._ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.setsockopt(zmq.SNDHWM, self._hwm)
        replay: zmq.Socket | None = None
        name, where = "endpoint", self.endpoint
        try:
            pub.bind(where)
            if self.replay_endpoint is not None:
                replay = self._ctx.socket(zmq.ROUTER)
                replay.setsockopt(zmq.LINGER, 0)
                name, where = "replay_endpoint", self.replay_endpoint
                replay.bind(where)
        except zmq.ZMQError as e:
            pub.close(linger=0)
            if replay is not None:
                replay.close(linger=0)
            rank = self.data_parallel_rank
            raise ConfigError(
                f"kv_events.{name}: engine core {rank} cannot bind {where!r} ({e}): choose a "
                "free port (each data-parallel engine binds the port plus its rank) or an "
                "ipc:// path"
            ) from e
        return pub, replay

    def _run(self) -> None:
        try:
            pub, replay = self._bind()
        except BaseException as e:  # handed to __init__, which raises it in the engine's thread
            self._bind_error = e
            return
        finally:
            self._ready.set()
        encode = msgspec.msgpack.Encoder().encode
        deadline: float | None = None
        try:
            while True:
                if replay is not None:
                    while replay.poll(0):
                        self._serve_replay(replay)
                if self._stop.is_set():
                    if deadline is None:
                        deadline = time.monotonic() + SHUTDOWN_S
                    elif time.monotonic() > deadline:
                        log.warning(
                            "KV events: %d batches not sent at shutdown", self._queue.qsize()
                        )
                        break
                try:
                    batch = self._queue.get(timeout=POLL_S)
                except queue.Empty:
                    if self._stop.is_set():
                        break
                    continue
                if batch is None:
                    continue  # shutdown's wake-up: drain the rest, then stop on Empty
                if self._int_hashes:
                    _with_int_hashes(batch)
                self._send(pub, encode(batch))
        finally:
            pub.close(linger=0)
            if replay is not None:
                replay.close(linger=0)

    def _send(self, pub: zmq.Socket, payload: bytes) -> None:
        seq = self._next_seq
        self._next_seq += 1
        # PUB never blocks: past the high-water mark ZeroMQ drops for that subscriber
        pub.send_multipart((self._topic, _seq_bytes(seq), payload))
        self._buffer.append((seq, payload))

    def _serve_replay(self, replay: zmq.Socket) -> None:
        """Answer one replay request: every buffered batch from its start, then the end marker."""
        frames = replay.recv_multipart()
        if len(frames) == 3 and not frames[1]:  # REQ (or DEALER) with the empty delimiter
            head, start = [frames[0], b""], frames[2]
        elif len(frames) == 2:  # DEALER without a delimiter
            head, start = [frames[0]], frames[1]
        else:
            log.warning("KV events: a replay request of %d frames ignored", len(frames))
            return
        if len(start) != 8:
            log.warning(
                "KV events: a replay request of %d bytes, not an 8-byte sequence number; "
                "answered with the end marker only",
                len(start),
            )
        elif self._buffer:
            first = self._buffer[0][0]
            skip = max(0, int.from_bytes(start, "big") - first)
            for seq, payload in islice(self._buffer, skip, None):
                replay.send_multipart([*head, _seq_bytes(seq), payload])
        replay.send_multipart([*head, END_SEQ, b""])
