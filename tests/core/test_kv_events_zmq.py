"""KV cache events over ZeroMQ from real engines on the tiny model.

A real SUB socket (and REQ / DEALER sockets for replay) decodes what the engine publishes with
its own copy of vLLM's structs, as vLLM's examples/online_serving/kv_events_subscriber.py
declares them (block hashes ``int``: vLLM's default wire form, which baton sends by default).
"""

from __future__ import annotations

import asyncio
import re
import socket
import sys
import threading
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from baton import LLM, AsyncLLM, SamplingParams
from baton.config import BatonConfig
from baton.errors import ConfigError
from baton.kv.events import BlockStored as BatonBlockStored
from baton.kv.hashing import hash_block, root_hash
from baton.kv.zmq_event_publisher import END_SEQ, ZmqEventPublisher
from baton.testing.tiny_model import tiny_model

# ------------------------------------------------------- vLLM's structs (the subscriber's copy)


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base class for all KV cache-related events"""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(KVEventBatch)


class BytesBlockStored(KVCacheEvent, tag="BlockStored"):
    """BlockStored with vLLM's ExternalBlockHash (bytes | int): a router that reads both forms."""

    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BytesBatch(EventBatch):
    events: list[BytesBlockStored]


# ----------------------------------------------------------------------------- helpers

BS = 16
#: the tiny llama's KV per token (3 layers x K and V x 2 KV heads x head dim 16 x float32)
KV_BYTES_PER_BLOCK = 3 * 2 * 2 * 16 * 4 * BS
GREEDY = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
TOPIC = "kv-events"


