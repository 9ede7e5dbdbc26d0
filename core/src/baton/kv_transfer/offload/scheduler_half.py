"""The offload connector's scheduler half: knows what the tiers hold, orders loads and saves.

It keeps a mirror of the workers' RAM tiers (the same LRU, counted in the same block bytes, fed
the same operations in the same order; evictions are sent explicitly with each save), so it
answers ``get_num_new_matched_tokens`` without asking a worker: the request's block-hash chain
is looked up in RAM first, then on disk (every worker shard's file exists) for the rest.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from baton.kv.events import MEDIUM_CPU, MEDIUM_DISK, BlockRemoved, BlockStored, KVCacheEvent
from baton.kv_transfer.connector import KVBlockRef, KVSchedulerContext, KVStep
from baton.kv_transfer.offload.disk_tier import BlockFileStore
from baton.kv_transfer.offload.layout import block_nbytes, shard_keys
from baton.kv_transfer.offload.orders import LoadOrder, SaveOrder, StepOrders, encode_orders
from baton.kv_transfer.offload.ram_tier import LRUBytes
from baton.kv_transfer.offload.settings import OffloadSettings
from baton.kv_transfer.types import KVConnectorOutput, KVTransferStats

if TYPE_CHECKING:
    from baton.request import Request


#: Events kept for ``take_events`` (older ones are dropped: with KV events off nobody asks).
MAX_PENDING_EVENTS = 10_000


class _Lookup:
    """What ``get_num_new_matched_tokens`` found for a request: from block ``start``, ``ram``
    blocks in RAM, then ``disk`` blocks on disk."""

    __slots__ = ("disk", "ram", "start")

    def __init__(self, start: int, ram: int, disk: int) -> None:
        self.start, self.ram, self.disk = start, ram, disk


class OffloadScheduler:
    """``KVConnectorScheduler`` of the offload connector (one per engine core)."""

    def __init__(self, context: KVSchedulerContext, settings: OffloadSettings) -> None:
        self.context = context
        self.settings = settings
        self.block_size = context.namespace.block_size
        self.block_bytes = block_nbytes(context.namespace)
        self.loads_enabled = context.role in ("both", "consumer")
        self.saves_enabled = context.role in ("both", "producer")
        self.ram: LRUBytes[bytes, None] = LRUBytes(int(settings.cpu_memory))
        # one store per worker shard, only asked whether a block's file exists
        self.disk_stores: list[BlockFileStore] = []
        if settings.disk_path is not None:
            self.disk_stores = [
                BlockFileStore(settings.disk_path, int(settings.disk_memory), key)
                for key in shard_keys(context.namespace)
            ]
        self._lookups: dict[str, _Lookup] = {}
        self._requests: dict[str, Request] = {}
        self._background: dict[str, int] = {}  # request -> tokens its RAM part loaded
        self._orders = StepOrders()
        # the kernel asks for events only when KV events are on: keep the latest, not all
        self._events: deque[KVCacheEvent] = deque(maxlen=MAX_PENDING_EVENTS)
        self._stats = KVTransferStats()
        self._disk_level: tuple[int, int] | None = None  # (bytes, capacity) as workers last said

    # ---- admission

    def _on_disk(self, block_hash: bytes) -> bool:
        return bool(self.disk_stores) and all(block_hash in s for s in self.disk_stores)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        if not self.loads_enabled or request.skip_reading_prefix_cache:
            return 0, False
        start = num_computed_tokens // self.block_size
        end = min(len(request.block_hashes), (request.num_tokens - 1) // self.block_size)
        ram = 0
        while start + ram < end and request.block_hashes[start + ram] in self.ram:
            ram += 1
        disk = 0
        while start + ram + disk < end and self._on_disk(request.block_hashes[start + ram + disk]):
            disk += 1
        if ram + disk == 0:
            self._lookups.pop(request.request_id, None)
            return 0, False
        self._lookups[request.request_id] = _Lookup(start, ram, disk)
        return (ram + disk) * self.block_size, disk > 0

    def update_state_after_alloc(
        self, request: Request, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        req_id = request.request_id
        self._requests[req_id] = request
        lookup = self._lookups.pop(req_id, None)
        if lookup is None or num_external_tokens <= 0:
            return
        n = num_external_tokens // self.block_size
        num_ram = min(lookup.ram, n)
        num_disk = min(lookup.disk, n - num_ram)
        refs = [
            KVBlockRef(block_ids[i], request.block_hashes[i])
            for i in range(lookup.start, lookup.start + num_ram + num_disk)
        ]
        for ref in refs[:num_ram]:
            self.ram.touch(ref.block_hash)  # the worker's get() makes it recent too
        self._orders.loads.append(LoadOrder(req_id, refs[:num_ram], refs[num_ram:]))
        if num_ram:
            self._add_hits(MEDIUM_CPU, num_ram * self.block_size)
        if num_disk:
            self._background[req_id] = num_ram * self.block_size

    def _add_hits(self, medium: str, tokens: int) -> None:
        hits = self._stats.hit_tokens
        hits[medium] = hits.get(medium, 0) + tokens

    # ---- steps

    def build_connector_meta(self, step: KVStep) -> bytes:
        for req_id in (*step.finished_req_ids, *step.preempted_req_ids):
            self._forget(req_id)
        if self.saves_enabled:
            for req_id, refs in step.new_full_blocks.items():
                self._order_saves(req_id, refs)
        orders, self._orders = self._orders, StepOrders()
        return encode_orders(orders)

    def _forget(self, req_id: str) -> None:
        """The request ended or was preempted: stop its background load (its blocks may be
        reused from now on)."""
        self._lookups.pop(req_id, None)
        self._requests.pop(req_id, None)
        if self._background.pop(req_id, None) is not None:
            self._orders.cancel_loads.append(req_id)

    def _order_saves(self, req_id: str, refs: list[KVBlockRef]) -> None:
        to_ram = self.ram.fits(self.block_bytes)
        to_disk = bool(self.disk_stores)
        stored_ram: list[bytes] = []
        stored_disk: list[bytes] = []
        for ref in refs:
            block_hash = ref.block_hash
            ram = to_ram and not self.ram.touch(block_hash)
            evict: list[bytes] = []
            if ram:
                evict = [k for k, _ in self.ram.put(block_hash, None, self.block_bytes)]
                stored_ram.append(block_hash)
                if evict:
                    self._events.append(BlockRemoved(block_hashes=list(evict), medium=MEDIUM_CPU))
            disk = to_disk and not self._on_disk(block_hash)
            if disk:
                stored_disk.append(block_hash)
            if ram or disk or evict:
                self._orders.saves.append(SaveOrder(ref.block_id, block_hash, ram, disk, evict))
        request = self._requests.get(req_id)
        for medium, hashes in ((MEDIUM_CPU, stored_ram), (MEDIUM_DISK, stored_disk)):
            self._events.extend(self._stored_events(request, hashes, medium))

    def _stored_events(
        self, request: Request | None, hashes: list[bytes], medium: str
    ) -> list[BlockStored]:
        """BlockStored events for ``hashes``, one per run of consecutive blocks of the request
        (with its parent block and tokens; none known when the request is not)."""
        if not hashes:
            return []
        bs = self.block_size
        index = {} if request is None else {h: i for i, h in enumerate(request.block_hashes)}
        if request is None or any(h not in index for h in hashes):
            return [BlockStored(hashes, None, [], bs, None, medium)]
        runs: list[list[int]] = []
        for h in hashes:
            i = index[h]
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        lora_id = request.lora_id or None
        tokens = request.all_token_ids
        return [
            BlockStored(
                block_hashes=[request.block_hashes[i] for i in run],
                parent_block_hash=request.block_hashes[run[0] - 1] if run[0] else None,
                token_ids=list(tokens[run[0] * bs : (run[-1] + 1) * bs]),
                block_size=bs,
                lora_id=lora_id,
                medium=medium,
            )
            for run in runs
        ]

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        for req_id, tokens in output.finished_loading.items():
            from_ram = self._background.pop(req_id, None)
            if from_ram is not None and tokens > from_ram:
                self._add_hits(MEDIUM_DISK, tokens - from_ram)
        if output.stats is not None:
            self._merge(output.stats)

    def _merge(self, stats: KVTransferStats) -> None:
        s = self._stats
        s.load_bytes += stats.load_bytes
        s.load_seconds += stats.load_seconds
        s.save_bytes += stats.save_bytes
        s.save_seconds += stats.save_seconds
        s.failed_loads += stats.failed_loads
        if MEDIUM_DISK in stats.tier_bytes:
            self._disk_level = (
                stats.tier_bytes[MEDIUM_DISK],
                stats.tier_capacity_bytes.get(MEDIUM_DISK, 0),
            )

    def request_finished(
        self, request: Request, block_ids: Sequence[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._forget(request.request_id)
        return False, None

    # ---- reports

    def take_events(self) -> list[KVCacheEvent]:
        events = list(self._events)
        self._events.clear()
        return events

    def take_stats(self) -> KVTransferStats | None:
        stats, self._stats = self._stats, KVTransferStats()
        stats.tier_bytes = {MEDIUM_CPU: self.ram.used_bytes}
        stats.tier_capacity_bytes = {MEDIUM_CPU: self.ram.capacity_bytes}
        if self.disk_stores:
            used, capacity = self._disk_level or (
                self.disk_stores[0].used_bytes,
                self.disk_stores[0].capacity_bytes,
            )
            stats.tier_bytes[MEDIUM_DISK] = used
            stats.tier_capacity_bytes[MEDIUM_DISK] = capacity
        return stats

    def shutdown(self) -> None:
        self._lookups.clear()
        self._requests.clear()
        self._background.clear()
