"""The offload connector in a whole engine (tiny random-weight model, real tokenizer): the same
greedy tokens as without it, prefixes served from RAM after the pool forgot them, and from disk
by a new engine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from baton import LLM, SamplingParams
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