def free_ports(n: int) -> int:
    """The first of ``n`` consecutive 127.0.0.1 TCP ports that are free now."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n > 65535:
            continue
        try:
            for p in range(base, base + n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return base
    raise RuntimeError(f"no {n} consecutive free ports")


def tcp(port: int) -> str:
    return f"tcp://127.0.0.1:{port}"


def subscribe(ctx: zmq.Context, endpoint: str, topic: str = TOPIC) -> zmq.Socket:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt_string(zmq.SUBSCRIBE, topic)
    sub.connect(endpoint)
    return sub


def receive(sub: zmq.Socket, timeout_ms: int = 500) -> list[tuple[bytes, int, bytes]]:
    """(topic, seq, payload) of every message until none comes for ``timeout_ms``."""
    got = []
    while sub.poll(timeout_ms):
        topic, seq, payload = sub.recv_multipart()
        got.append((topic, int.from_bytes(seq, "big"), payload))
    return got


def chain(prompt: list[int], n: int) -> list[int]:
    """vLLM-style integer hashes of the prompt's first ``n`` blocks, by baton's own hashing."""
    parent, out = root_hash(None), []
    for i in range(n):
        parent = hash_block(parent, prompt[i * BS : (i + 1) * BS])
        out.append(int.from_bytes(parent[-8:], "big"))
    return out


def kv_event_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("kv-events")}


def make_llm(transport: str = "inproc", **kv_events: Any) -> LLM:
    return LLM(
        transport=transport,
        model=str(tiny_model("llama")),
        device="cpu",
        num_threads=1,
        max_model_len=128,
        max_num_seqs=4,
        block_size=BS,
        kv_cache_memory=9 * KV_BYTES_PER_BLOCK,  # 8 usable blocks: 2 prompts of 64 tokens evict
        kv_events=kv_events,
    )


def prompt(seed: int, n: int) -> list[int]:
    return [1000 + 37 * seed + i for i in range(n)]


# ----------------------------------------------------------------------------- one engine


@pytest.fixture(scope="module")
def run() -> Iterator[dict[str, Any]]:
    """An engine with events on, a subscriber from the start, and a workload: prompt A, then B
    sharing A's first two blocks, then prompts that evict A's blocks, then a reset."""
    port = free_ports(2)
    ctx = zmq.Context()
    sub = subscribe(ctx, tcp(port))
    llm = make_llm(
        enable_kv_cache_events=True,
        endpoint=tcp(port),
        replay_endpoint=tcp(port + 1),
        topic=TOPIC,
    )
    time.sleep(0.5)  # the subscription reaches the PUB socket (ZeroMQ's slow joiner)
    a = prompt(0, 40)  # 2 full blocks
    b = [*a[:32], *prompt(1, 20)]  # A's 2 blocks, 1 more full block
    evictors = [prompt(i, 64) for i in range(2, 6)]  # 4 blocks each, in a pool of 8
    llm.generate({"prompt_token_ids": a}, GREEDY, use_tqdm=False)
    llm.generate({"prompt_token_ids": b}, GREEDY, use_tqdm=False)
    for p in evictors:
        llm.generate({"prompt_token_ids": p}, GREEDY, use_tqdm=False)
    assert llm.reset_prefix_cache()
    messages = receive(sub)
    try:
        yield {"llm": llm, "ctx": ctx, "port": port, "a": a, "b": b, "messages": messages}
    finally:
        llm.shutdown()
        ctx.destroy(linger=0)


def events_of(messages: list[tuple[bytes, int, bytes]]) -> list[KVCacheEvent]:
    return [e for _, _, payload in messages for e in DECODER.decode(payload).events]


def test_block_stored_for_the_prompts_full_blocks_with_the_parent_chain(run):
    stored = [e for e in events_of(run["messages"]) if isinstance(e, BlockStored)]
    a, b = run["a"], run["b"]
    first, second = stored[:2]
    assert first == BlockStored(
        block_hashes=chain(a, 2),
        parent_block_hash=None,
        token_ids=a[:32],
        block_size=BS,
        lora_id=None,
        medium="GPU",
    )
    # B hit A's two blocks: only its third is new, and its parent is A's second
    assert second.block_hashes == chain(b, 3)[2:]
    assert second.parent_block_hash == chain(a, 2)[1]
    assert second.token_ids == b[32:48]


def test_block_removed_when_the_pool_evicts_and_all_cleared_on_reset(run):
    events = events_of(run["messages"])
    removed = {h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes}
    assert set(chain(run["a"], 2)) <= removed
    assert all(e.medium == "GPU" for e in events if isinstance(e, BlockRemoved))
    # every hash removed was stored before
    stored = {h for e in events if isinstance(e, BlockStored) for h in e.block_hashes}
    assert removed <= stored
    assert isinstance(events[-1], AllBlocksCleared)


def test_sequence_numbers_topic_and_rank(run):
    messages = run["messages"]
    assert [seq for _, seq, _ in messages] == list(range(len(messages)))
    assert len(messages) >= 4  # A, B, the evictions, the reset: one batch per step with events
    assert {topic for topic, _, _ in messages} == {TOPIC.encode()}
    batches = [DECODER.decode(p) for _, _, p in messages]
    assert all(b.data_parallel_rank == 0 for b in batches)
    assert [b.ts for b in batches] == sorted(b.ts for b in batches)
    assert all(b.events for b in batches)  # nothing published for a step without events


def test_replay_returns_every_buffered_batch_then_the_end_marker(run):
    ctx, port, messages = run["ctx"], run["port"], run["messages"]
    dealer = ctx.socket(zmq.DEALER)  # a REQ takes one reply per request; a DEALER takes them all
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(tcp(port + 1))
    try:
        dealer.send_multipart([b"", (2).to_bytes(8, "big")])
        replayed = []
        while dealer.poll(2000):
            delimiter, seq, payload = dealer.recv_multipart()
            assert delimiter == b""
            if seq == END_SEQ:
                assert payload == b""
                break
            replayed.append((int.from_bytes(seq, "big"), payload))
        else:
            pytest.fail("no end marker")
        assert replayed == [(seq, p) for _, seq, p in messages[2:]]
    finally:
        dealer.close()


def test_vllm_subscriber_recovers_missed_batches_with_a_req_socket(run):
    """vLLM's example: a subscriber joining late sees a gap, asks replay for last_seq + 1 with
    a REQ socket and gets [seq, payload]; here it joined before any batch it could have seen."""
    llm, ctx, port, messages = run["llm"], run["ctx"], run["port"], run["messages"]
    late = subscribe(ctx, tcp(port))
    req = ctx.socket(zmq.REQ)
    req.setsockopt(zmq.LINGER, 0)
    req.connect(tcp(port + 1))
    try:
        time.sleep(0.5)
        llm.generate({"prompt_token_ids": prompt(9, 20)}, GREEDY, use_tqdm=False)
        (_, seq, payload), *_ = receive(late)
        assert seq == len(messages)  # the first it sees: every earlier one was missed
        assert isinstance(DECODER.decode(payload).events[0], BlockStored)
        req.send((0).to_bytes(8, "big"))
        assert req.poll(2000)
        replay_seq, replay_payload = req.recv_multipart()
        assert int.from_bytes(replay_seq, "big") == 0 and replay_payload == messages[0][2]
    finally:
        late.close()
        req.close()


def test_the_docs_subscriber_catches_up_from_replay(run, monkeypatch):
    """docs/kv-events.md's subscriber, run as the page has it: it replays every batch the engine
    buffered, in order, decoded with the page's structs (int hashes), then returns when idle."""
    page = (Path(__file__).resolve().parents[2] / "docs" / "kv-events.md").read_text()
    [code] = re.findall(r"^```python example=subscriber\n(.*?)^```$", page, re.S | re.M)
    module = types.ModuleType("kv_events_subscriber")  # msgspec reads its structs' module
    monkeypatch.setitem(sys.modules, module.__name__, module)
    exec(compile(code, "docs/kv-events.md", "exec"), module.__dict__)
    example = module.__dict__
    got: list[tuple[int, Any]] = []
    port, messages = run["port"], run["messages"]
    example["follow"](tcp(port), tcp(port + 1), TOPIC, lambda n, b: got.append((n, b)), 300)
    # the REQ test may have added a batch after the fixture's: compare those the fixture saw
    assert [n for n, _ in got][: len(messages)] == list(range(len(messages)))
    for (_, batch), (_, _, payload) in zip(got[: len(messages)], messages, strict=True):
        assert msgspec.to_builtins(batch) == msgspec.to_builtins(DECODER.decode(payload))


