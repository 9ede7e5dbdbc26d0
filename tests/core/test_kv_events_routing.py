"""``prefix-aware`` with ``use_kv_events``: the router follows what the engines' KV events say
their pools hold (``baton.routing.kv_event_index``), over real ZeroMQ sockets: publishers as
the engines run them, and DP=2 engines on the tiny model."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from baton import AsyncLLM, SamplingParams
from baton.config import BatonConfig, KVEventsSection
from baton.errors import ConfigError
from baton.kv.event_publisher import rank_endpoint
from baton.kv.events import AllBlocksCleared, BlockRemoved, BlockStored
from baton.kv.hashing import hash_block, root_hash
from baton.kv.zmq_event_publisher import ZmqEventPublisher
from baton.routing import EngineLoad, RouteRequest
from baton.routing.kv_event_index import KVEventIndex
from baton.routing.prefix_aware import (
    PrefixAwareRouter,
    PrefixAwareSettings,
    _factory,
    engine_block_hashes,
)
from baton.testing.tiny_model import tiny_model

from .test_kv_events_zmq import free_ports, tcp

BS = 16
PROMPT = list(range(500, 548))  # 3 full blocks


def digests(prompt: list[int], n: int) -> list[bytes]:
    parent, out = root_hash(None), []
    for i in range(n):
        parent = hash_block(parent, prompt[i * BS : (i + 1) * BS])
        out.append(parent)
    return out


def stored(prompt: list[int], n: int) -> BlockStored:
    return BlockStored(digests(prompt, n), None, prompt[: n * BS], BS, None, "GPU")


def wait_for(check: Callable[[], bool], what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.02)


def events_section(replay_offset: int) -> KVEventsSection:
    """``[kv_events]`` on free ports: the PUB port, the replay port ``replay_offset`` above it
    (2 leaves room for two ranks)."""
    port = free_ports(2 * replay_offset)
    return BatonConfig.load(
        kv_events={
            "enable_kv_cache_events": True,
            "endpoint": tcp(port),
            "replay_endpoint": tcp(port + replay_offset),
        }
    ).kv_events


@pytest.fixture
def engines() -> Iterator[tuple[list[ZmqEventPublisher], KVEventIndex]]:
    """Two publishers as two data-parallel engines publish (rank ports, replay), and an index
    following them."""
    section = events_section(replay_offset=2)
    pubs = [ZmqEventPublisher(section, rank) for rank in (0, 1)]
    index = KVEventIndex(
        [rank_endpoint(section.endpoint, r) for r in (0, 1)],
        [rank_endpoint(section.replay_endpoint, r) for r in (0, 1)],  # type: ignore[arg-type]
    )
    try:
        yield pubs, index
    finally:
        index.close()
        for p in pubs:
            p.shutdown()


def test_the_index_follows_stored_removed_and_cleared(engines):
    pubs, index = engines
    hashes = engine_block_hashes(RouteRequest(request_id="x", prompt_token_ids=PROMPT), 8)
    time.sleep(0.3)  # subscriptions
    pubs[1].publish([stored(PROMPT, 3)])
    wait_for(lambda: index.matched_blocks(hashes) == [0, 3], "engine 1's three blocks")
    pubs[1].publish([BlockRemoved([digests(PROMPT, 3)[1]], "GPU")])
    wait_for(lambda: index.matched_blocks(hashes) == [0, 1], "the second block's removal")
    pubs[0].publish([stored(PROMPT, 2), BlockStored([b"\x01" * 16], None, [], BS, None, "CPU")])
    wait_for(lambda: index.matched_blocks(hashes) == [2, 1], "engine 0's two blocks")
    assert index.num_blocks(0) == 2  # a connector tier's block (CPU) is not the pool's
    pubs[0].publish([AllBlocksCleared()])
    wait_for(lambda: index.num_blocks(0) == 0, "engine 0's reset")
    assert index.matched_blocks(hashes) == [0, 1]


def test_missed_batches_are_replayed():
    """Batches published before the index subscribed come back by replay."""
    section = events_section(replay_offset=1)
    pub = ZmqEventPublisher(section, 0)
    index = None
    try:
        pub.publish([stored(PROMPT, 2)])  # nobody listens yet
        time.sleep(0.2)
        index = KVEventIndex([section.endpoint], [section.replay_endpoint])
        time.sleep(0.3)
        other = list(range(900, 916))
        pub.publish([stored(other, 1)])  # seq 1: the gap before it is replayed
        hashes = engine_block_hashes(RouteRequest(request_id="x", prompt_token_ids=PROMPT), 8)
        wait_for(lambda: index.num_blocks(0) == 3, "the replayed batch and the new one")
        assert index.matched_blocks(hashes) == [2]
    finally:
        if index is not None:
            index.close()
        pub.shutdown()


def test_close_ends_the_thread(engines):
    _, index = engines
    thread = next(t for t in threading.enumerate() if t.name == "kv-event-index")
    index.close()
    assert not thread.is_alive()
    index.close()  # idempotent


def loads(*in_flight: int) -> list[EngineLoad]:
    return [EngineLoad(engine_index=i, num_in_flight=n) for i, n in enumerate(in_flight)]


def test_the_router_sends_a_prompt_to_the_pool_that_holds_it(engines):
    pubs, index = engines
    router = PrefixAwareRouter(PrefixAwareSettings(balance_abs_threshold=2), index)
    req = RouteRequest(request_id="a", prompt_token_ids=[*PROMPT, 7])
    # its own books: a new prefix goes to the engine with the fewest prefixes (engine 0)
    assert PrefixAwareRouter().route(req, loads(0, 0)) == 0
    time.sleep(0.3)
    pubs[1].publish([stored(PROMPT, 2)])
    wait_for(lambda: index.num_blocks(1) == 2, "engine 1's blocks")
    assert router.route(req, loads(0, 0)) == 1
    assert router.route(req, loads(0, 2)) == 1  # within the load cap
    assert router.route(req, loads(0, 3)) == 0  # over it: the least loaded
    pubs[0].publish([stored(PROMPT, 3)])
    wait_for(lambda: index.num_blocks(0) == 3, "engine 0's blocks")
    assert router.route(req, loads(1, 0)) == 0  # the longest cached prefix wins


def test_use_kv_events_needs_the_engines_events():
    config = BatonConfig.load(data_parallel_size=2)
    with pytest.raises(ConfigError, match=r"use_kv_events .* kv_events\.enable_kv_cache_events"):
        _factory(config, PrefixAwareSettings(use_kv_events=True))


def test_dp2_router_follows_the_engines_events():
    """DP=2: a prompt's prefix is stored on one engine; the router sees its BlockStored and
    sends the prompts sharing it there (every one hits); shutdown ends the index's thread."""
    port = free_ports(4)
    a = list(range(100, 164))  # 4 blocks

    async def go() -> tuple[list[int], list[int]]:
        llm = await AsyncLLM.create(
            model=str(tiny_model("llama")),
            max_model_len=128,
            data_parallel_size=2,
            routing={"router": "prefix-aware", "prefix-aware": {"use_kv_events": True}},
            kv_events={
                "enable_kv_cache_events": True,
                "endpoint": tcp(port),
                "replay_endpoint": tcp(port + 2),
            },
        )
        try:
            index = llm.engine.router.index  # type: ignore[attr-defined]
            params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)

            async def one(i: int, p: list[int]) -> None:
                async for _ in llm.generate({"prompt_token_ids": p}, params, f"q{i}"):
                    pass

            await one(0, [*a, 1])
            await asyncio.to_thread(
                wait_for, lambda: index.num_blocks(0) + index.num_blocks(1) >= 4, "A's 4 blocks"
            )
            owners = [index.num_blocks(0), index.num_blocks(1)]
            await asyncio.gather(*(one(i, [*a, 10 + i]) for i in range(1, 4)))
            hits = [e.prefix_cache_hits for e in llm.engine.engine_loads()]  # type: ignore[attr-defined]
            return owners, hits
        finally:
            llm.shutdown()

    owners, hits = asyncio.run(go())
    holder = 0 if owners[0] else 1
    assert hits[holder] == 3 * 64 and hits[1 - holder] == 0
    assert not [t for t in threading.enumerate() if t.name == "kv-event-index"]
