"""The offload connector in a whole engine (tiny random-weight model, real tokenizer): the same
greedy tokens as without it, prefixes served from RAM after the pool forgot them, and from disk
by a new engine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from baton import LLM, SamplingParams
from baton.config import BatonConfig
from baton.engine.core import EngineCore
from baton.metrics.logging_logger import KVTransferTally
from baton.protocol import EngineCoreRequest
from baton.request import RequestStatus
from baton.testing.conformance.kv_connector import Finished, run_requests
from baton.testing.tiny_model import tiny_model

GREEDY = SamplingParams(max_tokens=12, temperature=0)
BLOCK = 16
#: six 150-token prompts with distinct first blocks: 9 full blocks each (the 10th partial)
PROMPTS = [{"prompt_token_ids": [100 + (i * 7 + j) % 300 for j in range(150)]} for i in range(6)]
FULL = 144


@pytest.fixture(scope="module")
def model() -> str:
    return str(tiny_model("llama"))


def llm(model: str, **offload: Any) -> LLM:
    overrides: dict[str, Any] = {"max_model_len": 512, "cache.kv_cache_memory": "16MiB"}
    if offload:
        overrides["kv_transfer"] = {"connector": "offload", "offload": offload}
    return LLM(model=model, **overrides)


def twice(engine: LLM) -> tuple[list[list[int]], list[list[int]], list[int]]:
    """Generate, forget the pool's prefix cache, generate again: both tokens, cached counts."""
    first = engine.generate(PROMPTS, GREEDY, use_tqdm=False)
    engine.reset_prefix_cache()
    second = engine.generate(PROMPTS, GREEDY, use_tqdm=False)
    return (
        [list(o.outputs[0].token_ids) for o in first],
        [list(o.outputs[0].token_ids) for o in second],
        [o.num_cached_tokens for o in second],
    )


@pytest.fixture(scope="module")
def without(model: str) -> tuple[list[list[int]], list[list[int]], list[int]]:
    with llm(model) as engine:
        return twice(engine)


def test_ram_tier_serves_what_the_pool_forgot_with_the_same_tokens(
    model: str, without: tuple[list[list[int]], list[list[int]], list[int]], tmp_path: Path
) -> None:
    assert without[2] == [0] * len(PROMPTS)  # the pool alone forgot everything
    with llm(model, cpu_memory="64MiB") as engine:
        first, second, cached = twice(engine)
    assert cached == [FULL] * len(PROMPTS)  # every full block of every prompt, from RAM
    assert first == without[0] and second == without[1]


def test_disk_tier_serves_a_new_engine_with_the_same_tokens(
    model: str, without: tuple[list[list[int]], list[list[int]], list[int]], tmp_path: Path
) -> None:
    with llm(model, cpu_memory="64MiB", disk_path=str(tmp_path)) as engine:
        first, _, _ = twice(engine)
    assert first == without[0]
    assert list(tmp_path.rglob("*.kvb"))  # written behind, all there after the shutdown
    # a restart without a RAM tier: every prefix comes from disk (background loads)
    with llm(model, cpu_memory=0, disk_path=str(tmp_path)) as engine:
        outs = engine.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.num_cached_tokens for o in outs] == [FULL] * len(PROMPTS)
    assert [list(o.outputs[0].token_ids) for o in outs] == without[0]


def test_corrupt_disk_blocks_are_recomputed_never_served(
    model: str, without: tuple[list[list[int]], list[list[int]], list[int]], tmp_path: Path
) -> None:
    with llm(model, cpu_memory=0, disk_path=str(tmp_path), disk_write_behind=False) as engine:
        engine.generate(PROMPTS, GREEDY, use_tqdm=False)
    files = sorted(tmp_path.rglob("*.kvb"))
    # every block the forwards completed: the prompt's 9 and one more while decoding (the KV of
    # 150 + 11 tokens is computed: the last sampled token's is not)
    assert len(files) == (150 + 11) // BLOCK * len(PROMPTS)
    for path in files:  # flip one payload byte of every block file
        data = bytearray(path.read_bytes())
        data[-7] ^= 0x40
        path.write_bytes(bytes(data))
    with llm(model, cpu_memory=0, disk_path=str(tmp_path)) as engine:
        outs = engine.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.num_cached_tokens for o in outs] == [0] * len(PROMPTS)
    assert [list(o.outputs[0].token_ids) for o in outs] == without[0]
    # the bad files were deleted; the recomputed blocks were written anew, whole
    for path in files:
        assert path.exists()
        assert path.read_bytes() != b""


# --------------------------------------------------------------------------- through the kernel

TOKENS = list(range(1000, 1100))  # 100 tokens: 6 full blocks, the last 4 tokens computed


