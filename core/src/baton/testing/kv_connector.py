"""A reference KV connector for tests: ``memory``, an in-memory tier inside each worker process.

``register_memory_connector()`` makes ``kv_transfer.connector = "memory"`` selectable in this
process (as ``register_fake_executor`` does for executors; ``unregister_memory_connector()``
takes it back); worker processes of a multiprocess
executor see it only through an entry point naming ``baton.testing.kv_connector``.

Its tier is a dict per worker process, keyed by (namespace key, tp rank, pp rank, block hash),
holding real tensors: a block's K and V in every layer the worker holds, copied out of the
runner's cache after the forward that completed it (``finish_step``) and copied back into a
request's blocks before its forward (``start_step``; or in a background thread with
``async_loads``, reported in a later ``finish_step``). The scheduler half keeps the index of
what it ordered saved, so it answers ``get_num_new_matched_tokens`` without asking a worker.

For containment tests, a request's ``kv_transfer_params`` may name a call to fail:
``{"fail": "<call>"}`` with one of ``get_num_new_matched_tokens``, ``update_state_after_alloc``,
``request_finished`` (the scheduler half raises), ``worker`` (the worker half reports the
request in ``failed``), ``start_step`` / ``finish_step`` (the worker half raises in that call of
a step with work for the request).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import msgspec
import pydantic

from baton.kv_transfer.connector import (
    KVConnectorOutput,
    KVSchedulerContext,
    KVStep,
    KVTransferStats,
    KVWorkerContext,
)
from baton.plugins.hookspecs import hookimpl
from baton.plugins.registry import get_plugins

if TYPE_CHECKING:
    import torch

    from baton.protocol import KVCacheSpec
    from baton.request import Request

NAME = "memory"
PLUGIN_NAME = "baton-testing-memory-kv"

#: Every worker process's tier: (namespace key, tp rank, pp rank, block hash) -> its KV, one
#: ``[2, kv_heads, block_size, head_size]`` tensor per layer the worker holds.
TIER: dict[tuple[str, int, int, bytes], list[torch.Tensor]] = {}
_TIER_LOCK = threading.Lock()


class MemorySettings(pydantic.BaseModel):
    """``[kv_transfer.memory]``."""

    model_config = pydantic.ConfigDict(extra="forbid")
    async_loads: bool = False
    """Load in a background thread; the request waits (WAITING_FOR_KV) until it is reported."""
    hold_blocks: bool = True
    """Hold a finished request's blocks until a worker confirms its saves (finished_saving)."""
    load_delay_s: float = pydantic.Field(0.0, ge=0.0, le=10.0)
    """Seconds an asynchronous load waits before it copies (a slow tier, for tests)."""


class _Load(msgspec.Struct, array_like=True):
    req_id: str
    hashes: list[bytes]
    block_ids: list[int]


class _Orders(msgspec.Struct, array_like=True, kw_only=True):
    """One step's orders: the scheduler half's metadata for every worker half."""

    loads: list[_Load] = []
    asynchronous: bool = False
    saves: list[tuple[bytes, int]] = []
    confirm: list[str] = []  # finished requests whose held blocks may go once this step ran
    fail: dict[str, str] = {}  # req id -> the worker call to fail


def _fail_on(request: Request, call: str) -> None:
    params = request.kv_transfer_params
    if params is not None and params.get("fail") == call:
        raise RuntimeError(f"injected failure in {call} for request {request.request_id!r}")


