"""A read-only snapshot of the KV-cache books, for tests and policies.

``KVCacheManager.view()`` copies what the pool and the manager know into
immutable values: changing the cache afterwards does not change a view, and a
view cannot change the cache. Taking one costs O(blocks), so it is meant for
tests, debugging and policies that look now and then, not for every step.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from baton.kv.hashing import BlockHash


@dataclass(frozen=True)
class KVCacheView:
    """The KV-cache books at one moment. Block ids index ``ref_cnts``; block 0 is the null block."""

    block_size: int
    #: Blocks requests can hold (the null block excluded).
    num_usable_blocks: int
    #: Free blocks in eviction order: the first is the next one allocated (losing its cache
    #: entry, if any). A freed block that caches nothing goes first, a cached one last.
    free_block_ids: tuple[int, ...]
    #: References per block id (how many requests hold it); the null block's is 1, forever.
    ref_cnts: tuple[int, ...]
    #: Block id -> hash, for every block registered in the prefix cache (held or free).
    block_hashes: Mapping[int, BlockHash]
    #: Request id -> its block table, for every request that holds blocks.
    req_block_ids: Mapping[str, tuple[int, ...]]

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def cached_free_block_ids(self) -> tuple[int, ...]:
        """Free blocks that still cache a prefix, in eviction order."""
        return tuple(b for b in self.free_block_ids if b in self.block_hashes)