def core_with(model: str, **offload: Any) -> EngineCore:
    section = {"connector": "offload", "offload": offload}
    cfg = BatonConfig.load(model=model, max_model_len=256, kv_transfer=section)
    return EngineCore(cfg.replace(log_stats=True))


def run_tallied(core: EngineCore, rid: str) -> tuple[Finished, KVTransferTally]:
    """Run one greedy request to the end (transfers included), summing the step stats."""
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    core.add_request(EngineCoreRequest(request_id=rid, prompt_token_ids=TOKENS, sampling_params=sp))
    tally = KVTransferTally()
    tokens: list[int] = []
    done: Finished | None = None
    for _ in range(2000):
        if not core.has_work():
            break
        outs, _ = core.step_fn()
        if outs is None:
            continue
        if outs.scheduler_stats is not None and outs.scheduler_stats.kv_transfer is not None:
            tally.add(outs.scheduler_stats.kv_transfer)
        for o in outs.outputs:
            tokens.extend(o.new_token_ids)
            if o.finished:
                done = Finished(tokens, o.num_cached_tokens, o.error, o.kv_transfer_params)
    assert done is not None and done.error is None
    return done, tally


def test_step_stats_name_each_tier(model: str, tmp_path: Path) -> None:
    core = core_with(model, cpu_memory="64MiB", disk_path=str(tmp_path))
    try:
        first, saved = run_tallied(core, "a")
        assert core.reset_prefix_cache()
        again, ram = run_tallied(core, "b")
    finally:
        core.shutdown()
    assert again.tokens == first.tokens and again.num_cached_tokens == 96
    assert saved.total.save_bytes > 0 and saved.total.hit_tokens == {}
    assert ram.total.hit_tokens == {"CPU": 96} and ram.total.load_bytes > 0
    assert ram.total.tier_bytes["CPU"] > 0 and ram.total.tier_bytes["DISK"] > 0
    assert ram.total.tier_capacity_bytes == {"CPU": 64 << 20, "DISK": 8 << 30}
    restarted = core_with(model, cpu_memory=0, disk_path=str(tmp_path))
    try:
        third, disk = run_tallied(restarted, "c")
    finally:
        restarted.shutdown()
    assert third.tokens == first.tokens and third.num_cached_tokens == 96
    assert disk.total.hit_tokens == {"DISK": 96}
    assert disk.total.load_bytes == ram.total.load_bytes  # the same six blocks
    assert disk.total.failed_loads == 0


def test_an_aborted_disk_load_frees_every_block(model: str, tmp_path: Path) -> None:
    first = core_with(model, cpu_memory=0, disk_path=str(tmp_path), disk_write_behind=False)
    try:
        run_tallied(first, "a")
    finally:
        first.shutdown()
    core = core_with(model, cpu_memory=0, disk_path=str(tmp_path))
    sched = core.scheduler
    try:
        sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        core.add_request(
            EngineCoreRequest(request_id="b", prompt_token_ids=TOKENS, sampling_params=sp)
        )
        core.step_fn()
        if sched.requests["b"].status != RequestStatus.WAITING_FOR_KV:
            pytest.skip("the disk load finished within the step that started it")
        core.abort_requests(["b"])
        for _ in range(200):
            if not core.has_work():
                break
            core.step_fn()
        assert not core.has_work()
        assert sched.kv.num_free_blocks == sched.kv.num_total_blocks
    finally:
        core.shutdown()


def test_background_loads_through_a_pool_that_holds_one_request_at_a_time(
    model: str, tmp_path: Path
) -> None:
    """Eight 440-token prompts through a 34-block pool (27-28 blocks each), every prefix loaded
    from disk: a request whose load finished holds its blocks and must run before the queue's
    head, which waits for them (it deadlocked when it went to the back of the queue)."""
    prompts = {str(i): [100 + i] + [200 + (i * 13 + j) % 500 for j in range(439)] for i in range(8)}

    def core(**offload: Any) -> EngineCore:
        section = {"connector": "offload", "offload": offload}
        return EngineCore(
            BatonConfig.load(
                model=model,
                max_model_len=512,
                kv_transfer=section,
                **{"cache.kv_cache_memory": "420KiB"},
            )
        )

    first = core(cpu_memory=0, disk_path=str(tmp_path), disk_write_behind=False)
    try:
        assert first.scheduler.kv.num_total_blocks == 34
        computed = run_requests(first, prompts, max_tokens=4)
    finally:
        first.shutdown()
    again = core(cpu_memory=0, disk_path=str(tmp_path))
    try:
        loaded = run_requests(again, prompts, max_tokens=4)
    finally:
        again.shutdown()
    assert {r: f.num_cached_tokens for r, f in loaded.items()} == dict.fromkeys(prompts, 432)
    assert {r: f.tokens for r, f in loaded.items()} == {r: f.tokens for r, f in computed.items()}
