"""The offload connector's two halves driven as the kernel drives them, with real KV tensors."""

from __future__ import annotations

from collections import deque
from pathlib import Path

import pytest
import torch

from baton.kv.events import BlockRemoved, BlockStored
from baton.kv.hashing import update_block_hashes
from baton.kv_transfer.connector import (
    KVBlockRef,
    KVConnectorScheduler,
    KVConnectorWorker,
    KVSchedulerContext,
    KVStep,
    KVWorkerContext,
)
from baton.kv_transfer.offload import OffloadConnector, OffloadSettings
from baton.kv_transfer.offload.layout import block_nbytes
from baton.kv_transfer.offload.orders import decode_orders
from baton.kv_transfer.types import KVConnectorOutput, KVNamespace, KVRole
from baton.protocol import KVCacheSpec
from baton.request import Request
from baton.sampling_params import SamplingParams

BS = 4
NUM_BLOCKS = 32
NS = KVNamespace(
    model="tiny",
    kv_dtype="float32",
    block_size=BS,
    num_layers=3,
    num_kv_heads=2,
    head_size=8,
    key="0123abcd",
)
BLOCK_BYTES = block_nbytes(NS)


class Pair:
    """One engine's halves and its KV cache; steps like the kernel."""

    def __init__(self, settings: OffloadSettings, role: KVRole = "both") -> None:
        connector = OffloadConnector(None, settings)
        self.sched = connector.scheduler_side(
            KVSchedulerContext(role=role, namespace=NS, num_blocks=NUM_BLOCKS)
        )
        self.worker = connector.worker_side(KVWorkerContext(role=role, namespace=NS))
        self.caches = [torch.zeros(2, NUM_BLOCKS, 2, BS, 8) for _ in range(NS.num_layers)]
        spec = KVCacheSpec(
            block_size=BS, num_layers=3, num_kv_heads=2, head_size=8, dtype="float32"
        )
        self.worker.register_kv_caches(self.caches, spec)
        self.step_id = 0
        self.outputs: list[KVConnectorOutput] = []

    def compute(self, block_ids: list[int], seed: int) -> None:
        """Stand-in for a forward: fill the blocks with KV derived from ``seed``."""
        g = torch.Generator().manual_seed(seed)
        for kv in self.caches:
            for b in block_ids:
                kv[:, b] = torch.randn(kv[:, b].shape, generator=g)

    def block(self, block_id: int) -> torch.Tensor:
        return torch.stack([kv[:, block_id] for kv in self.caches])

    def step(
        self,
        saves: dict[str, list[KVBlockRef]] | None = None,
        finished: list[str] | None = None,
        before_finish: object = None,
    ) -> KVConnectorOutput | None:
        self.step_id += 1
        meta = self.sched.build_connector_meta(
            KVStep(
                step_id=self.step_id, new_full_blocks=saves or {}, finished_req_ids=finished or []
            )
        )
        self.worker.start_step(meta)
        if callable(before_finish):
            before_finish()
        out = self.worker.finish_step()
        if out is not None:
            self.sched.update_connector_output(out)
            self.outputs.append(out)
        return out

    def admit(self, request: Request, block_ids: list[int], computed: int = 0) -> tuple[int, bool]:
        tokens, is_async = self.sched.get_num_new_matched_tokens(request, computed)
        self.sched.update_state_after_alloc(request, block_ids, tokens)
        return tokens, is_async

    def close(self) -> None:
        self.worker.shutdown()
        self.sched.shutdown()


def request(req_id: str, tokens: list[int]) -> Request:
    r = Request(req_id, list(tokens), SamplingParams(max_tokens=1))
    update_block_hashes(r, BS)
    return r


def refs(r: Request, block_ids: list[int]) -> list[KVBlockRef]:
    return [KVBlockRef(b, h) for b, h in zip(block_ids, r.block_hashes, strict=False)]


PROMPT = list(range(100, 114))  # 14 tokens: 3 full blocks and 2 tokens


