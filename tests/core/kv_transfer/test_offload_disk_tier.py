"""BlockFileStore (the offload connector's disk tier) with real files."""

from __future__ import annotations

import logging
import os
import subprocess
import threading
from pathlib import Path

import pytest
import torch

from baton.kv_transfer.offload.disk_tier import SUFFIX, BlockFileStore

SHAPE = [3, 2, 2, 4, 8]  # layers, K/V, heads, block size, head size


def block(seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(SHAPE, generator=g).to(dtype)


def h(i: int) -> bytes:
    return i.to_bytes(16, "big")


def file_size(store: BlockFileStore) -> int:
    store.put(h(10_000), block(0))
    size = store.path_of(h(10_000)).stat().st_size
    store.remove(h(10_000))
    return size


def test_round_trip_exact_and_atomic_names(tmp_path: Path) -> None:
    store = BlockFileStore(tmp_path, 1 << 20, "ns-a")
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        t = block(1, dtype)
        assert store.put(h(1), t)
        got = store.get(h(1), SHAPE, dtype)
        assert got is not None and got.dtype == dtype and torch.equal(got, t)
    assert h(1) in store and h(2) not in store
    assert store.get(h(2)) is None
    # only the final file remains: the temporary one was renamed into place
    assert sorted(p.name for p in store.dir.iterdir()) == [h(1).hex() + SUFFIX]


def test_expected_shape_or_dtype_mismatch_is_a_miss(tmp_path: Path) -> None:
    store = BlockFileStore(tmp_path, 1 << 20, "ns-a")
    store.put(h(1), block(1))
    assert store.get(h(1), [3, 2, 2, 4, 4], torch.float32) is None
    assert store.failed_loads == 1 and h(1) not in store


@pytest.mark.parametrize("where", ["payload", "header", "checksum-region"])
def test_corrupt_byte_is_a_miss_and_deleted(tmp_path: Path, where: str) -> None:
    store = BlockFileStore(tmp_path, 1 << 20, "ns-a")
    store.put(h(1), block(1))
    path = store.path_of(h(1))
    data = bytearray(path.read_bytes())
    offset = {"payload": len(data) - 5, "header": 20, "checksum-region": len(data) // 2}[where]
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))
    assert store.get(h(1), SHAPE, torch.float32) is None
    assert not path.exists()
    assert store.failed_loads == 1


@pytest.mark.parametrize("keep", [0, 5, 14, -1])
def test_truncated_file_is_a_miss_and_deleted(tmp_path: Path, keep: int) -> None:
    store = BlockFileStore(tmp_path, 1 << 20, "ns-a")
    store.put(h(1), block(1))
    path = store.path_of(h(1))
    data = path.read_bytes()
    path.write_bytes(data[:keep])
    assert store.get(h(1), SHAPE, torch.float32) is None
    assert not path.exists() and store.failed_loads == 1


def test_trailing_garbage_is_a_miss(tmp_path: Path) -> None:
    store = BlockFileStore(tmp_path, 1 << 20, "ns-a")
    store.put(h(1), block(1))
    with open(store.path_of(h(1)), "ab") as f:
        f.write(b"x")
    assert store.get(h(1)) is None and store.failed_loads == 1


def test_wrong_namespace_is_never_read(tmp_path: Path) -> None:
    a = BlockFileStore(tmp_path, 1 << 20, "model-a-tp0-pp0")
    b = BlockFileStore(tmp_path, 1 << 20, "model-b-tp0-pp0")
    a.put(h(1), block(1))
    assert h(1) not in b and b.get(h(1)) is None
    # a file copied into another namespace's folder is refused by its header, and deleted
    os.replace(a.path_of(h(1)), b.path_of(h(1)))
    assert b.get(h(1)) is None and b.failed_loads == 1 and not b.path_of(h(1)).exists()
    # a file renamed to another block's name too
    a.put(h(2), block(2))
    os.replace(a.path_of(h(2)), a.path_of(h(3)))
    assert a.get(h(3)) is None and a.failed_loads == 1


def test_lru_by_bytes_evicts_least_recently_used_files(tmp_path: Path) -> None:
    probe = BlockFileStore(tmp_path / "probe", 1 << 20, "ns")
    size = file_size(probe)
    store = BlockFileStore(tmp_path / "s", 4 * size, "ns")
    for i in range(4):
        assert store.put(h(i), block(i))
        os.utime(store.path_of(h(i)), (1000 + i, 1000 + i))  # distinct times, oldest first
    assert store.get(h(0)) is not None  # a read makes block 0 the most recent
    assert store.put(h(4), block(4))
    assert h(1) not in store  # the least recently used went
    assert all(h(i) in store for i in (0, 2, 3, 4))
    assert store.used_bytes <= store.capacity_bytes
    assert sum(p.stat().st_size for p in store.dir.iterdir()) <= store.capacity_bytes


