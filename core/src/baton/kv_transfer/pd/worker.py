"""The ``pd`` connector's worker half: copies blocks to and from the shared block-file store.

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
from baton.kv_transfer.offload.disk_tier import BlockFileStore
from baton.kv_transfer.offload.layout import shard_key
from baton.kv_transfer.pd.orders import DECODER, PDLoad
from baton.kv_transfer.pd.params import MEDIUM
from baton.kv_transfer.pd.settings import PDSettings
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
        # one folder per worker shard: a tensor-parallel worker holds its heads of each block
        shard = shard_key(context.namespace, context.tp_rank, context.pp_rank)
        self.store = BlockFileStore(settings.path, int(settings.memory), shard)
        self._caches: list[torch.Tensor] = []
        self._pool = ThreadPoolExecutor(LOAD_THREADS, thread_name_prefix="baton-pd-load")
        self._loads: dict[str, Future[int]] = {}
        self._saves: list[int] = []
        self._save_hashes: list[bytes] = []
        self._lock = threading.Lock()  # the stats, which load threads add to
        self._stats = KVTransferStats()

    def register_kv_caches(self, kv_caches: Sequence[torch.Tensor], spec: KVCacheSpec) -> None:
        self._caches = list(kv_caches)

    def start_step(self, metadata: bytes) -> None:
        orders = DECODER.decode(metadata)
        for ref in orders.saves:
            self._saves.append(ref.block_id)
            self._save_hashes.append(ref.block_hash)
        for load in orders.loads:
            self._loads[load.request_id] = self._pool.submit(self._load, load)

    def finish_step(self) -> KVConnectorOutput | None:
        out = KVConnectorOutput()
        if self._saves:
            self._save()
        for rid in [r for r, f in self._loads.items() if f.done()]:
            future = self._loads.pop(rid)
            error = future.exception()
            if error is not None:
                out.failed[rid] = f"pd: loading the prefill failed: {type(error).__name__}: {error}"
            else:
                out.finished_loading[rid] = future.result()
        with self._lock:
            if self._stats != KVTransferStats():
                self._stats.tier_bytes[MEDIUM] = self.store.used_bytes
                self._stats.tier_capacity_bytes[MEDIUM] = self.store.capacity_bytes
                out.stats, self._stats = self._stats, KVTransferStats()
        return None if out == KVConnectorOutput() else out

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    # -- saves ----------------------------------------------------------------------------

    def _save(self) -> None:
        t0 = time.perf_counter()
        written = 0
        for block_id, block_hash in zip(self._saves, self._save_hashes, strict=True):
            block = self._block(block_id)
            if self.store.put(block_hash, block):  # False: the store stopped (one warning)
                written += block.numel() * block.element_size()
        self._saves, self._save_hashes = [], []
        with self._lock:
            self._stats.save_bytes += written
            self._stats.save_seconds += time.perf_counter() - t0

    def _block(self, block_id: int) -> torch.Tensor:
        """One block of every layer this worker holds: ``[layers, 2, heads, block, head]``."""
        return torch.stack([kv[:, block_id] for kv in self._caches])

    # -- loads ----------------------------------------------------------------------------

    def _load(self, load: PDLoad) -> int:
        """Load the order's blocks in order; the tokens loaded (fewer: a shortfall)."""
        t0 = time.perf_counter()
        deadline = time.monotonic() + load.timeout
        first = self._caches[0]
        shape = (len(self._caches), *first[:, 0].shape)
        loaded = 0
        for ref in load.blocks:
            block = self._wait_for(ref.block_hash, shape, first.dtype, deadline)
            if block is None:
                break
            for layer, kv in enumerate(self._caches):
                kv[:, ref.block_id].copy_(block[layer])
            loaded += 1
        missing = len(load.blocks) - loaded
        if missing:
            logger.warning(
                "pd: request %s: %d of its %d prefilled blocks are missing or bad after %.1f s: "
                "recomputed",
                load.request_id,
                missing,
                len(load.blocks),
                load.timeout,
            )
        with self._lock:
            self._stats.load_bytes += loaded * _nbytes(shape, first.dtype)
            self._stats.load_seconds += time.perf_counter() - t0
            self._stats.failed_loads += missing
        return loaded * self.block_size

    def _wait_for(
        self, block_hash: bytes, shape: tuple[int, ...], dtype: torch.dtype, deadline: float
    ) -> torch.Tensor | None:
        """The block, waiting until ``deadline`` for it to be written; None when it never came
        (or its file was bad: the store deleted it, so it reads as missing from then on)."""
        while True:
            bad = self.store.failed_loads
            block = self.store.get(block_hash, shape, dtype)
            if block is not None or time.monotonic() >= deadline:
                return block
            if self.store.failed_loads != bad:  # it was there, but bad: do not wait for it
                return None
            time.sleep(POLL_S)


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    n = dtype.itemsize
    for d in shape:
        n *= d
    return n