# ----------------------------------------------------------------------------- on and off


def test_disabled_binds_no_socket_and_publishes_nothing():
    port = free_ports(1)
    ctx = zmq.Context()
    sub = subscribe(ctx, tcp(port), "")
    before = kv_event_threads()
    try:
        with make_llm(endpoint=tcp(port)) as llm:
            core = llm.engine.core  # type: ignore[attr-defined]
            assert core.kv_event_publisher is None and core.scheduler.kv.pool.kv_events is None
            assert kv_event_threads() == before
            llm.generate({"prompt_token_ids": prompt(0, 40)}, GREEDY, use_tqdm=False)
            llm.reset_prefix_cache()
            pub = ctx.socket(zmq.PUB)
            pub.setsockopt(zmq.LINGER, 0)
            pub.bind(tcp(port))  # the engine bound nothing there
            pub.close()
            assert not sub.poll(300)
    finally:
        ctx.destroy(linger=0)


def test_shutdown_ends_the_thread_and_frees_the_port():
    port = free_ports(2)
    before = kv_event_threads()
    llm = make_llm(enable_kv_cache_events=True, endpoint=tcp(port), replay_endpoint=tcp(port + 1))
    (thread,) = kv_event_threads() - before
    assert thread.name == "kv-events-dp0"
    llm.generate({"prompt_token_ids": prompt(0, 40)}, GREEDY, use_tqdm=False)
    llm.shutdown()
    assert not thread.is_alive()
    ctx = zmq.Context()
    try:
        for p in (port, port + 1):
            s = ctx.socket(zmq.PUB)
            s.setsockopt(zmq.LINGER, 0)
            s.bind(tcp(p))  # closed with linger 0: free at once
            s.close()
    finally:
        ctx.destroy(linger=0)


def test_a_port_in_use_is_refused_with_the_endpoint():
    port = free_ports(1)
    before = kv_event_threads()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        with pytest.raises(
            ConfigError,
            match=rf"kv_events\.endpoint: engine core 0 cannot bind 'tcp://127\.0\.0\.1:{port}'"
            r".*free port",
        ):
            make_llm(enable_kv_cache_events=True, endpoint=tcp(port))
    assert kv_event_threads() == before


def test_null_publisher_records_but_binds_nothing():
    port = free_ports(1)
    before = kv_event_threads()
    with make_llm(enable_kv_cache_events=True, publisher="null", endpoint=tcp(port)) as llm:
        llm.generate({"prompt_token_ids": prompt(0, 40)}, GREEDY, use_tqdm=False)
        assert kv_event_threads() == before
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