def save_prompt(pair: Pair, req_id: str = "a", block_ids: list[int] | None = None) -> Request:
    block_ids = block_ids or [1, 2, 3, 4]
    r = request(req_id, PROMPT)
    assert pair.admit(r, block_ids) == (0, False)
    pair.compute(block_ids, seed=7)
    pair.step(saves={req_id: refs(r, block_ids[:3])})
    return r


def test_halves_satisfy_the_protocols(tmp_path: Path) -> None:
    pair = Pair(OffloadSettings(disk_path=tmp_path))
    assert isinstance(pair.sched, KVConnectorScheduler)
    assert isinstance(pair.worker, KVConnectorWorker)
    pair.close()


def test_ram_hits_load_synchronously_and_exactly() -> None:
    pair = Pair(OffloadSettings(cpu_memory=1 << 20))
    save_prompt(pair)
    saved = [pair.block(b) for b in (1, 2, 3)]
    pair.compute([1, 2, 3, 4], seed=99)  # the pool reused the blocks
    returning = request("b", [*PROMPT, 5, 6, 7, 8])  # 18 tokens: 4 full blocks
    assert pair.admit(returning, [10, 11, 12, 13, 14]) == (3 * BS, False)
    pair.step()
    for b, want in zip((10, 11, 12), saved, strict=True):
        assert torch.equal(pair.block(b), want)
    stats = pair.sched.take_stats()
    assert stats is not None and stats.hit_tokens == {"CPU": 3 * BS}
    assert stats.load_bytes == 3 * BLOCK_BYTES and stats.save_bytes == 3 * BLOCK_BYTES
    assert stats.tier_bytes["CPU"] == 3 * BLOCK_BYTES
    pair.close()


def test_lookup_never_reaches_the_last_token_and_starts_after_the_pool_hits() -> None:
    pair = Pair(OffloadSettings())
    r = save_prompt(pair)
    same = request("b", PROMPT[:12])  # exactly 3 full blocks, all in RAM
    assert pair.sched.get_num_new_matched_tokens(same, 0) == (2 * BS, False)
    assert pair.sched.get_num_new_matched_tokens(same, BS) == (BS, False)
    longer = request("c", [*PROMPT, 1, 2])
    assert longer.block_hashes[:3] == r.block_hashes[:3]
    assert pair.sched.get_num_new_matched_tokens(longer, 2 * BS) == (BS, False)
    other = request("d", [1, *PROMPT[1:]])  # another first token: another chain
    assert pair.sched.get_num_new_matched_tokens(other, 0) == (0, False)
    pair.close()


def test_ram_lru_mirror_and_worker_agree_and_events() -> None:
    pair = Pair(OffloadSettings(cpu_memory=2 * BLOCK_BYTES))
    r = save_prompt(pair)
    # three blocks saved into a two-block tier: the first went, in both halves
    assert list(pair.sched.ram) == r.block_hashes[1:3]
    assert list(pair.worker.ram) == r.block_hashes[1:3]
    events = pair.sched.take_events()
    stored = [e for e in events if isinstance(e, BlockStored)]
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    assert [e.block_hashes for e in stored] == [r.block_hashes[:3]]
    assert stored[0].token_ids == PROMPT[:12] and stored[0].parent_block_hash is None
    assert stored[0].medium == "CPU" and stored[0].block_size == BS
    assert [(e.block_hashes, e.medium) for e in removed] == [([r.block_hashes[0]], "CPU")]
    # the chain starts with the evicted block: nothing to load from RAM
    assert pair.sched.get_num_new_matched_tokens(request("b", PROMPT), 0) == (0, False)
    assert pair.sched.get_num_new_matched_tokens(request("b", PROMPT), BS) == (2 * BS, False)
    pair.close()


