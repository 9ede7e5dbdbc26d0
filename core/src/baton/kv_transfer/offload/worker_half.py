"""The offload connector's worker half: copies blocks between the worker's KV cache, its RAM
tier and the disk tier, as the scheduler half's orders say."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

from baton.kv.events import MEDIUM_CPU, MEDIUM_DISK
from baton.kv_transfer.connector import KVBlockRef, KVWorkerContext
from baton.kv_transfer.offload.disk_tier import BlockFileStore
from baton.kv_transfer.offload.disk_writer import DiskWriter
from baton.kv_transfer.offload.layout import block_nbytes, shard_key
from baton.kv_transfer.offload.orders import LoadOrder, StepOrders, decode_orders
from baton.kv_transfer.offload.ram_tier import LRUBytes
from baton.kv_transfer.offload.settings import OffloadSettings
from baton.kv_transfer.offload.worker_stats import WorkerStats
from baton.kv_transfer.types import KVConnectorOutput, KVTransferStats

if TYPE_CHECKING:
    from baton.protocol import KVCacheSpec

log = logging.getLogger(__name__)


class _BackgroundLoad:
    """A request's disk load running in the loader thread."""

    def __init__(self) -> None:
        self.cancel = threading.Event()
        self.future: Future[int] | None = None


class OffloadWorker:
    """``KVConnectorWorker`` of the offload connector (one per worker process)."""

    def __init__(self, context: KVWorkerContext, settings: OffloadSettings) -> None:
        self.context = context
        self.settings = settings
        self.block_size = context.namespace.block_size
        # RAM is counted in whole-engine block bytes, as the scheduler half counts it
        self.block_bytes = block_nbytes(context.namespace)
        self.ram: LRUBytes[bytes, torch.Tensor] = LRUBytes(int(settings.cpu_memory))
        self.stats = WorkerStats()
        self.disk: BlockFileStore | None = None
        self.writer: DiskWriter | None = None
        self._loader: ThreadPoolExecutor | None = None
        if settings.disk_path is not None:
            key = shard_key(context.namespace, context.tp_rank, context.pp_rank)
            self.disk = BlockFileStore(settings.disk_path, int(settings.disk_memory), key)
            self.writer = DiskWriter(
                self.disk,
                self.stats,
                behind=settings.disk_write_behind,
                max_pending_bytes=max(int(settings.cpu_memory), 64 * self.block_bytes),
            )
            self._loader = ThreadPoolExecutor(1, thread_name_prefix="baton-kv-disk-loader")
        self._caches: list[torch.Tensor] = []
        self._block_shape: list[int] = []
        self._pin = False
        self._orders = StepOrders()
        self._loads: dict[str, _BackgroundLoad] = {}
        self._failed: dict[str, str] = {}
        self._stopped: dict[str, int] = {}  # cancelled loads, to report: request -> tokens

    # ---- the KV cache

    def register_kv_caches(self, kv_caches: Sequence[torch.Tensor], spec: KVCacheSpec) -> None:
        self._caches = list(kv_caches)
        first = self._caches[0]
        # one block of every layer this worker holds: [layers, 2 (K, V), heads, block, head size]
        self._block_shape = [len(self._caches), 2, *first.shape[2:]]
        self._pin = first.device.type == "cuda"
        # RAM is kept across a new cache (wake_up): its payloads are host copies, and the
        # scheduler half's mirror still counts them

    def _copy_out(self, block_id: int) -> torch.Tensor:
        """A host copy of one block of every layer."""
        out = torch.empty(
            self._block_shape, dtype=self._caches[0].dtype, device="cpu", pin_memory=self._pin
        )
        for layer, kv in enumerate(self._caches):
            out[layer].copy_(kv[:, block_id])
        return out

    def _copy_in(self, block_id: int, payload: torch.Tensor) -> None:
        for layer, kv in enumerate(self._caches):
            kv[:, block_id].copy_(payload[layer], non_blocking=False)

    def _nbytes(self, payload: torch.Tensor) -> int:
        return payload.numel() * payload.element_size()

    # ---- a step

    def start_step(self, metadata: bytes) -> None:
        orders = decode_orders(metadata) if metadata else StepOrders()
        for req_id in orders.cancel_loads:
            self._cancel(req_id)
        for load in orders.loads:
            self._load(load)
        self._orders = orders

    def _cancel(self, req_id: str) -> None:
        """Stop a request's background load and wait for it (the request ended); it is still
        reported in ``finished_loading``, which is what frees its blocks."""
        job = self._loads.pop(req_id, None)
        if job is None or job.future is None:
            return
        job.cancel.set()
        # waits; a failure no longer matters (nothing will read the blocks)
        exc = job.future.exception()
        self._stopped[req_id] = 0 if exc is not None else job.future.result()

    def _load(self, load: LoadOrder) -> None:
        start = time.perf_counter()
        nbytes = 0
        for ref in load.ram:
            payload = self.ram.get(ref.block_hash)
            if payload is None:
                # the halves disagree about RAM: never compute on a block not loaded
                self._failed[load.req_id] = (
                    f"offload connector: block {ref.block_hash.hex()} is not in this worker's RAM "
                    "tier though the scheduler half ordered its load"
                )
                return
            self._copy_in(ref.block_id, payload)
            nbytes += self._nbytes(payload)
        if nbytes:
            self.stats.add_load(nbytes, time.perf_counter() - start)
        if not load.disk:
            return
        loaded = len(load.ram) * self.block_size
        if self._loader is None:  # no disk tier here: report what RAM gave
            job = _BackgroundLoad()
            job.future = Future()
            job.future.set_result(loaded)
        else:
            job = _BackgroundLoad()
            job.future = self._loader.submit(self._load_from_disk, load.disk, loaded, job.cancel)
        self._loads[load.req_id] = job

    def _load_from_disk(self, refs: list[KVBlockRef], loaded: int, cancel: threading.Event) -> int:
        """Loader thread: copy the blocks in order until one is missing or bad; the tokens
        loaded (from the first token the load was asked for)."""
        assert self.disk is not None
        for ref in refs:
            if cancel.is_set():
                break
            start = time.perf_counter()
            payload = self.disk.get(ref.block_hash, self._block_shape, self._caches[0].dtype)
            if payload is None:
                self.stats.add_failed_load()
                break
            self._copy_in(ref.block_id, payload)
            self.stats.add_load(self._nbytes(payload), time.perf_counter() - start)
            loaded += self.block_size
        return loaded

    def finish_step(self) -> KVConnectorOutput | None:
        orders, self._orders = self._orders, StepOrders()
        if orders.saves:
            self._save(orders)
        finished, self._stopped = self._stopped, {}
        for req_id, job in list(self._loads.items()):
            assert job.future is not None
            if not job.future.done():
                continue
            del self._loads[req_id]
            exc = job.future.exception()
            if exc is not None:
                self._failed[req_id] = f"offload connector: loading from disk failed: {exc!r}"
            else:
                finished[req_id] = job.future.result()
        failed, self._failed = self._failed, {}
        return KVConnectorOutput(finished_loading=finished, failed=failed, stats=self._take_stats())

    def _save(self, orders: StepOrders) -> None:
        start = time.perf_counter()
        nbytes = 0
        for save in orders.saves:
            for block_hash in save.evict:
                self.ram.pop(block_hash)
            payload = self._copy_out(save.block_id)
            if save.ram:
                self.ram.put(save.block_hash, payload, self.block_bytes)
                nbytes += self._nbytes(payload)
            if save.disk and self.writer is not None:
                self.writer.submit(save.block_hash, payload)
        if nbytes:
            self.stats.add_save(nbytes, time.perf_counter() - start)

    def _take_stats(self) -> KVTransferStats:
        tier_bytes = {MEDIUM_CPU: self.ram.used_bytes}
        capacity = {MEDIUM_CPU: self.ram.capacity_bytes}
        if self.disk is not None:
            tier_bytes[MEDIUM_DISK] = self.disk.used_bytes
            capacity[MEDIUM_DISK] = self.disk.capacity_bytes
        return self.stats.take(tier_bytes, capacity)

    def flush(self) -> None:
        """Wait until the blocks saved so far are on disk (tests; a restart)."""
        if self.writer is not None:
            self.writer.flush()

    def wait_loads(self) -> None:
        """Wait until every background load is done (reported by the next ``finish_step``)."""
        for job in list(self._loads.values()):
            if job.future is not None:
                job.future.exception()

    def shutdown(self) -> None:
        for req_id in list(self._loads):
            self._cancel(req_id)
        if self._loader is not None:
            self._loader.shutdown(wait=True)
            self._loader = None
        if self.writer is not None:
            self.writer.close()
        self.ram.clear()
