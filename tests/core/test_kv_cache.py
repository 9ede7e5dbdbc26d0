"""The paged block pool, chained block hashes and the KV cache manager, without a scheduler."""

from __future__ import annotations

import pytest

import baton.kv.hashing as hashing
from baton.kv.block_pool import NULL_BLOCK_ID, BlockPool, FreeBlockQueue, KVBlock
from baton.kv.hashing import ROOT_HASH, hash_block, root_hash, update_block_hashes
from baton.kv.manager import KVCacheManager

from .sched_helpers import make_request

BS = 16


# ----------------------------------------------------------------------------- free queue


def test_free_queue_order_and_o1_removal():
    blocks = [KVBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    assert [b.block_id for b in q] == [0, 1, 2, 3, 4] and len(q) == 5
    q.remove(blocks[2])  # from the middle
    assert [b.block_id for b in q] == [0, 1, 3, 4]
    with pytest.raises(ValueError):
        q.remove(blocks[2])  # not in the queue any more
    q.append(blocks[2])
    q.appendleft(q.popleft())
    assert [b.block_id for b in q] == [0, 1, 3, 4, 2]
    assert [q.popleft().block_id for _ in range(5)] == [0, 1, 3, 4, 2]
    with pytest.raises(IndexError):
        q.popleft()


# ----------------------------------------------------------------------------- block pool


def test_null_block_is_never_handed_out():
    pool = BlockPool(8)
    assert pool.num_usable_blocks == 7 and pool.get_num_free_blocks() == 7
    got = pool.get_new_blocks(7)
    assert NULL_BLOCK_ID not in {b.block_id for b in got}
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)
    pool.free_blocks(got)
    assert pool.get_num_free_blocks() == 7 and pool.usage() == 0.0


def test_lru_eviction_of_cached_blocks():
    pool = BlockPool(5)  # 4 usable
    a, b, c, d = pool.get_new_blocks(4)
    for blk, h in ((a, b"A"), (b, b"B"), (c, b"C")):
        assert pool.cache_full_block(blk, h)
    pool.free_blocks([b, a, c, d])  # d caches nothing -> head; then b, a, c in LRU order
    assert [x.block_id for x in pool.free_queue] == [d.block_id, b.block_id, a.block_id, c.block_id]
    # an uncached block is reused before any cached one
    (x,) = pool.get_new_blocks(1)
    assert x is d and pool.get_cached_block(b"B") is b
    # then the least recently freed cached block is evicted, its entry with it
    (y,) = pool.get_new_blocks(1)
    assert y is b and y.block_hash is None and pool.get_cached_block(b"B") is None
    assert pool.get_cached_block(b"A") is a and pool.get_cached_block(b"C") is c


def test_touch_and_ref_counts():
    pool = BlockPool(4)
    (blk,) = pool.get_new_blocks(1)
    pool.cache_full_block(blk, b"H")
    pool.touch([blk])  # a second request shares it
    assert blk.ref_cnt == 2
    pool.free_blocks([blk])
    assert blk.ref_cnt == 1 and pool.get_num_free_blocks() == 2  # still held
    pool.free_blocks([blk])
    assert blk.ref_cnt == 0 and pool.get_num_free_blocks() == 3
    pool.touch([blk])  # a cache hit on a free block takes it out of the free queue
    assert blk.ref_cnt == 1 and pool.get_num_free_blocks() == 2 and blk not in list(pool.free_queue)


def test_duplicate_hash_is_not_registered_twice():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    assert pool.cache_full_block(a, b"H")
    assert not pool.cache_full_block(b, b"H")
    assert b.block_hash is None and pool.get_cached_block(b"H") is a


def test_reset_prefix_cache_only_when_nothing_is_held():
    pool = BlockPool(4)
    (a,) = pool.get_new_blocks(1)
    pool.cache_full_block(a, b"H")
    assert not pool.reset_prefix_cache()
    assert pool.get_cached_block(b"H") is a
    pool.free_blocks([a])
    assert pool.reset_prefix_cache()
    assert pool.get_cached_block(b"H") is None and a.block_hash is None


