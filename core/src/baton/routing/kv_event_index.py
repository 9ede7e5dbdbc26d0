"""Which blocks each engine's KV pool holds, as the engines' KV events say (docs/kv-events.md).

A background thread subscribes to every engine core's KV event endpoint (``[kv_events]``, one
per data-parallel rank) and keeps, per engine, the set of block hashes its pool caches:
BlockStored adds, BlockRemoved drops, AllBlocksCleared empties (events of a KV connector's
tiers, medium CPU or DISK, are left out: only the pool's blocks are served without a load).
Batches an engine published before the subscription took (ZeroMQ's slow joiner), or that
ZeroMQ dropped, come back from its replay endpoint when it has one: at once when a gap shows in
its sequence numbers, and every ``CATCH_UP_S`` anyway (a lost last batch shows no gap); without
one the index misses those blocks until they are stored again. It is a routing hint: a stale entry costs a cache miss, never a wrong
token.

pyzmq is optional (``baton-core[kv-events]``): ``prefix-aware`` imports this module only with
``use_kv_events`` on.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

import msgspec
import zmq

from baton.kv.events import (
    MEDIUM_POOL,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ExternalBlockHash,
    KVEventBatch,
)

log = logging.getLogger(__name__)

#: How long the thread waits for a message before it looks at the stop flag again.
POLL_MS = 100
#: How long a replay may take before the index gives up on it (and logs a warning).
REPLAY_TIMEOUT_MS = 1000
#: How often the index asks each engine's replay socket for what follows its last batch.
CATCH_UP_S = 1.0
_END_SEQ = (-1).to_bytes(8, "big", signed=True)


class KVEventIndex:
    """Per engine, the block hashes its pool caches; see the module docstring."""

    def __init__(
        self, endpoints: Sequence[str], replay_endpoints: Sequence[str | None], topic: str = ""
    ) -> None:
        if len(endpoints) != len(replay_endpoints):
            raise ValueError("one replay endpoint (or None) per endpoint")
        self._endpoints = list(endpoints)
        self._replay_endpoints = list(replay_endpoints)
        self._topic = topic.encode()
        self._blocks: list[set[ExternalBlockHash]] = [set() for _ in endpoints]
        #: The last sequence number applied, per engine (-1: none yet).
        self._last = [-1] * len(endpoints)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._decode = msgspec.msgpack.Decoder(KVEventBatch).decode
        self._ctx = zmq.Context()
        self._thread = threading.Thread(target=self._run, name="kv-event-index", daemon=True)
        self._thread.start()

    def matched_blocks(self, block_hashes: Sequence[ExternalBlockHash]) -> list[int]:
        """Per engine, how many of ``block_hashes`` (a prompt's leading blocks, in order) its
        pool holds from the first on."""
        with self._lock:
            out = []
            for blocks in self._blocks:
                n = 0
                for h in block_hashes:
                    if h not in blocks:
                        break
                    n += 1
                out.append(n)
            return out

    def num_blocks(self, engine: int) -> int:
        """How many blocks the index believes engine ``engine`` caches."""
        with self._lock:
            return len(self._blocks[engine])

    def close(self) -> None:
        """Stop the thread and close its sockets; idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join((POLL_MS + len(self._endpoints) * REPLAY_TIMEOUT_MS) / 1000 + 1.0)
        if self._thread.is_alive():
            log.warning("the KV event index's thread did not stop")
            return
        self._ctx.term()

    # ----------------------------------------------------------------- the thread

    def _run(self) -> None:
        subs: dict[zmq.Socket, int] = {}
        replays: list[zmq.Socket | None] = []
        poller = zmq.Poller()
        try:
            for engine, (endpoint, replay) in enumerate(
                zip(self._endpoints, self._replay_endpoints, strict=True)
            ):
                sub = self._ctx.socket(zmq.SUB)
                sub.setsockopt(zmq.LINGER, 0)
                sub.setsockopt(zmq.SUBSCRIBE, self._topic)
                sub.connect(endpoint)
                subs[sub] = engine
                poller.register(sub, zmq.POLLIN)
                dealer = None
                if replay is not None:
                    dealer = self._ctx.socket(zmq.DEALER)
                    dealer.setsockopt(zmq.LINGER, 0)
                    # a request to an engine not up yet is refused at once, not queued for it
                    dealer.setsockopt(zmq.IMMEDIATE, 1)
                    dealer.connect(replay)
                replays.append(dealer)
            catch_up = time.monotonic()
            while not self._stop.is_set():
                if time.monotonic() >= catch_up:
                    for engine, dealer in enumerate(replays):
                        if dealer is not None:
                            self._replay(engine, dealer)
                    catch_up = time.monotonic() + CATCH_UP_S
                for sub, _ in poller.poll(POLL_MS):
                    engine = subs[sub]
                    _, seq_bytes, payload = sub.recv_multipart()
                    seq = int.from_bytes(seq_bytes, "big")
                    if seq > self._last[engine] + 1:
                        self._replay(engine, replays[engine], seq)
                    if seq > self._last[engine]:
                        self._apply(engine, seq, payload)
        finally:
            for sock in [*subs, *(r for r in replays if r is not None)]:
                sock.close(linger=0)

    def _replay(self, engine: int, dealer: zmq.Socket | None, seq: int | None = None) -> None:
        """Apply engine ``engine``'s batches after the last applied one from its replay socket,
        if it has one (``seq``: the batch that showed a gap, for the log)."""
        start = self._last[engine] + 1
        if dealer is None:
            log.debug("engine %d: KV event batches from %d to %s missed", engine, start, seq)
            return
        try:
            dealer.send_multipart([b"", start.to_bytes(8, "big")], flags=zmq.NOBLOCK)
        except zmq.Again:
            return  # not connected (yet): the next catch-up asks again
        while dealer.poll(REPLAY_TIMEOUT_MS):
            _, got, payload = dealer.recv_multipart()
            if got == _END_SEQ:
                return
            n = int.from_bytes(got, "big")
            if n > self._last[engine]:
                self._apply(engine, n, payload)
        log.warning(
            "engine %d: no end of the KV event replay from %s within %d ms",
            engine,
            self._replay_endpoints[engine],
            REPLAY_TIMEOUT_MS,
        )

    def _apply(self, engine: int, seq: int, payload: bytes) -> None:
        batch = self._decode(payload)
        with self._lock:
            blocks = self._blocks[engine]
            for event in batch.events:
                if type(event) is AllBlocksCleared:
                    blocks.clear()
                elif event.medium not in (MEDIUM_POOL, None):
                    continue
                elif type(event) is BlockStored:
                    blocks.update(event.block_hashes)
                elif type(event) is BlockRemoved:
                    blocks.difference_update(event.block_hashes)
            self._last[engine] = seq
