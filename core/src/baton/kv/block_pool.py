"""The paged KV block pool: blocks, the LRU free-block queue, the prefix-cache index.

A block is a fixed number of token slots in every layer's KV cache on the
workers; here it is only bookkeeping (no torch). A free block with a hash is
still a valid prefix-cache entry: it stays in the free queue, and is reused
(evicted) only when it reaches the head.

Block 0 is reserved as the null block: never allocated, never freed. Model
runners can pad block tables with 0 and point padding slots at it.

With KV events on (``kv_events``), the pool records a BlockRemoved for every cache entry it
drops and AllBlocksCleared on a reset (``baton.kv.events``; the manager records BlockStored,
which needs the request's tokens); off, ``kv_events`` is None and nothing is recorded.
"""

from __future__ import annotations

from collections.abc import Iterable

from baton.kv.events import MEDIUM_POOL, AllBlocksCleared, BlockRemoved, KVCacheEvent
from baton.kv.hashing import BlockHash

NULL_BLOCK_ID = 0


class KVBlock:
    """One block's books: who holds it (ref_cnt), what it caches (block_hash), free-list links."""

    __slots__ = ("block_hash", "block_id", "next_free", "prev_free", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        #: Set while the block is registered in the prefix cache (full and computed).
        self.block_hash: BlockHash | None = None
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref_cnt={self.ref_cnt}, cached={self.block_hash is not None})"


class FreeBlockQueue:
    """Free blocks as a doubly linked list threaded through the blocks themselves.

    The head is the least recently freed block (taken first); freed blocks go to
    the tail, so cached blocks are evicted in LRU order. ``remove`` unlinks a
    block from the middle in O(1) (a cache hit on a free block). No Python
    object is allocated per operation.
    """

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        self._head = KVBlock(-1)  # sentinels: no None checks on the hot path
        self._tail = KVBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise IndexError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"{block!r} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def append(self, block: KVBlock) -> None:
        """Insert at the tail: evicted last."""
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free += 1

    def appendleft(self, block: KVBlock) -> None:
        """Insert at the head: reused first (blocks that cache nothing)."""
        first = self._head.next_free
        assert first is not None
        first.prev_free = block
        block.next_free = first
        block.prev_free = self._head
        self._head.next_free = block
        self.num_free += 1

    def __len__(self) -> int:
        return self.num_free

    def __iter__(self):
        block = self._head.next_free
        while block is not self._tail and block is not None:
            yield block
            block = block.next_free


class BlockPool:
    """All blocks, the free queue, and the prefix-cache index (hash -> block).

    ``num_blocks`` includes the null block 0, so ``num_blocks - 1`` are usable.
    """

    def __init__(
        self, num_blocks: int, enable_caching: bool = True, enable_kv_cache_events: bool = False
    ) -> None:
        if num_blocks < 2:
            raise ValueError(
                f"num_blocks must be >= 2 (block 0 is the null block), got {num_blocks}"
            )
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[NULL_BLOCK_ID]
        self.null_block.ref_cnt = 1  # held forever
        self.free_queue = FreeBlockQueue(self.blocks[1:])
        self.cached_block_hash_to_block: dict[BlockHash, KVBlock] = {}
        #: Events since the last ``take_events``, oldest first; None: events off.
        self.kv_events: list[KVCacheEvent] | None = [] if enable_kv_cache_events else None

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    def get_num_free_blocks(self) -> int:
        """Blocks that can be allocated now, cached-but-unused ones included."""
        return self.free_queue.num_free

    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        return self.cached_block_hash_to_block.get(block_hash)

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        """Take ``n`` blocks from the head of the free queue (evicting their cache entries)."""
        if n > self.free_queue.num_free:
            raise ValueError(f"cannot allocate {n} blocks, {self.free_queue.num_free} free")
        popleft = self.free_queue.popleft
        out = []
        for _ in range(n):
            block = popleft()
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference to cached blocks (a prefix hit); free ones leave the free queue."""
        remove = self.free_queue.remove
        for block in blocks:
            if block.ref_cnt == 0:
                remove(block)
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block, in the given order (first freed = evicted first).

        A block reaching ref_cnt 0 goes to the tail of the free queue when it
        caches something, to the head when it does not (it is worth nothing).
        """
        q = self.free_queue
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    q.appendleft(block)
                else:
                    q.append(block)

    def cache_full_block(self, block: KVBlock, block_hash: BlockHash) -> bool:
        """Register a full, computed block under its hash; False if that hash is cached already."""
        index = self.cached_block_hash_to_block
        if block.block_hash is not None or block_hash in index:
            return False
        block.block_hash = block_hash
        index[block_hash] = block
        return True

    def _evict(self, block: KVBlock) -> None:
        block_hash = block.block_hash
        if self.cached_block_hash_to_block.get(block_hash) is block:  # type: ignore[arg-type]
            del self.cached_block_hash_to_block[block_hash]  # type: ignore[arg-type]
            if self.kv_events is not None:
                self._record_removed(block_hash)  # type: ignore[arg-type]
        block.block_hash = None

    def _record_removed(self, block_hash: BlockHash) -> None:
        """A BlockRemoved for ``block_hash``; consecutive removals share one event."""
        events = self.kv_events
        assert events is not None
        last = events[-1] if events else None
        if type(last) is BlockRemoved:
            last.block_hashes.append(block_hash)
        else:
            events.append(BlockRemoved(block_hashes=[block_hash], medium=MEDIUM_POOL))

    def take_events(self) -> list[KVCacheEvent]:
        """The events recorded since the last call, oldest first ([] when events are off)."""
        events = self.kv_events
        if not events:
            return []
        self.kv_events = []
        return events

    def evict(self, n: int) -> int:
        """Drop up to ``n`` cache entries of free blocks, least recently used first; returns how many."""
        done = 0
        for block in list(self.free_queue):
            if done >= n:
                break
            if block.block_hash is not None:
                self._evict(block)
                done += 1
        return done

    def reset_prefix_cache(self) -> bool:
        """Forget every cache entry; refused (False) while any request holds blocks."""
        if self.free_queue.num_free != self.num_usable_blocks:
            return False
        # Each now caches nothing, so it goes to the head as free_blocks places such blocks, the
        # last cached first: their pages are written and mapped, where the pool's never-used blocks
        # each fault fresh pages in (a request run after every reset, as `baton bench latency`
        # does, took new memory each time: 2.7% of a 100-token prefill in the kernel zeroing it)
        q = self.free_queue
        for block in self.cached_block_hash_to_block.values():
            block.block_hash = None
            q.remove(block)
            q.appendleft(block)
        self.cached_block_hash_to_block.clear()
        if self.kv_events is not None:
            self.kv_events.append(AllBlocksCleared())
        return True

    def usage(self) -> float:
        """Fraction of usable blocks held by requests (cached-but-free blocks count as free)."""
        return 1.0 - self.free_queue.num_free / self.num_usable_blocks