def test_reset_prefix_cache_reuses_the_blocks_it_uncached_first():
    """Blocks that cache nothing are taken first, the last cached first: after a reset, the blocks
    just written rather than the pool's never-used ones (whose pages are not mapped yet)."""
    pool = BlockPool(8)
    blocks = pool.get_new_blocks(3)
    assert [b.block_id for b in blocks] == [1, 2, 3]
    for i, blk in enumerate(blocks):
        pool.cache_full_block(blk, bytes([i]))
    pool.free_blocks(blocks)  # cached: to the tail, behind the never-used 4..7
    assert [b.block_id for b in pool.free_queue][:4] == [4, 5, 6, 7]
    assert pool.reset_prefix_cache()
    assert [b.block_id for b in pool.free_queue] == [3, 2, 1, 4, 5, 6, 7]
    assert [b.block_id for b in pool.get_new_blocks(2)] == [3, 2]


def test_evict_drops_lru_entries_first():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(3)
    for i, blk in enumerate(blocks):
        pool.cache_full_block(blk, bytes([i]))
    pool.free_blocks(blocks)
    assert pool.evict(2) == 2
    assert pool.get_cached_block(b"\x00") is None and pool.get_cached_block(b"\x01") is None
    assert pool.get_cached_block(b"\x02") is blocks[2]


# ----------------------------------------------------------------------------- hashing


def test_hash_chaining_and_salt():
    toks = list(range(BS))
    h1 = hash_block(ROOT_HASH, toks)
    assert h1 == hash_block(ROOT_HASH, toks) and len(h1) == 16
    assert hash_block(h1, toks) != h1  # same tokens, different parent
    assert hash_block(ROOT_HASH, toks[::-1]) != h1
    assert hash_block(ROOT_HASH, toks, b"x") != h1  # extra keys count
    assert root_hash("tenant-a") != root_hash("tenant-b") != ROOT_HASH
    a = make_request("a", 40, salt="s1")
    b = make_request("a", 40, salt="s2")
    c = make_request("a", 40)
    for r in (a, b, c):
        update_block_hashes(r, BS)
        assert len(r.block_hashes) == 2
    assert a.block_hashes[0] != b.block_hashes[0] != c.block_hashes[0]
    assert c.block_hashes[1] == hash_block(c.block_hashes[0], c.all_token_ids[BS : 2 * BS])


def test_hashes_are_computed_once_per_block(monkeypatch):
    calls = []
    real = hashing.hash_block
    monkeypatch.setattr(hashing, "hash_block", lambda *a: calls.append(1) or real(*a))
    r = make_request("r", 20)
    hashing.update_block_hashes(r, BS)
    assert len(calls) == 1
    for _ in range(11):  # 20 + 11 = 31 tokens: still one full block
        r.all_token_ids.append(5)
        hashing.update_block_hashes(r, BS)
    assert len(calls) == 1
    r.all_token_ids.append(5)  # 32: the second block fills
    hashing.update_block_hashes(r, BS)
    hashing.update_block_hashes(r, BS)
    assert len(calls) == 2 and len(r.block_hashes) == 2


# ----------------------------------------------------------------------------- manager


def _hashed(rid, prompt, **kw):
    r = make_request(rid, prompt, **kw)
    update_block_hashes(r, BS)
    return r


def _compute(mgr: KVCacheManager, r, n):
    """Allocate and 'compute' n tokens of r, registering full blocks as the scheduler does."""
    hits, num_hit = mgr.get_computed_blocks(r) if r.request_id not in mgr.req_to_blocks else ([], 0)
    new = mgr.allocate_slots(r, n, hits)
    assert new is not None
    r.num_computed_tokens += num_hit + n
    mgr.cache_blocks(r, r.num_computed_tokens)
    return new, num_hit


