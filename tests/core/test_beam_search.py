"""Beam search in the engine (LLM.beam_search): the same beams as a reference beam search
written here over transformers' own logprobs, a best beam at least as likely as greedy
decoding, and beams that share their prompt's KV blocks (a fork allocates at most one block)
and give every block back at the end."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator

import pytest
import torch

from baton import LLM, AsyncLLM, SamplingParams
from baton.beam_search import BeamSearchParams
from baton.errors import InvalidRequestError
from baton.kv.manager import KVCacheManager
from baton.protocol import EngineCoreRequest
from baton.request import Request
from baton.testing.tiny_model import tiny_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")

#: float32 on CPU: baton's paged attention against transformers' eager one
TOLERANCE = 1e-4
BLOCK_SIZE = 4
#: prompt lengths on, just past and just before a block boundary: forks with and without a copy
PROMPT_LENGTHS = (8, 5, 11)


@pytest.fixture(scope="module")
def path() -> str:
    return str(tiny_model("llama"))


@pytest.fixture(scope="module")
def llm(path: str) -> Iterator[LLM]:
    with LLM(model=path, max_model_len=128, block_size=BLOCK_SIZE) as llm:
        yield llm


def prompt_of(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 1000, (n,), generator=g).tolist()


def reference_beam_search(
    path: str, prompt: list[int], width: int, max_tokens: int, eos: int, length_penalty: float
) -> list[tuple[list[int], float]]:
    """vLLM's beam search, each step a whole-sequence transformers forward (float32) per beam:
    (tokens, cumulative logprob) of the best ``width`` beams, best first."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def score(beam: tuple[list[int], float]) -> float:
        tokens, cum = beam
        n = len(tokens) - (tokens[-1] == eos)  # the prompt counts; a final EOS does not
        return cum / n**length_penalty

    beams: list[tuple[list[int], float]] = [(prompt, 0.0)]
    completed: list[tuple[list[int], float]] = []
    for _ in range(max_tokens):
        grown = []
        for tokens, cum in beams:
            with torch.no_grad():
                logits = model(torch.tensor([tokens])).logits[0, -1]
            top = torch.log_softmax(logits.float(), dim=-1).topk(2 * width)
            for lp, tok in zip(top.values.tolist(), top.indices.tolist(), strict=True):
                (completed if tok == eos else grown).append(([*tokens, tok], cum + lp))
        beams = sorted(grown, key=score, reverse=True)[:width]
        if not beams:
            break
    return sorted(completed + beams, key=score, reverse=True)[:width]


@pytest.mark.parametrize("length_penalty", [1.0, 0.5])
def test_beam_search_equals_a_reference_over_transformers(
    llm: LLM, path: str, length_penalty: float
) -> None:
    width, max_tokens = 3, 5
    prompts = [prompt_of(n, seed) for seed, n in enumerate(PROMPT_LENGTHS)]
    params = BeamSearchParams(
        beam_width=width, max_tokens=max_tokens, length_penalty=length_penalty
    )
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    eos = llm.get_tokenizer().eos_token_id
    assert len(outs) == len(prompts)
    for prompt, out in zip(prompts, outs, strict=True):
        ref = reference_beam_search(path, prompt, width, max_tokens, eos, length_penalty)
        assert [s.tokens for s in out.sequences] == [tokens for tokens, _ in ref]
        for seq, (tokens, cum) in zip(out.sequences, ref, strict=True):
            assert seq.cum_logprob == pytest.approx(cum, abs=TOLERANCE)
            assert seq.text == llm.get_tokenizer().decode(tokens[len(prompt) :])