def test_disk_tier_survives_a_restart_and_loads_in_the_background(tmp_path: Path) -> None:
    first = Pair(OffloadSettings(cpu_memory=1 << 20, disk_path=tmp_path))
    save_prompt(first)
    saved = [first.block(b) for b in (1, 2, 3)]
    stored = [e for e in first.sched.take_events() if isinstance(e, BlockStored)]
    assert {e.medium for e in stored} == {"CPU", "DISK"}
    first.close()  # writes what is pending
    second = Pair(OffloadSettings(cpu_memory=1 << 20, disk_path=tmp_path))
    returning = request("b", [*PROMPT, 5, 6])
    assert second.admit(returning, [20, 21, 22, 23, 24]) == (3 * BS, True)
    out = second.step(before_finish=second.worker.wait_loads)
    assert out is not None and out.finished_loading == {"b": 3 * BS}
    for b, want in zip((20, 21, 22), saved, strict=True):
        assert torch.equal(second.block(b), want)
    stats = second.sched.take_stats()
    assert stats is not None and stats.hit_tokens == {"DISK": 3 * BS}
    assert stats.load_bytes == 3 * BLOCK_BYTES and stats.failed_loads == 0
    assert stats.tier_bytes["DISK"] > 0
    second.close()


def test_corrupt_disk_block_is_a_shortfall_recomputed_never_served(tmp_path: Path) -> None:
    first = Pair(OffloadSettings(cpu_memory=0, disk_path=tmp_path, disk_write_behind=False))
    r = save_prompt(first)
    first.close()
    store = first.worker.disk
    assert store is not None
    path = store.path_of(r.block_hashes[1])
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    second = Pair(OffloadSettings(cpu_memory=0, disk_path=tmp_path))
    assert second.admit(request("b", PROMPT), [5, 6, 7, 8]) == (3 * BS, True)
    out = second.step(before_finish=second.worker.wait_loads)
    assert out is not None and out.finished_loading == {"b": BS}  # the first block only
    assert not path.exists()
    stats = second.sched.take_stats()
    assert stats is not None and stats.failed_loads == 1 and stats.hit_tokens == {"DISK": BS}
    second.close()


def test_disk_serves_what_ram_evicted(tmp_path: Path) -> None:
    pair = Pair(
        OffloadSettings(cpu_memory=2 * BLOCK_BYTES, disk_path=tmp_path, disk_write_behind=False)
    )
    r = save_prompt(pair)
    saved = [pair.block(b) for b in (1, 2, 3)]
    # RAM holds blocks 1 and 2 of the chain (block 0 was evicted), disk holds all three
    assert r.block_hashes[0] not in pair.sched.ram
    assert pair.sched.get_num_new_matched_tokens(request("x", PROMPT), 0) == (3 * BS, True)
    pair.close()
    # after a restart RAM is empty: the whole chain comes from disk
    again = Pair(OffloadSettings(cpu_memory=2 * BLOCK_BYTES, disk_path=tmp_path))
    assert again.admit(request("b", PROMPT), [5, 6, 7, 8]) == (3 * BS, True)
    again.step(before_finish=again.worker.wait_loads)
    for b, want in zip((5, 6, 7), saved, strict=True):
        assert torch.equal(again.block(b), want)
    again.close()


def test_ram_part_loads_synchronously_and_disk_part_in_background(tmp_path: Path) -> None:
    pair = Pair(OffloadSettings(cpu_memory=1 << 20, disk_path=tmp_path, disk_write_behind=False))
    r = save_prompt(pair)
    saved = [pair.block(b) for b in (1, 2, 3)]
    pair.sched.ram.pop(r.block_hashes[2])  # make RAM end early (as an eviction would)
    pair.worker.ram.pop(r.block_hashes[2])
    assert pair.admit(request("b", PROMPT), [5, 6, 7, 8]) == (3 * BS, True)
    out = pair.step(before_finish=pair.worker.wait_loads)
    assert out is not None and out.finished_loading == {"b": 3 * BS}
    for b, want in zip((5, 6, 7), saved, strict=True):
        assert torch.equal(pair.block(b), want)
    stats = pair.sched.take_stats()
    assert stats is not None and stats.hit_tokens == {"CPU": 2 * BS, "DISK": BS}
    pair.close()


