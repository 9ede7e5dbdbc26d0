"""The built-in ``offload`` KV connector: a RAM tier and an optional disk tier behind the pool.

A block the engine computes is copied at once into the workers' RAM tier (``cpu_memory``, least
recently used dropped first) and written behind to the disk tier (``disk_path``,
``disk_memory``), which outlives the engine and may be shared by several engines. A request's
block-hash chain is looked up in RAM, then on disk: RAM hits load before the request's first
forward, disk hits in a background thread while the request waits. Keys hold the model's KV
namespace and the worker's shard, so blocks of another model, dtype, block size or layout are
never read; a bad disk block is deleted and recomputed, never served.

Modules: ``settings`` (``[kv_transfer.offload]``), ``layout`` (block sizes, shard keys),
``ram_tier`` (LRU by bytes), ``disk_tier`` (``BlockFileStore``, reusable), ``disk_writer``,
``orders`` (what the scheduler half tells the workers), ``scheduler_half``, ``worker_half``,
``connector`` (the factory and its registration).
"""

from baton.kv_transfer.offload.connector import OffloadConnector
from baton.kv_transfer.offload.disk_tier import BlockFileStore
from baton.kv_transfer.offload.settings import OffloadSettings

__all__ = ["BlockFileStore", "OffloadConnector", "OffloadSettings"]
