"""Structs the KV-connector seam passes between its halves, the kernel and the stat loggers.

``KVConnectorOutput`` and ``KVTransferStats`` cross process boundaries inside
``ModelRunnerOutput`` and ``SchedulerStats``, so they are defined in ``baton.protocol`` (the
layer below) and re-exported here.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from baton.protocol import KVConnectorOutput, KVTransferStats

#: What an engine does with a connector: ``producer`` only saves, ``consumer`` only loads,
#: ``both`` does both (a tiered cache).
KVRole = Literal["both", "producer", "consumer"]


class KVNamespace(msgspec.Struct, frozen=True, kw_only=True):
    """What must match for two engines' KV blocks to be interchangeable.

    The kernel builds it from the loaded model; a connector keys every block it stores with
    ``key`` (plus the block hash, which already covers the prefix, the cache salt and the
    LoRA adapter) and its worker's shard, so a tier written by another model, KV dtype,
    block size or parallel layout is never read.
    """

    model: str  # the resolved model folder and the identity of its weights
    kv_dtype: str  # a torch dtype name
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_size: int
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    key: str = ""  # hex digest of all the above; set by ``baton.kv_transfer.namespace``


__all__ = ["KVConnectorOutput", "KVNamespace", "KVRole", "KVTransferStats"]