def test_a_finished_request_s_background_load_is_cancelled(tmp_path: Path) -> None:
    first = Pair(OffloadSettings(disk_path=tmp_path, disk_write_behind=False))
    save_prompt(first)
    first.close()
    second = Pair(OffloadSettings(disk_path=tmp_path))
    r = request("b", PROMPT)
    assert second.admit(r, [5, 6, 7, 8]) == (3 * BS, True)
    second.worker.start_step(second.sched.build_connector_meta(KVStep(step_id=1)))
    # aborted while its load runs (before a worker reported it)
    second.sched.request_finished(r, [5, 6, 7, 8])
    meta = second.sched.build_connector_meta(KVStep(step_id=99, finished_req_ids=["b"]))
    assert decode_orders(meta).cancel_loads == ["b"]
    second.worker.start_step(meta)  # waits for the load to stop before the forward
    assert "b" not in second.worker._loads
    out = second.worker.finish_step()
    # still reported (with what it loaded before it stopped): that frees the request's blocks
    assert out is not None and set(out.finished_loading) == {"b"}
    second.sched.update_connector_output(out)
    stats = second.sched.take_stats()
    assert stats is not None and stats.hit_tokens == {}  # nothing was served
    second.close()


@pytest.mark.parametrize("role", ["producer", "consumer"])
def test_roles(tmp_path: Path, role: KVRole) -> None:
    producer = Pair(OffloadSettings(disk_path=tmp_path, disk_write_behind=False), role)
    r = save_prompt(producer)
    if role == "producer":
        assert len(producer.sched.ram) == 3
        assert producer.sched.get_num_new_matched_tokens(request("b", PROMPT), 0) == (0, False)
    else:
        assert len(producer.sched.ram) == 0  # a consumer never saves
        assert not list((tmp_path).rglob("*.kvb"))
    producer.close()
    if role == "producer":
        consumer = Pair(OffloadSettings(disk_path=tmp_path), "consumer")
        assert consumer.admit(request("b", PROMPT), [5, 6, 7, 8]) == (3 * BS, True)
        out = consumer.step(before_finish=consumer.worker.wait_loads)
        assert out is not None and out.finished_loading == {"b": 3 * BS}
        assert consumer.sched.take_stats().hit_tokens == {"DISK": 3 * BS}  # type: ignore[union-attr]
        assert r.block_hashes
        consumer.close()


def test_other_namespace_never_reads_the_tier(tmp_path: Path) -> None:
    first = Pair(OffloadSettings(disk_path=tmp_path, disk_write_behind=False))
    save_prompt(first)
    first.close()
    other = KVNamespace(**{**{f: getattr(NS, f) for f in NS.__struct_fields__}, "key": "feed"})
    sched = OffloadConnector(None, OffloadSettings(disk_path=tmp_path)).scheduler_side(
        KVSchedulerContext(role="both", namespace=other, num_blocks=NUM_BLOCKS)
    )
    assert sched.get_num_new_matched_tokens(request("b", PROMPT), 0) == (0, False)


def test_a_missing_ram_block_fails_the_request_not_the_worker() -> None:
    pair = Pair(OffloadSettings())
    r = save_prompt(pair)
    pair.worker.ram.pop(r.block_hashes[0])  # the halves disagree (never in normal operation)
    assert pair.admit(request("b", PROMPT), [5, 6, 7, 8]) == (3 * BS, False)
    out = pair.step()
    assert out is not None and set(out.failed) == {"b"}
    assert "not in this worker's RAM" in out.failed["b"]
    pair.close()


def test_events_nobody_takes_are_bounded() -> None:
    pair = Pair(OffloadSettings(cpu_memory=BLOCK_BYTES))
    pair.sched._events = deque(maxlen=3)  # a small bound, for the test
    for i in range(4):  # each save evicts the block before: a stored and a removed event
        r = request(f"r{i}", [i, *PROMPT[1:]])
        pair.admit(r, [1, 2, 3, 4])
        pair.step(saves={f"r{i}": refs(r, [1])})
    events = pair.sched.take_events()
    assert len(events) == 3 and isinstance(events[-1], BlockStored)
    assert pair.sched.take_events() == []
    pair.close()
