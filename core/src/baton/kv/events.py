"""KV cache events: which blocks an engine (or a connector's tier) stored or dropped.

The wire format is vLLM's (``vllm.distributed.kv_events``), so a KV-aware router written for
vLLM reads baton's events unchanged: msgpack of array-like, tagged structs; a
``KVEventBatch`` per publish. ``medium`` names where the block lives: ``GPU`` is vLLM's name for
the engine's own pool (baton says ``GPU`` for it on every device, for the routers that filter on
it), ``CPU`` and ``DISK`` a connector's tiers.
"""

from __future__ import annotations

from typing import Any

import msgspec

#: A block hash as the events carry it: baton's 16-byte blake2b digest in the engine; on the wire
#: its low 64 bits as an int by default (vLLM's default), or the bytes (``kv_events.int_block_hashes``).
ExternalBlockHash = bytes | int

MEDIUM_POOL = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_DISK = "DISK"


def int_block_hash(block_hash: ExternalBlockHash) -> int:
    """A digest's low 64 bits as vLLM's integer block hash (its last 8 bytes, big-endian)."""
    if isinstance(block_hash, int):
        return block_hash
    return int.from_bytes(block_hash[-8:], "big")


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float  # time.time() when the batch was made
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base class of the KV cache events."""


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