class MemoryScheduler:
    """The scheduler half: an index of the blocks saved, the step's orders."""

    def __init__(self, context: KVSchedulerContext, settings: MemorySettings) -> None:
        self.context = context
        self.settings = settings
        self.block_size = context.namespace.block_size
        self.stored: set[bytes] = set()
        self._loads: list[_Load] = []
        self._confirm: list[str] = []
        self._fail: dict[str, str] = {}
        self._hits = self._saved_blocks = 0
        ns = context.namespace
        self._block_bytes = 2 * ns.num_layers * ns.num_kv_heads * ns.block_size * ns.head_size

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        _fail_on(request, "get_num_new_matched_tokens")
        start = num_computed_tokens // self.block_size
        n = 0
        for h in request.block_hashes[start:]:
            if h not in self.stored:
                break
            n += 1
        return n * self.block_size, self.settings.async_loads

    def update_state_after_alloc(
        self, request: Request, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        _fail_on(request, "update_state_after_alloc")
        params = request.kv_transfer_params or {}
        if params.get("fail") in ("worker", "start_step", "finish_step"):
            self._fail[request.request_id] = params["fail"]
        if not num_external_tokens:
            return
        first = request.num_computed_tokens // self.block_size
        k = num_external_tokens // self.block_size
        self._loads.append(
            _Load(
                request.request_id,
                list(request.block_hashes[first : first + k]),
                list(block_ids[first : first + k]),
            )
        )
        self._hits += num_external_tokens

    def build_connector_meta(self, step: KVStep) -> bytes:
        saves = []
        for refs in step.new_full_blocks.values():
            for ref in refs:
                if ref.block_hash not in self.stored:
                    self.stored.add(ref.block_hash)
                    saves.append((ref.block_hash, ref.block_id))
        self._saved_blocks += len(saves)
        orders = _Orders(
            loads=self._loads,
            asynchronous=self.settings.async_loads,
            saves=saves,
            confirm=self._confirm,
            fail=self._fail,
        )
        self._loads, self._confirm, self._fail = [], [], {}
        return msgspec.msgpack.encode(orders)

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """Nothing to learn: the index already holds what the orders saved."""

    def request_finished(
        self, request: Request, block_ids: Sequence[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        _fail_on(request, "request_finished")
        stored = sum(1 for h in request.block_hashes if h in self.stored)
        if self.settings.hold_blocks:
            self._confirm.append(request.request_id)
        return self.settings.hold_blocks, {"memory_blocks": stored}

    def take_events(self) -> list[Any]:
        return []

    def take_stats(self) -> KVTransferStats | None:
        stats = KVTransferStats(
            hit_tokens={"CPU": self._hits} if self._hits else {},
            save_bytes=self._saved_blocks * self._block_bytes,
            tier_bytes={"CPU": len(self.stored) * self._block_bytes},
        )
        self._hits = self._saved_blocks = 0
        return stats

    def shutdown(self) -> None:
        """Nothing to release."""


class MemoryWorker:
    """The worker half: copies blocks between the runner's cache and this process's TIER."""

    def __init__(self, context: KVWorkerContext, load_delay_s: float = 0.0) -> None:
        self.prefix = (context.namespace.key, context.tp_rank, context.pp_rank)
        self.load_delay_s = load_delay_s
        self.caches: list[torch.Tensor] = []
        self._orders = _Orders()
        self._done: dict[str, int] = {}  # asynchronous loads finished, not yet reported
        self._done_lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    def register_kv_caches(self, kv_caches: Sequence[torch.Tensor], spec: KVCacheSpec) -> None:
        self.caches = list(kv_caches)

    def start_step(self, metadata: bytes) -> None:
        self._orders = orders = msgspec.msgpack.decode(metadata, type=_Orders)
        if "start_step" in orders.fail.values():
            raise RuntimeError("injected failure in start_step")
        for load in orders.loads:
            if not orders.asynchronous:
                self._load(load)
                continue
            thread = threading.Thread(target=self._load_async, args=(load,), daemon=True)
            thread.start()
            self._threads.append(thread)

    def _load(self, load: _Load) -> int:
        """Copy the load's blocks into the cache, up to the first one missing; tokens loaded."""
        n = 0
        for h, block_id in zip(load.hashes, load.block_ids, strict=True):
            with _TIER_LOCK:
                layers = TIER.get((*self.prefix, h))
            if layers is None:
                break
            for cache, saved in zip(self.caches, layers, strict=True):
                cache[:, block_id].copy_(saved)
            n += 1
        return n * (self.caches[0].shape[3] if self.caches else 0)

    def _load_async(self, load: _Load) -> None:
        time.sleep(self.load_delay_s)
        n = self._load(load)
        with self._done_lock:
            self._done[load.req_id] = n

    def finish_step(self) -> KVConnectorOutput | None:
        orders = self._orders
        if "finish_step" in orders.fail.values():
            raise RuntimeError("injected failure in finish_step")
        for h, block_id in orders.saves:
            layers = [cache[:, block_id].clone() for cache in self.caches]
            with _TIER_LOCK:
                TIER[(*self.prefix, h)] = layers
        self._threads = [t for t in self._threads if t.is_alive()]
        with self._done_lock:
            done, self._done = self._done, {}
        failed = {
            rid: "injected failure in the worker half"
            for rid, c in orders.fail.items()
            if c == "worker"
        }
        self._orders = _Orders()
        if not (done or orders.confirm or failed):
            return None
        return KVConnectorOutput(
            finished_loading=done, finished_saving=list(orders.confirm), failed=failed
        )

    def shutdown(self) -> None:
        for thread in self._threads:
            thread.join(timeout=5)


class MemoryConnector:
    """The ``memory`` connector: the maker of its two halves."""

    def __init__(self, settings: MemorySettings | None) -> None:
        self.settings = settings or MemorySettings()

    def scheduler_side(self, context: KVSchedulerContext) -> MemoryScheduler:
        return MemoryScheduler(context, self.settings)

    def worker_side(self, context: KVWorkerContext) -> MemoryWorker:
        return MemoryWorker(context, self.settings.load_delay_s)


def create_memory_connector(config: Any, settings: MemorySettings | None) -> MemoryConnector:
    return MemoryConnector(settings)


@hookimpl
def register_kv_connectors(register: Any) -> None:
    """This module's hook (``register_memory_connector``, or an entry point naming it)."""
    register(NAME, create_memory_connector, MemorySettings)


def register_memory_connector(plugins: Any = None) -> None:
    """Make ``kv_transfer.connector = "memory"`` selectable in ``plugins`` (default: the
    process-wide one). Idempotent."""
    if plugins is None:
        plugins = get_plugins()
    if plugins.pm.has_plugin(PLUGIN_NAME):
        return
    plugins.register(sys.modules[__name__], PLUGIN_NAME, "baton-core", "0")


def unregister_memory_connector(plugins: Any = None) -> None:
    """Undo ``register_memory_connector`` (a process that spawns engines afterwards must not
    carry a plugin its children lack). Idempotent."""
    if plugins is None:
        plugins = get_plugins()
    if plugins.pm.has_plugin(PLUGIN_NAME):
        plugins.unregister(PLUGIN_NAME)
