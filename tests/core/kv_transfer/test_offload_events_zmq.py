"""The offload connector's KV events (medium CPU / DISK) over ZeroMQ, with the pool's (GPU), as
a vLLM subscriber decodes them."""

from __future__ import annotations

import time
from pathlib import Path

import zmq

from baton import LLM, SamplingParams
from baton.testing.tiny_model import tiny_model
from tests.core.test_kv_events_zmq import (
    DECODER,
    BlockRemoved,
    BlockStored,
    chain,
    free_ports,
    receive,
    subscribe,
    tcp,
)

BS = 16
TOPIC = "kv-events"
GREEDY = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)


def test_tier_events_arrive_over_zmq_with_their_medium(tmp_path: Path) -> None:
    port = free_ports(2)
    ctx = zmq.Context()
    sub = subscribe(ctx, tcp(port))
    block_bytes = 3 * 2 * 2 * 16 * 4 * BS  # the tiny llama's block
    llm = LLM(
        model=str(tiny_model("llama")),
        max_model_len=128,
        block_size=BS,
        kv_events={
            "enable_kv_cache_events": True,
            "endpoint": tcp(port),
            "replay_endpoint": tcp(port + 1),
            "topic": TOPIC,
        },
        kv_transfer={
            "connector": "offload",
            # a RAM tier of 4 blocks: the second prompt's blocks push the first one's out
            "offload": {"cpu_memory": 4 * block_bytes, "disk_path": str(tmp_path)},
        },
    )
    try:
        time.sleep(0.5)  # the subscription reaches the PUB socket (ZeroMQ's slow joiner)
        a = [1000 + i for i in range(40)]  # 2 full blocks
        b = [2000 + i for i in range(72)]  # 4 full blocks
        llm.generate({"prompt_token_ids": a}, GREEDY, use_tqdm=False)
        llm.generate({"prompt_token_ids": b}, GREEDY, use_tqdm=False)
        events = [e for _, _, p in receive(sub) for e in DECODER.decode(p).events]
    finally:
        llm.shutdown()
        ctx.destroy(linger=0)
    stored = {
        m: [e for e in events if isinstance(e, BlockStored) and e.medium == m]
        for m in ("GPU", "CPU", "DISK")
    }
    for medium in ("GPU", "CPU", "DISK"):
        hashes = [h for e in stored[medium] for h in e.block_hashes]
        assert hashes[:2] == chain(a, 2), medium
    cpu_a = stored["CPU"][0]
    assert cpu_a.token_ids == a[:32] and cpu_a.parent_block_hash is None and cpu_a.block_size == BS
    removed = [
        h
        for e in events
        if isinstance(e, BlockRemoved) and e.medium == "CPU"
        for h in e.block_hashes
    ]
    assert removed == chain(a, 2)  # RAM's least recently used went first
