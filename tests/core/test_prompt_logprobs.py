"""prompt_logprobs through the engine: the prefill's log-probabilities of each prompt token
equal transformers' log_softmax over the whole sequence, also when the prompt is computed
in chunks and when its prefix is in the prefix cache (it is computed again, not read)."""

from __future__ import annotations

import os

import pytest
import torch

from baton import LLM, RequestOutput, SamplingParams
from baton.errors import InvalidRequestError
from baton.testing.tiny_model import tiny_model
from baton.worker import step_sampling

os.environ.setdefault("HF_HUB_OFFLINE", "1")

#: float32 on CPU: baton's paged attention against transformers' eager one
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def path() -> str:
    return str(tiny_model("llama"))


@pytest.fixture(scope="module")
def llm(path: str) -> LLM:
    # prompts of 23 tokens computed 5 at a time, in blocks of 4: chunks and cache hits
    return LLM(
        model=path,
        max_model_len=256,
        block_size=4,
        max_num_batched_tokens=32,
        long_prefill_token_threshold=5,
    )


def reference(path: str, prompt: list[int]) -> torch.Tensor:
    """transformers' log-probabilities at each position of ``prompt`` (the next token's)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def prompt_of(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 1000, (n,), generator=g).tolist()


def run(llm: LLM, prompt: list[int], **params: object) -> RequestOutput:
    sp = SamplingParams(temperature=0, max_tokens=2, **params)  # type: ignore[arg-type]
    return llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0]


def test_prompt_logprobs_equal_transformers_over_chunks(
    llm: LLM, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(step_sampling, "PROMPT_SCORE_ROWS", 2)  # each chunk scored in parts
    prompt = prompt_of(23)
    ref = reference(path, prompt)
    out = run(llm, prompt, prompt_logprobs=3)
    lps = out.prompt_logprobs
    assert lps is not None and len(lps) == len(prompt)
    assert lps[0] is None  # nothing predicts the first token
    for i in range(1, len(prompt)):
        pos = lps[i]
        assert pos is not None
        tok = pos[prompt[i]]
        assert tok.logprob == pytest.approx(float(ref[i - 1, prompt[i]]), abs=TOLERANCE)
        row, value = ref[i - 1], ref[i - 1, prompt[i]]
        # the rank up to near-ties (a random tiny model has many logits within the tolerance)
        lo = int((row > value + TOLERANCE).sum()) + 1
        hi = int((row > value - TOLERANCE).sum()) + 1
        assert tok.rank is not None and lo <= tok.rank <= hi
        top = sorted((lp for lp in pos.values() if (lp.rank or 0) <= 3), key=lambda lp: lp.rank)
        want = ref[i - 1].topk(3).values.tolist()
        assert [lp.rank for lp in top] == [1, 2, 3]
        assert [lp.logprob for lp in top] == pytest.approx(want, abs=TOLERANCE)
    assert out.outputs[0].logprobs is None  # prompt logprobs only: no sample logprobs


def test_cached_prefix_is_computed_again_for_prompt_logprobs(llm: LLM, path: str) -> None:
    shared = prompt_of(20, seed=1)
    first = run(llm, [*shared, 5, 6])
    again = run(llm, [*shared, 5, 7])
    assert again.num_cached_tokens >= 16  # without prompt_logprobs the prefix is read
    prompt = [*shared, 5, 8]
    out = run(llm, prompt, prompt_logprobs=0)
    assert out.num_cached_tokens == 0  # with them it is computed
    ref = reference(path, prompt)
    got = [lp[t].logprob for lp, t in zip(out.prompt_logprobs[1:], prompt[1:], strict=True)]
    want = [float(ref[i, t]) for i, t in enumerate(prompt[1:])]
    assert got == pytest.approx(want, abs=TOLERANCE)
    assert all(len(lp) == 1 for lp in out.prompt_logprobs[1:])  # k=0: the prompt token alone
    assert first.outputs[0].token_ids  # the earlier requests generated as usual


def test_a_one_token_prompt_has_only_none(llm: LLM) -> None:
    out = run(llm, [42], prompt_logprobs=1)
    assert out.prompt_logprobs == [None]


def test_prompt_logprobs_are_bounded(llm: LLM) -> None:
    with pytest.raises(InvalidRequestError, match="prompt_logprobs") as e:
        SamplingParams(prompt_logprobs=21)
    assert e.value.param == "prompt_logprobs"
    with pytest.raises(InvalidRequestError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)


def test_runner_scores_a_prompt_again_after_a_preemption_mid_prompt(path: str) -> None:
    from baton.config import BatonConfig
    from baton.protocol import KVCacheConfig
    from baton.testing.runner_driver import Driver
    from baton.worker.model_runner import ModelRunner
    from baton.worker.worker import runner_settings

    cfg = BatonConfig.load(model=path, block_size=4, max_num_batched_tokens=7, max_num_seqs=4)
    runner = ModelRunner(runner_settings(cfg), torch.device("cpu"))
    runner.load_model()
    runner.initialize_kv_cache(KVCacheConfig(num_blocks=64, block_size=4))
    d = Driver(runner, 64, 4, budget=7)
    d.add("o", prompt_of(9, seed=8), max_tokens=3)  # shares every step's budget
    prompt = prompt_of(23, seed=7)
    r = d.add("p", prompt, max_tokens=2, params=SamplingParams(temperature=0, prompt_logprobs=1))
    scores = []
    for _ in range(3):
        scores.append(d.step()[1].prompt_logprobs)
    assert 0 < r.computed < len(prompt) and not any(scores)  # mid-prompt: nothing returned yet
    d.preempt(r)  # its partial scores go with its row; it is computed again from the start
    while d.running:
        scores.append(d.step()[1].prompt_logprobs)
    [returned] = [s for s in scores if s]
    lps = returned["p"]
    ref = reference(path, prompt)
    assert [lp.token_ids[0] for lp in lps] == prompt[1:]
    want = [float(ref[i, t]) for i, t in enumerate(prompt[1:])]
    assert [lp.logprobs[0] for lp in lps] == pytest.approx(want, abs=TOLERANCE)
    assert all(len(lp.token_ids) == 2 for lp in lps)  # the prompt token and the top 1


def test_a_fault_while_scoring_fails_only_that_request(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(step_sampling, "PROMPT_SCORE_ROWS", 0)  # range() refuses a zero step
    scored, plain = llm.generate(
        [{"prompt_token_ids": prompt_of(12, seed=9)}, {"prompt_token_ids": prompt_of(8, seed=10)}],
        [
            SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=1),
            SamplingParams(temperature=0, max_tokens=3),
        ],
        use_tqdm=False,
    )
    assert scored.outputs[0].finish_reason == "error" and "ValueError" in (scored.error or "")
    assert plain.outputs[0].finish_reason == "length" and len(plain.outputs[0].token_ids) == 3
    monkeypatch.undo()
    again = run(llm, prompt_of(12, seed=9), prompt_logprobs=1)  # the engine serves on
    assert again.prompt_logprobs is not None and len(again.prompt_logprobs) == 12


def test_a_last_chunk_of_one_token_still_returns_the_scores(llm: LLM, path: str) -> None:
    # 21 tokens 5 at a time: the last chunk is the last prompt token alone, which scores
    # nothing itself; the earlier chunks' scores come back with it
    prompt = prompt_of(21, seed=2)
    out = run(llm, prompt, prompt_logprobs=0)
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(prompt)
    ref = reference(path, prompt)
    got = [lp[t].logprob for lp, t in zip(out.prompt_logprobs[1:], prompt[1:], strict=True)]
    want = [float(ref[i, t]) for i, t in enumerate(prompt[1:])]
    assert got == pytest.approx(want, abs=TOLERANCE)
