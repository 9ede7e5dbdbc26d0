"""KVCacheManager: which blocks each request holds, prefix-cache lookups, allocation.

The scheduler's only window on the block pool. Requests are keyed by id; the
manager keeps each one's block list and the parallel list of block ids the
model runner sees. Blocks are registered in the prefix cache once their tokens
are computed (``cache_blocks``, called after the step that computed them ran),
so a cache hit never points at KV a forward pass has yet to write.

With KV events on, each registration records a BlockStored (its blocks' hashes, the hash of the
block before them, their tokens, the request's LoRA id); ``take_events`` hands over what the
pool and the manager recorded since the last call.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import TYPE_CHECKING

from baton.kv.block_pool import BlockPool, KVBlock
from baton.kv.events import MEDIUM_POOL, BlockStored, KVCacheEvent
from baton.kv.view import KVCacheView

if TYPE_CHECKING:
    from baton.request import Request

_NO_BLOCKS: list[KVBlock] = []


class KVCacheManager:
    """Paged KV books for all requests. ``num_blocks`` includes the null block 0."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        enable_kv_cache_events: bool = False,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching, enable_kv_cache_events)
        self.req_to_blocks: dict[str, list[KVBlock]] = {}
        self.req_to_block_ids: dict[str, list[int]] = {}
        #: How many of a request's leading blocks are registered in the prefix cache.
        self.num_cached_blocks: dict[str, int] = {}
        # prefix-cache figures in tokens; cumulative (the scheduler takes deltas)
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # ---------------------------------------------------------------- lookups

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """The longest cached prefix of the request's full blocks, and how many tokens it covers.

        Never the whole sequence: the last token is always left to compute, so
        the step produces logits to sample from. None for a request that must compute
        every token (``skip_reading_prefix_cache``: mean or cls pooling). Takes no reference
        yet (that happens in ``allocate_slots``) and counts no statistics.
        """
        if request.request_id in self.req_to_blocks:
            return _NO_BLOCKS, request.num_computed_tokens  # a fork: it holds its prefix's blocks
        if not self.enable_caching or request.skip_reading_prefix_cache:
            return _NO_BLOCKS, 0
        if request.sampling_params.prompt_logprobs is not None and not request.num_output_tokens:
            return _NO_BLOCKS, 0  # its prompt's logits are needed: computed, not read (vLLM's)
        hashes = request.block_hashes
        max_blocks = min(len(hashes), (len(request.all_token_ids) - 1) // self.block_size)
        lookup = self.pool.cached_block_hash_to_block.get
        hits: list[KVBlock] = []
        for i in range(max_blocks):
            block = lookup(hashes[i])
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table (the manager's own list: copy before handing it out)."""
        return self.req_to_block_ids.get(request_id, [])

    # ------------------------------------------------------------- allocation

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVBlock] | None = None,
    ) -> list[int] | None:
        """Make room for ``num_new_tokens`` more tokens after the computed ones.

        ``new_computed_blocks`` are prefix-cache hits from ``get_computed_blocks``
        (only for a request that holds no blocks yet); their tokens count as
        computed on top of ``request.num_computed_tokens``. Returns the ids of
        the newly allocated blocks (hits excluded), or None when too few blocks
        are free, in which case nothing changed.
        """
        req_id = request.request_id
        bs = self.block_size
        blocks = self.req_to_blocks.get(req_id)
        num_held = 0 if blocks is None else len(blocks)
        num_hits = 0 if not new_computed_blocks else len(new_computed_blocks)
        total = request.num_computed_tokens + num_hits * bs + num_new_tokens
        need = (total + bs - 1) // bs - num_held - num_hits
        if need <= 0 and not num_hits:
            # the decode fast path: the last block still has room
            return []
        pool = self.pool
        free = pool.free_queue.num_free
        if num_hits:
            # hits sitting in the free queue stop being allocatable once touched
            free -= sum(1 for b in new_computed_blocks if b.ref_cnt == 0)  # type: ignore[union-attr]
        if need > free:
            return None
        if blocks is None:
            blocks = self.req_to_blocks[req_id] = []
            self.req_to_block_ids[req_id] = []
            self.num_cached_blocks[req_id] = 0
            self.prefix_cache_queries += len(request.all_token_ids)
            self.prefix_cache_hits += num_hits * bs
        ids = self.req_to_block_ids[req_id]
        if num_hits:
            pool.touch(new_computed_blocks)  # type: ignore[arg-type]
            blocks.extend(new_computed_blocks)  # type: ignore[arg-type]
            ids.extend([b.block_id for b in new_computed_blocks])  # type: ignore[union-attr]
            # hits are registered already
            self.num_cached_blocks[req_id] = num_held + num_hits
        if need <= 0:
            return []
        new = pool.get_new_blocks(need)
        new_ids = [b.block_id for b in new]
        blocks.extend(new)
        ids.extend(new_ids)
        return new_ids

    def fork(self, parent_id: str, child_id: str, num_tokens: int) -> list[tuple[int, int]] | None:
        """Give ``child_id`` the KV of ``parent_id``'s first ``num_tokens`` tokens (copy-on-write).

        The parent's full blocks are shared (one more reference each); its partial last block,
        which the child will write into, is copied into one new block. Returns the block copies
        to make, (source id, destination id): [] or one; None when no block is free for the
        copy, in which case nothing changed.
        """
        if child_id in self.req_to_blocks:
            raise ValueError(
                f"request {child_id!r} already holds KV blocks; it cannot be forked into"
            )
        parent = self.req_to_blocks.get(parent_id)
        full, partial = divmod(num_tokens, self.block_size)
        if parent is None or len(parent) < full + (partial > 0):
            raise ValueError(
                f"request {parent_id!r} holds no KV blocks for {num_tokens} tokens to fork"
            )
        pool = self.pool
        if partial and not pool.free_queue.num_free:
            return None
        shared = parent[:full]
        pool.touch(shared)  # held by the parent: only their reference counts change
        blocks = list(shared)
        copies: list[tuple[int, int]] = []
        if partial:
            (copy,) = pool.get_new_blocks(1)
            blocks.append(copy)
            copies.append((parent[full].block_id, copy.block_id))
        self.req_to_blocks[child_id] = blocks
        self.req_to_block_ids[child_id] = [b.block_id for b in blocks]
        self.num_cached_blocks[child_id] = min(self.num_cached_blocks[parent_id], full)
        return copies

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the request's full blocks whose tokens are all computed (and hashed)."""
        req_id = request.request_id
        done = self.num_cached_blocks.get(req_id)
        if done is None:
            return
        upto = min(num_computed_tokens // self.block_size, len(request.block_hashes))
        if upto <= done:
            return
        blocks = self.req_to_blocks[req_id]
        hashes = request.block_hashes
        if self.pool.kv_events is not None:
            self._cache_blocks_recording(request, blocks, done, upto)
        else:
            cache = self.pool.cache_full_block
            for i in range(done, upto):
                cache(blocks[i], hashes[i])
        self.num_cached_blocks[req_id] = upto

    def _cache_blocks_recording(
        self, request: Request, blocks: list[KVBlock], start: int, stop: int
    ) -> None:
        """``cache_blocks`` with events: one BlockStored per run of blocks that entered the cache.

        A block whose hash is cached already (the same prefix computed by another request at the
        same time) enters nothing and was announced before: it ends a run, and the next run names
        it as its parent.
        """
        hashes = request.block_hashes
        cache = self.pool.cache_full_block
        run_start = -1
        for i in range(start, stop):
            if cache(blocks[i], hashes[i]):
                if run_start < 0:
                    run_start = i
            elif run_start >= 0:
                self._record_stored(request, run_start, i)
                run_start = -1
        if run_start >= 0:
            self._record_stored(request, run_start, stop)

    def _record_stored(self, request: Request, start: int, stop: int) -> None:
        """A BlockStored for the request's blocks ``start .. stop - 1``."""
        events = self.pool.kv_events
        assert events is not None
        bs = self.block_size
        lora = request.lora_request
        events.append(
            BlockStored(
                block_hashes=request.block_hashes[start:stop],
                parent_block_hash=request.block_hashes[start - 1] if start else None,
                token_ids=request.all_token_ids[start * bs : stop * bs],
                block_size=bs,
                lora_id=None if lora is None else lora.lora_int_id,
                medium=MEDIUM_POOL,
            )
        )

    def take_events(self) -> list[KVCacheEvent]:
        """The KV events recorded since the last call, oldest first; [] when events are off."""
        return self.pool.take_events()

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first so a sequence's tail is evicted before its head."""
        req_id = request.request_id
        blocks = self.req_to_blocks.pop(req_id, None)
        if blocks is None:
            return
        del self.req_to_block_ids[req_id]
        del self.num_cached_blocks[req_id]
        self.pool.free_blocks(reversed(blocks))

    def reset_prefix_cache(self) -> bool:
        """Forget all cached blocks; False (and nothing done) while requests hold blocks."""
        return self.pool.reset_prefix_cache()

    def view(self) -> KVCacheView:
        """A read-only snapshot of the books (free queue order, references, hashes, tables)."""
        pool = self.pool
        return KVCacheView(
            block_size=self.block_size,
            num_usable_blocks=pool.num_usable_blocks,
            free_block_ids=tuple(b.block_id for b in pool.free_queue),
            ref_cnts=tuple(b.ref_cnt for b in pool.blocks),
            block_hashes=MappingProxyType(
                {b.block_id: b.block_hash for b in pool.blocks if b.block_hash is not None}
            ),
            req_block_ids=MappingProxyType(
                {rid: tuple(ids) for rid, ids in self.req_to_block_ids.items()}
            ),
        )

    # ------------------------------------------------------------------ stats

    @property
    def num_free_blocks(self) -> int:
        return self.pool.free_queue.num_free

    @property
    def num_total_blocks(self) -> int:
        """Usable blocks (the null block excluded)."""
        return self.pool.num_usable_blocks

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests, 0..1."""
        return self.pool.usage()

    def can_fit(self, num_tokens: int) -> bool:
        """Whether one request of ``num_tokens`` tokens fits in the whole cache."""
        return (num_tokens + self.block_size - 1) // self.block_size <= self.pool.num_usable_blocks
