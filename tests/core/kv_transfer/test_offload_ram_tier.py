"""LRUBytes: the RAM tier's LRU map counted in bytes."""

from __future__ import annotations

import pytest

from baton.kv_transfer.offload.ram_tier import LRUBytes


def test_evicts_least_recently_used_by_bytes() -> None:
    lru: LRUBytes[str, int] = LRUBytes(10)
    assert lru.put("a", 1, 4) == []
    assert lru.put("b", 2, 4) == []
    assert lru.get("a") == 1  # a is now the most recent
    assert lru.put("c", 3, 4) == [("b", 2)]
    assert list(lru) == ["a", "c"] and lru.used_bytes == 8
    assert lru.put("d", 4, 6) == [("a", 1)]  # 6 more bytes need a (4) gone
    assert list(lru) == ["c", "d"] and lru.used_bytes == 10


def test_replacing_an_entry_and_too_large_ones() -> None:
    lru: LRUBytes[str, int] = LRUBytes(10)
    lru.put("a", 1, 4)
    lru.put("a", 5, 6)
    assert lru.used_bytes == 6 and lru.get("a") == 5
    assert lru.put("huge", 9, 11) == [("huge", 9)]
    assert "huge" not in lru and lru.used_bytes == 6
    assert lru.evictions_for(5) == ["a"]
    assert lru.pop("a") == 5 and lru.used_bytes == 0 and lru.pop("a") is None


def test_two_copies_fed_the_same_operations_agree() -> None:
    mirror: LRUBytes[int, None] = LRUBytes(30)
    store: LRUBytes[int, str] = LRUBytes(30)
    for step in range(200):
        key = (step * 7) % 13
        if step % 3 == 0:
            assert mirror.touch(key) == (store.get(key) is not None)
        else:
            evicted = [k for k, _ in mirror.put(key, None, 4)]
            assert [k for k, _ in store.put(key, str(key), 4)] == evicted
        assert list(mirror) == list(store)


def test_negative_capacity_refused() -> None:
    with pytest.raises(ValueError, match="capacity_bytes"):
        LRUBytes(-1)