def test_prefix_hit_allocates_only_the_rest():
    mgr = KVCacheManager(64, BS)
    shared = list(range(1, 33))  # two full blocks
    a = _hashed("a", [*shared, 100, 101, 102])
    new_a, hit_a = _compute(mgr, a, 35)
    assert hit_a == 0 and len(new_a) == 3
    b = _hashed("b", [*shared, 200, 201])
    blocks, num_hit = mgr.get_computed_blocks(b)
    assert num_hit == 32 and [x.block_id for x in blocks] == mgr.get_block_ids("a")[:2]
    new_b = mgr.allocate_slots(b, 2, blocks)
    assert len(new_b) == 1  # only the 2 uncached tokens
    assert mgr.get_block_ids("b")[:2] == mgr.get_block_ids("a")[:2]
    assert all(x.ref_cnt == 2 for x in blocks)
    assert mgr.prefix_cache_queries == 35 + 34 and mgr.prefix_cache_hits == 32
    mgr.free(a)
    assert all(x.ref_cnt == 1 for x in blocks)  # b still holds them


def test_never_the_whole_prompt_is_a_hit():
    mgr = KVCacheManager(64, BS)
    a = _hashed("a", 32)
    _compute(mgr, a, 32)
    b = _hashed("b", a.prompt_token_ids)  # exactly the same two blocks
    _, num_hit = mgr.get_computed_blocks(b)
    assert num_hit == 16  # the last token must be computed to get logits


def test_blocks_register_only_when_computed():
    mgr = KVCacheManager(64, BS)
    a = _hashed("a", 40)
    assert mgr.allocate_slots(a, 20) is not None
    a.num_computed_tokens = 20
    mgr.cache_blocks(a, 20)
    assert len(mgr.pool.cached_block_hash_to_block) == 1  # block 2 is not computed yet
    b = _hashed("b", a.prompt_token_ids)
    assert mgr.get_computed_blocks(b)[1] == 16


def test_allocate_is_atomic_when_blocks_run_out():
    mgr = KVCacheManager(5, BS)  # 4 usable
    a = _hashed("a", 40)
    _compute(mgr, a, 40)  # 3 blocks, 2 cached
    mgr.free(a)
    b = _hashed("b", a.prompt_token_ids + list(range(60)))  # hits 2, needs 5 more (> 2 left)
    hits, num_hit = mgr.get_computed_blocks(b)
    assert num_hit == 32
    free_before = mgr.num_free_blocks
    assert mgr.allocate_slots(b, len(b.all_token_ids) - 32, hits) is None
    assert mgr.num_free_blocks == free_before and "b" not in mgr.req_to_blocks
    assert all(x.ref_cnt == 0 for x in hits) and mgr.prefix_cache_queries == 40


def test_free_puts_the_tail_first_in_line_for_eviction():
    mgr = KVCacheManager(8, BS)
    a = _hashed("a", 48)
    _compute(mgr, a, 48)
    ids = mgr.get_block_ids("a")
    mgr.free(a)
    order = [b.block_id for b in mgr.pool.free_queue if b.block_hash is not None]
    assert order == ids[::-1][: len(order)]


def test_decode_fast_path_and_usage():
    mgr = KVCacheManager(11, BS)  # 10 usable
    a = _hashed("a", 10)
    assert len(mgr.allocate_slots(a, 10)) == 1
    a.num_computed_tokens = 10
    assert mgr.allocate_slots(a, 6) == []  # fits the same block
    a.num_computed_tokens = 16
    assert len(mgr.allocate_slots(a, 1)) == 1
    assert mgr.usage == pytest.approx(0.2) and mgr.num_free_blocks == 8
    assert mgr.reset_prefix_cache() is False
    mgr.free(a)
    assert mgr.usage == 0.0 and mgr.reset_prefix_cache() is True