def test_best_beam_is_at_least_as_likely_as_greedy(llm: LLM) -> None:
    prompts = [{"prompt_token_ids": prompt_of(n, 10 + n)} for n in (3, 6, 9, 12)]
    beams = llm.beam_search(prompts, BeamSearchParams(beam_width=4, max_tokens=6, ignore_eos=True))
    greedy = llm.generate(
        prompts,
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0),
        use_tqdm=False,
    )
    for beam, g in zip(beams, greedy, strict=True):
        assert len(beam.sequences) == 4
        best = beam.sequences[0]
        assert len(best.tokens) == len(g.prompt_token_ids) + 6
        assert g.outputs[0].cumulative_logprob is not None
        assert best.cum_logprob >= g.outputs[0].cumulative_logprob - TOLERANCE
        scores = [s.cum_logprob for s in beam.sequences]  # same lengths: sorted by cum_logprob
        assert scores == sorted(scores, reverse=True)


def test_beams_fork_their_kv_and_free_it_all(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    forks: list[tuple[int, int]] = []  # (blocks allocated, copies) per fork
    real_fork = KVCacheManager.fork

    def counting_fork(self: KVCacheManager, parent: str, child: str, n: int):  # type: ignore[no-untyped-def]
        free = self.num_free_blocks
        copies = real_fork(self, parent, child, n)
        assert copies is not None
        forks.append((free - self.num_free_blocks, len(copies)))
        shared = self.get_block_ids(child)[: n // self.block_size]
        assert shared == self.get_block_ids(parent)[: n // self.block_size]
        return copies

    monkeypatch.setattr(KVCacheManager, "fork", counting_fork)
    llm.reset_prefix_cache()
    width, max_tokens = 3, 6
    llm.beam_search(
        [{"prompt_token_ids": prompt_of(n, 20 + n)} for n in PROMPT_LENGTHS],
        BeamSearchParams(beam_width=width, max_tokens=max_tokens, ignore_eos=True),
    )
    # every step after the first forks each live beam from the request of its parent beam
    assert len(forks) == len(PROMPT_LENGTHS) * width * (max_tokens - 1)
    assert all(allocated == copies <= 1 for allocated, copies in forks)
    assert any(copies == 0 for _, copies in forks) and any(copies == 1 for _, copies in forks)
    stats = llm.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks  # retained KV was all given back
    assert llm.reset_prefix_cache()  # refused while any request holds a block


def test_kv_manager_fork_shares_full_blocks_and_copies_the_partial_one() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4)
    parent = Request("p", list(range(10)), SamplingParams(max_tokens=1))
    assert kv.allocate_slots(parent, 10) is not None
    parent_ids = list(kv.get_block_ids("p"))
    free = kv.num_free_blocks
    copies = kv.fork("p", "c", 10)
    child_ids = kv.get_block_ids("c")
    assert child_ids[:2] == parent_ids[:2] and child_ids[2] != parent_ids[2]
    assert copies == [(parent_ids[2], child_ids[2])]
    assert kv.num_free_blocks == free - 1
    view = kv.view()
    assert [view.ref_cnts[b] for b in parent_ids] == [2, 2, 1]
    assert kv.fork("p", "d", 8) == []  # on a block boundary: nothing to copy, nothing allocated
    assert kv.num_free_blocks == free - 1
    with pytest.raises(ValueError, match="already holds"):
        kv.fork("p", "c", 4)
    for rid in ("p", "c", "d"):
        kv.free(Request(rid, [], SamplingParams(max_tokens=1)))
    assert kv.num_free_blocks == kv.num_total_blocks


def test_a_fork_from_a_request_holding_no_kv_is_refused(llm: LLM) -> None:
    req = EngineCoreRequest(
        request_id="orphan",
        prompt_token_ids=[5, 6, 7],
        sampling_params=SamplingParams(max_tokens=1),
        fork_from="nobody",
    )
    with pytest.raises(InvalidRequestError, match="nobody"):
        llm.engine.add_request(req)


def test_bad_beam_search_params_are_refused(llm: LLM) -> None:
    with pytest.raises(InvalidRequestError, match="beam_width"):
        llm.beam_search("hi", BeamSearchParams(beam_width=0, max_tokens=3))
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        llm.beam_search("hi", BeamSearchParams(beam_width=2, max_tokens=0))


def test_beam_search_with_the_engine_in_its_own_process(llm: LLM, path: str) -> None:
    # fork_from and retain_kv cross the zmq transport as EngineCoreRequest fields
    prompts = [{"prompt_token_ids": prompt_of(n, 30 + n)} for n in PROMPT_LENGTHS]
    params = BeamSearchParams(beam_width=2, max_tokens=4)
    here = llm.beam_search(prompts, params)
    with LLM(model=path, max_model_len=128, block_size=BLOCK_SIZE, transport="zmq") as remote:
        there = remote.beam_search(prompts, params)
        stats = remote.get_stats()
    assert [[s.tokens for s in o.sequences] for o in there] == [
        [s.tokens for s in o.sequences] for o in here
    ]
    for a, b in zip(here, there, strict=True):
        for x, y in zip(a.sequences, b.sequences, strict=True):
            assert x.cum_logprob == pytest.approx(y.cum_logprob, abs=TOLERANCE)
    assert stats.num_free_blocks == stats.num_total_blocks


async def test_async_beam_searches_run_together_and_match_the_offline_one(
    llm: LLM, path: str
) -> None:
    prompts = [{"prompt_token_ids": prompt_of(n, 40 + n)} for n in PROMPT_LENGTHS]
    params = BeamSearchParams(beam_width=2, max_tokens=4)
    offline = await asyncio.to_thread(llm.beam_search, prompts, params)
    engine = await AsyncLLM.create(model=path, max_model_len=128, block_size=BLOCK_SIZE)
    try:
        outs = await asyncio.gather(*(engine.beam_search(p, params) for p in prompts))
        stats = await engine.get_stats()
    finally:
        engine.shutdown()
    for a, b in zip(offline, outs, strict=True):
        assert [s.tokens for s in b.sequences] == [s.tokens for s in a.sequences]
        assert [s.text for s in b.sequences] == [s.text for s in a.sequences]
    assert stats.num_free_blocks == stats.num_total_blocks


@pytest.mark.parametrize("caching", [True, False])
def test_beam_search_in_a_cache_too_small_to_keep_every_beam(
    llm: LLM, path: str, caching: bool
) -> None:
    # 12 blocks of 4 tokens for 9 beams of up to 17 tokens: forks fall back to computing their
    # prefix, finished beams' blocks are taken back for waiting ones; no deadlock, same beams
    prompts = [{"prompt_token_ids": prompt_of(n, 50 + n)} for n in PROMPT_LENGTHS]
    params = BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True)
    want = llm.beam_search(prompts, params)
    with LLM(
        model=path,
        max_model_len=32,
        block_size=BLOCK_SIZE,
        kv_cache_memory=40000,
        **{"cache.enable_prefix_caching": caching},
    ) as small:
        assert small.get_stats().num_total_blocks == 12
        got = small.beam_search(prompts, params)
        stats = small.get_stats()
    assert [[s.tokens for s in o.sequences] for o in got] == [
        [s.tokens for s in o.sequences] for o in want
    ]
    assert stats.num_free_blocks == stats.num_total_blocks


def test_sleep_is_refused_while_a_request_keeps_its_kv_for_forks(llm: LLM) -> None:
    # its blocks' KV would be gone after wake_up, and a fork would copy garbage
    llm.engine.add_request(
        EngineCoreRequest(
            request_id="kept",
            prompt_token_ids=[5, 6, 7, 8, 9],
            sampling_params=SamplingParams(max_tokens=1),
            retain_kv=True,
        )
    )
    while not any(o.request_id == "kept" and o.finished for o in llm.engine.get_output().outputs):
        pass
    with pytest.raises(InvalidRequestError, match="keep their KV for forks"):
        llm.sleep()
    llm.engine.abort_requests(["kept"])  # frees its blocks
    llm.sleep()
    llm.wake_up()
    stats = llm.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks
