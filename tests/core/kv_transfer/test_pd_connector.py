"""The ``pd`` connector on real engines (the tiny model): a producer LLM saves a prompt's
blocks, a consumer LLM loads them and decodes.

Checked: the consumer's greedy tokens are one engine's; it computes at most the prompt's last
partial block (``num_cached_tokens``: its own prefix hits plus what it loaded); params whose
blocks never come cost load_timeout and a recompute, with the same tokens; a corrupt block is
recomputed, never served; params a producer or consumer cannot serve fail the request by name.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from baton import LLM, SamplingParams
from baton.errors import InvalidRequestError, error_from_message
from baton.kv.hashing import ROOT_HASH, hash_block
from baton.testing.tiny_model import tiny_model

BLOCK = 16
LOAD_TIMEOUT = 0.5
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
#: prompt lengths: full blocks and a partial one; whole blocks only; one partial block
LENGTHS = (5 * BLOCK + 3, 4 * BLOCK, BLOCK - 4)


def make_llm(store: Path | None, role: str | None = None) -> LLM:
    overrides: dict[str, Any] = {}
    if role is not None:
        overrides["kv_transfer"] = {
            "connector": "pd",
            "role": role,
            "pd": {"path": str(store), "load_timeout": LOAD_TIMEOUT},
        }
    return LLM(
        model=str(tiny_model("llama")),
        device="cpu",
        num_threads=1,
        max_model_len=1024,
        kv_cache_memory=16 << 20,
        **overrides,
    )


def prompt(length: int, salt: int = 0) -> dict[str, list[int]]:
    return {"prompt_token_ids": [100 + (7 * i + 13 * salt) % 900 for i in range(length)]}


def with_params(params: dict[str, Any] | None, base: SamplingParams = GREEDY) -> SamplingParams:
    return base.clone(extra_args={"kv_transfer_params": params})


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("pd")


@pytest.fixture(scope="module")
def single() -> Iterator[LLM]:
    with make_llm(None) as llm:
        yield llm


@pytest.fixture(scope="module")
def producer(store: Path) -> Iterator[LLM]:
    with make_llm(store, "producer") as llm:
        yield llm


@pytest.fixture(scope="module")
def consumer(store: Path) -> Iterator[LLM]:
    with make_llm(store, "consumer") as llm:
        yield llm


def prefill(producer: LLM, p: dict[str, list[int]]) -> dict[str, Any]:
    params = SamplingParams(temperature=0, max_tokens=1)
    (out,) = producer.generate([p], with_params({"do_remote_decode": True}, params), use_tqdm=False)
    assert out.kv_transfer_params is not None
    return out.kv_transfer_params


def tokens(llm: LLM, p: dict[str, list[int]], params: SamplingParams = GREEDY) -> Any:
    (out,) = llm.generate([p], params, use_tqdm=False)
    return out


@pytest.mark.parametrize("length", LENGTHS)
def test_consumer_decodes_the_producers_prefill(
    single: LLM, producer: LLM, consumer: LLM, length: int
) -> None:
    p = prompt(length, salt=length)
    handoff = prefill(producer, p)
    assert handoff["do_remote_prefill"] is True
    assert handoff["num_tokens"] == length // BLOCK * BLOCK
    got = tokens(consumer, p, with_params(handoff))
    assert got.outputs[0].token_ids == tokens(single, p).outputs[0].token_ids
    usable = (length - 1) // BLOCK * BLOCK
    assert got.num_cached_tokens == usable
    assert length - got.num_cached_tokens <= BLOCK  # at most the last (partial) block computed


def test_a_prefix_the_producer_had_cached_is_handed_off_too(
    single: LLM, producer: LLM, consumer: LLM
) -> None:
    """The producer's own prefix hits are never computed there, but are saved all the same."""
    p = prompt(6 * BLOCK + 1, salt=99)
    tokens(producer, p)  # now in the producer's prefix cache (no hand-off asked)
    handoff = prefill(producer, p)
    assert handoff["num_tokens"] == 6 * BLOCK
    got = tokens(consumer, p, with_params(handoff))
    assert got.num_cached_tokens == 6 * BLOCK
    assert got.outputs[0].token_ids == tokens(single, p).outputs[0].token_ids


def test_params_whose_blocks_never_come_cost_a_recompute_not_a_hang(
    single: LLM, producer: LLM, consumer: LLM
) -> None:
    handoff = prefill(producer, prompt(3 * BLOCK, salt=5))  # another prompt's blocks
    p = prompt(3 * BLOCK, salt=6)
    got = tokens(consumer, p, with_params(handoff))
    assert got.num_cached_tokens == 0
    assert got.outputs[0].token_ids == tokens(single, p).outputs[0].token_ids


def block_hashes(p: dict[str, list[int]]) -> list[bytes]:
    """The prompt's full blocks' hashes, as both engines compute them (no salt, no LoRA)."""
    ids, parent, out = p["prompt_token_ids"], ROOT_HASH, []
    for i in range(len(ids) // BLOCK):
        parent = hash_block(parent, ids[i * BLOCK : (i + 1) * BLOCK])
        out.append(parent)
    return out


def test_a_corrupt_block_is_recomputed_never_served(
    single: LLM, producer: LLM, consumer: LLM, store: Path
) -> None:
    p = prompt(4 * BLOCK + 2, salt=7)
    handoff = prefill(producer, p)
    files = [list(store.rglob(f"{h.hex()}.kvb")) for h in block_hashes(p)]
    assert [len(f) for f in files] == [1, 1, 1, 1]  # one worker: one file per block
    third = files[2][0]
    data = bytearray(third.read_bytes())
    data[-1] ^= 0xFF  # the third block: two load, the rest is recomputed
    third.write_bytes(bytes(data))
    got = tokens(consumer, p, with_params(handoff))
    assert got.num_cached_tokens == 2 * BLOCK
    assert got.outputs[0].token_ids == tokens(single, p).outputs[0].token_ids
    assert not third.exists()  # the bad file is gone: never read again


def test_params_a_role_cannot_serve_fail_the_request_by_name(producer: LLM, consumer: LLM) -> None:
    """The request fails (its error rebuilds as InvalidRequestError naming kv_transfer_params:
    AsyncLLM raises it, an HTTP server answers 400); the engine serves on."""
    p = prompt(2 * BLOCK)
    for llm, params, match in (
        (producer, {"do_remote_prefill": True}, "send the request to a consumer engine"),
        (consumer, {"do_remote_decode": True}, "send the request to a producer engine"),
        (consumer, {"do_remote_prefill": True, "num_tokens": 16}, "is not a pd hand-off"),
    ):
        out = tokens(llm, p, with_params(params))
        assert out.outputs[0].finish_reason == "error" and out.error is not None
        error = error_from_message(out.error)
        assert isinstance(error, InvalidRequestError) and match in str(error)
        assert error.param == "kv_transfer_params"
    assert tokens(consumer, p).outputs[0].token_ids == tokens(producer, p).outputs[0].token_ids