def test_budget_too_small_for_a_block_stops_storing_with_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = BlockFileStore(tmp_path, 100, "ns")
    with caplog.at_level(logging.WARNING, logger="baton.kv_transfer.offload.disk_tier"):
        assert not store.put(h(1), block(1))
        assert not store.put(h(2), block(2))
    assert store.full
    warnings = [r for r in caplog.records if "disk_memory" in r.getMessage()]
    assert len(warnings) == 1
    assert not list(store.dir.iterdir())


def _mount_tiny_tmpfs(path: Path) -> bool:
    path.mkdir()
    if os.geteuid() != 0:
        return False
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(path)], capture_output=True
    )
    return done.returncode == 0


def test_enospc_stops_storing_with_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    mnt = tmp_path / "small"
    if not _mount_tiny_tmpfs(mnt):
        pytest.skip("needs root and tmpfs mounts to make a real full disk")
    try:
        # the budget is far above what the filesystem holds: the disk fills first (ENOSPC)
        store = BlockFileStore(mnt, 1 << 30, "ns")
        with caplog.at_level(logging.WARNING, logger="baton.kv_transfer.offload.disk_tier"):
            stored = [store.put(h(i), block(i)) for i in range(40)]
        assert stored[0] and not stored[-1] and store.full
        n = stored.index(False)
        assert not any(stored[n:])  # stopped for good
        assert len([r for r in caplog.records if "full" in r.getMessage()]) == 1
        # what was stored is still read, whole; no temporary file is left behind
        assert all(store.get(h(i), SHAPE, torch.float32) is not None for i in range(n))
        assert all(p.suffix == SUFFIX for p in store.dir.iterdir())
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_two_stores_share_one_directory(tmp_path: Path) -> None:
    probe = BlockFileStore(tmp_path / "probe", 1 << 20, "ns")
    size = file_size(probe)
    a = BlockFileStore(tmp_path / "d", 6 * size, "ns")
    b = BlockFileStore(tmp_path / "d", 6 * size, "ns")
    a.put(h(1), block(1))
    got = b.get(h(1), SHAPE, torch.float32)
    assert got is not None and torch.equal(got, block(1))
    # both write the same and different blocks from threads at once: every read is whole
    errors: list[str] = []

    def writer(store: BlockFileStore, seeds: range) -> None:
        for i in seeds:
            store.put(h(i % 5), block(i % 5))

    def reader(store: BlockFileStore) -> None:
        for i in range(200):
            t = store.get(h(i % 5), SHAPE, torch.float32)
            if t is not None and not torch.equal(t, block(i % 5)):
                errors.append(f"block {i % 5} read wrong")

    threads = [
        threading.Thread(target=writer, args=(a, range(0, 100))),
        threading.Thread(target=writer, args=(b, range(50, 150))),
        threading.Thread(target=reader, args=(a,)),
        threading.Thread(target=reader, args=(b,)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert a.failed_loads == 0 and b.failed_loads == 0
    # b's budget counts a's files: a write past it evicts the oldest, whoever wrote them
    for i in range(5, 9):
        b.put(h(i), block(i))
    total = sum(p.stat().st_size for p in (tmp_path / "d").rglob("*" + SUFFIX))
    assert total <= 6 * size
    assert not list((tmp_path / "d").rglob("*.part"))


def test_reopen_after_restart_finds_blocks_and_their_bytes(tmp_path: Path) -> None:
    store = BlockFileStore(tmp_path, 1 << 20, "ns")
    for i in range(3):
        store.put(h(i), block(i))
    used = store.used_bytes
    del store
    again = BlockFileStore(tmp_path, 1 << 20, "ns")
    assert again.used_bytes == used
    for i in range(3):
        got = again.get(h(i), SHAPE, torch.float32)
        assert got is not None and torch.equal(got, block(i))


def test_bad_arguments_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="capacity_bytes"):
        BlockFileStore(tmp_path, 0, "ns")
    with pytest.raises(ValueError, match="namespace_key"):
        BlockFileStore(tmp_path, 1, "../x")
