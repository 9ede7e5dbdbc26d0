"""Structs the KV-connector seam passes between its halves, the kernel and the stat loggers."""

from __future__ import annotations

from typing import Literal

import msgspec

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


class KVTransferStats(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A connector's figures since it was last asked (``SchedulerStats.kv_transfer``).

    Token and byte counts are deltas; ``tier_bytes`` / ``tier_capacity_bytes`` are levels.
    Tiers are named by their ``medium`` as in KV events (``CPU``, ``DISK``, ...).
    """

    hit_tokens: dict[str, int] = msgspec.field(default_factory=dict)  # tier -> tokens served
    load_bytes: int = 0
    load_seconds: float = 0.0
    save_bytes: int = 0
    save_seconds: float = 0.0
    failed_loads: int = 0  # blocks found bad or missing when loading (then recomputed)
    tier_bytes: dict[str, int] = msgspec.field(default_factory=dict)
    tier_capacity_bytes: dict[str, int] = msgspec.field(default_factory=dict)


class KVConnectorOutput(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What a worker's connector half reports after a step (``ModelRunnerOutput.kv_connector``).

    With several workers the kernel merges their reports: a load counts as finished once every
    worker finished it, with the fewest tokens any worker loaded.
    """

    #: request id -> tokens loaded (from the first token the load was asked for); fewer than
    #: asked means a block was missing or bad: the rest is recomputed, never served.
    finished_loading: dict[str, int] = msgspec.field(default_factory=dict)
    #: requests whose blocks, held after they finished (``request_finished`` returned True),
    #: are saved and may be freed.
    finished_saving: list[str] = msgspec.field(default_factory=list)
    #: request id -> message: the connector failed this request (the request fails, not the engine).
    failed: dict[str, str] = msgspec.field(default_factory=dict)
    stats: KVTransferStats | None = None