@pytest.mark.slow
def test_an_engine_in_its_own_process_publishes_and_frees_its_port():
    """transport zmq: the publisher runs in the engine process; the engine's exit closes it."""
    port = free_ports(1)
    ctx = zmq.Context()
    sub = subscribe(ctx, tcp(port), "")
    try:
        with make_llm(enable_kv_cache_events=True, endpoint=tcp(port), transport="zmq") as llm:
            time.sleep(0.5)
            a = prompt(0, 40)
            llm.generate({"prompt_token_ids": a}, GREEDY, use_tqdm=False)
            ((_, seq, payload),) = receive(sub)
            (stored,) = DECODER.decode(payload).events
            assert seq == 0 and stored.block_hashes == chain(a, 2)
        pub = ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.bind(tcp(port))  # the engine process closed its socket
    finally:
        ctx.destroy(linger=0)


# ----------------------------------------------------------------------------- the publisher alone


def _section(**kv: Any):
    return BatonConfig.load(kv_events={"enable_kv_cache_events": True, **kv}).kv_events


def test_ipc_endpoint_and_bytes_hashes(tmp_path):
    """``int_block_hashes = false``: the digest's bytes (vLLM's VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0),
    read with vLLM's ExternalBlockHash (bytes | int); an ipc endpoint of rank 1 gets ``_dp1``."""

    endpoint = f"ipc://{tmp_path}/kv"
    before = kv_event_threads()
    publisher = ZmqEventPublisher(_section(endpoint=endpoint, int_block_hashes=False), 1)
    assert publisher.endpoint == f"{endpoint}_dp1"
    ctx = zmq.Context()
    sub = subscribe(ctx, publisher.endpoint, "")
    try:
        time.sleep(0.3)
        digest = bytes(range(16))
        publisher.publish([BatonBlockStored([digest], None, list(range(16)), 16, None, "GPU")])
        ((_, seq, payload),) = receive(sub)
        batch = msgspec.msgpack.decode(payload, type=BytesBatch)
        assert seq == 0 and batch.data_parallel_rank == 1
        assert batch.events[0].block_hashes == [digest]
    finally:
        publisher.shutdown()
        ctx.destroy(linger=0)
    assert kv_event_threads() == before
    publisher.shutdown()  # idempotent


def test_int_hashes_are_the_digests_low_64_bits():
    port = free_ports(1)
    publisher = ZmqEventPublisher(_section(endpoint=tcp(port)), 0)
    ctx = zmq.Context()
    sub = subscribe(ctx, tcp(port), "")
    try:
        time.sleep(0.3)
        digest, parent = bytes(range(16)), bytes(range(100, 116))
        publisher.publish([BatonBlockStored([digest], parent, list(range(16)), 16, 3, "GPU")])
        ((_, _, payload),) = receive(sub)
        (event,) = DECODER.decode(payload).events
        assert event.block_hashes == [int.from_bytes(digest[8:], "big")]
        assert event.parent_block_hash == int.from_bytes(parent[8:], "big")
        assert event.lora_id == 3
    finally:
        publisher.shutdown()
        ctx.destroy(linger=0)


# ----------------------------------------------------------------------------- data parallel


def test_data_parallel_engines_publish_on_their_own_ports_with_their_rank():
    port = free_ports(4)
    ctx = zmq.Context()
    subs = [subscribe(ctx, tcp(port + rank)) for rank in (0, 1)]

    async def go() -> None:
        llm = await AsyncLLM.create(
            model=str(tiny_model("llama")),
            max_model_len=128,
            data_parallel_size=2,
            routing={"router": "round-robin"},
            kv_events={
                "enable_kv_cache_events": True,
                "endpoint": tcp(port),
                "replay_endpoint": tcp(port + 2),
                "topic": TOPIC,
            },
        )
        try:
            await asyncio.sleep(0.5)
            for i in range(2):
                async for _ in llm.generate({"prompt_token_ids": prompt(i, 40)}, GREEDY, f"r{i}"):
                    pass
        finally:
            llm.shutdown()

    try:
        asyncio.run(go())
        for rank, sub in enumerate(subs):
            messages = receive(sub)
            assert messages, f"engine {rank} published nothing on port {port + rank}"
            batches = [DECODER.decode(p) for _, _, p in messages]
            assert {b.data_parallel_rank for b in batches} == {rank}
            assert [seq for _, seq, _ in messages] == list(range(len(messages)))
    finally:
        ctx.destroy(linger=0)
