"""The ``pd`` connector's worker half: copies blocks to and from the hand-off store.

Saves run in ``finish_step`` (after the forward, before the step returns), so a producer's
blocks are in the store before its response leaves. Loads run on a small thread pool while
the engine's forwards go on; each waits at most its order's ``timeout`` for a block not
written yet, and stops at the first missing or bad block (the rest is recomputed).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from baton.kv_transfer.connector import KVWorkerContext
from baton.kv_transfer.pd.orders import DECODER, PDLoad, PDSave
from baton.kv_transfer.pd.settings import PDSettings
from baton.kv_transfer.pd.store import BadBlockError, HandoffStore
from baton.kv_transfer.types import KVConnectorOutput, KVTransferStats
from baton.protocol import KVCacheSpec

logger = logging.getLogger(__name__)

#: How often a load looks again for a block the producer has not written yet.
POLL_S = 0.005
#: Loads that run at once (each may wait for its producer).
LOAD_THREADS = 2


class PDWorker:
    """The worker half of ``pd`` (module docstring)."""

    def __init__(self, context: KVWorkerContext, settings: PDSettings) -> None:
        self.settings = settings
        self.block_size = context.namespace.block_size
        shard = f"tp{context.tp_rank}-pp{context.pp_rank}"
        self.store = HandoffStore(settings.path, context.namespace.key, shard)
        self._caches: list[torch.Tensor] = []
        self._block_bytes = 0
        self._pool = ThreadPoolExecutor(LOAD_THREADS, thread_name_prefix="baton-pd-load")
        self._loads: dict[str, Future[int]] = {}
        self._released: set[str] = set()
        self._saves: list[PDSave] = []
        self._lock = threading.Lock()  # the stats, which load threads add to
        self._stats = KVTransferStats()
        self._last_sweep = 0.0

    def register_kv_caches(self, kv_caches: Sequence[torch.Tensor], spec: KVCacheSpec) -> None:
        self._caches = list(kv_caches)
        self._block_bytes = spec.page_size_bytes

    def start_step(self, metadata: bytes) -> None:
        orders = DECODER.decode(metadata)
        self._saves.extend(orders.saves)
        self._released.update(orders.released)
        for load in orders.loads:
            self._loads[load.request_id] = self._pool.submit(self._load, load)

    def finish_step(self) -> KVConnectorOutput | None:
        out = KVConnectorOutput()
        if self._saves:
            self._save(self._saves)
            self._saves = []
        for rid in [r for r, f in self._loads.items() if f.done()]:
            future = self._loads.pop(rid)
            error = future.exception()
            if rid in self._released:  # ended while loading: its blocks may go now
                self._released.discard(rid)
                out.finished_saving.append(rid)
            elif error is not None:
                out.failed[rid] = (
                    f"pd: loading the hand-off failed: {type(error).__name__}: {error}"
                )
            else:
                out.finished_loading[rid] = future.result()
        with self._lock:
            if self._stats != KVTransferStats():
                out.stats, self._stats = self._stats, KVTransferStats()
        return None if out == KVConnectorOutput() else out

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    # -- saves ----------------------------------------------------------------------------

    def _save(self, saves: list[PDSave]) -> None:
        t0 = time.perf_counter()
        written = 0
        for save in saves:
            payload = self._block(save.block_id).numpy().tobytes()
            try:
                written += self.store.write(save.transfer_id, save.index, save.block_hash, payload)
            except OSError as e:  # a full /dev/shm: the consumer recomputes what is missing
                logger.warning("pd: cannot write hand-off %s: %s", save.transfer_id, e)
                break
        with self._lock:
            self._stats.save_bytes += written
            self._stats.save_seconds += time.perf_counter() - t0
        now = time.monotonic()
        if now - self._last_sweep > self.settings.max_age / 4:
            self._last_sweep = now
            self.store.sweep(self.settings.max_age)

    def _block(self, block_id: int) -> torch.Tensor:
        """One block of every layer this worker holds, as contiguous bytes."""
        return torch.stack([kv[:, block_id] for kv in self._caches]).view(torch.uint8)

    # -- loads ----------------------------------------------------------------------------

    def _load(self, load: PDLoad) -> int:
        """Load the order's blocks in order; the tokens loaded (fewer: a shortfall)."""
        t0 = time.perf_counter()
        deadline = time.monotonic() + load.timeout
        loaded = 0
        try:
            for k, (block_id, block_hash) in enumerate(
                zip(load.block_ids, load.block_hashes, strict=True)
            ):
                payload = self._wait_for(load, load.first_index + k, block_hash, deadline)
                if payload is None:
                    break
                self._put(block_id, payload)
                loaded += 1
        finally:
            self.store.remove_shard(load.transfer_id)
            missing = len(load.block_ids) - loaded
            if missing:
                logger.warning(
                    "pd: request %s: %d of %d blocks of hand-off %s not loaded: recomputed",
                    load.request_id,
                    missing,
                    len(load.block_ids),
                    load.transfer_id,
                )
            with self._lock:
                self._stats.load_bytes += loaded * self._block_bytes
                self._stats.load_seconds += time.perf_counter() - t0
                self._stats.failed_loads += missing
        return loaded * self.block_size

    def _wait_for(
        self, load: PDLoad, index: int, block_hash: bytes, deadline: float
    ) -> bytes | None:
        """Block ``index``'s payload, waiting until ``deadline`` for it to be written; None
        when it never came or is bad."""
        while True:
            try:
                payload = self.store.read(load.transfer_id, index, block_hash, self._block_bytes)
            except BadBlockError as e:
                logger.warning("pd: %s: recomputed", e)
                return None
            if payload is not None or time.monotonic() >= deadline:
                return payload
            time.sleep(POLL_S)

    def _put(self, block_id: int, payload: bytes) -> None:
        first = self._caches[0]
        blocks = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        blocks = blocks.view(first.dtype).view(len(self._caches), *first[:, block_id].shape)
        for layer, kv in enumerate(self._caches):
            kv[:, block_id].copy_(blocks[layer])
