"""The sampler: greedy, filters' support sets, seeds, penalties, logprobs, bitmask."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from baton.protocol import NewRequestData
from baton.sampling_params import SamplingParams
from baton.worker import sampler as sampler_mod
from baton.worker.input_batch import InputBatch
from baton.worker.sampler import Sampler, apply_bitmask, step_seed
from baton.worker.sampling_metadata import sampling_metadata

V = 1000


def make_batch(params: list[SamplingParams], prompts=None, outputs=None, eos=(2,)) -> InputBatch:
    b = InputBatch(len(params), 256, 16)
    for i, sp in enumerate(params):
        prompt = prompts[i] if prompts else [5, 6, 7]
        out = outputs[i] if outputs else []
        b.add_request(
            NewRequestData(
                req_id=f"r{i}",
                prompt_token_ids=prompt,
                sampling_params=sp,
                block_ids=[i],
                num_computed_tokens=0,
                output_token_ids=out,
            ),
            eos,
        )
    return b


def sample(params, logits, prompts=None, outputs=None, seed=0, eos=(2,)):
    b = make_batch(params, prompts, outputs, eos)
    md = sampling_metadata(b, np.arange(len(params)), logits.shape[1], torch.device("cpu"))
    return Sampler(torch.device("cpu"), seed)(logits.clone(), md)


def rand_logits(n, seed=0, scale=3.0):
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * scale


def test_all_greedy_is_argmax_without_the_random_path(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("the all-greedy batch went through the random path")

    monkeypatch.setattr(Sampler, "_sample_mixed", boom)
    logits = rand_logits(5)
    out = sample([SamplingParams(temperature=0)] * 5, logits)
    assert out.token_ids.tolist() == logits.argmax(-1).tolist()
    assert out.logprobs is None


def test_mixed_batch_keeps_greedy_rows_exact():
    logits = rand_logits(6)
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.5, top_p=0.5),
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.7, top_k=3, min_p=0.1),
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.0),
    ]
    out = sample(params, logits).token_ids
    for i in (0, 2, 4):
        assert out[i] == logits[i].argmax()


def test_top_k_support():
    logits = rand_logits(1)
    allowed = set(logits[0].topk(5).indices.tolist())
    seen = {
        int(sample([SamplingParams(temperature=2.0, top_k=5, seed=s)], logits).token_ids[0])
        for s in range(200)
    }
    assert seen <= allowed and len(seen) >= 4


@pytest.mark.parametrize("top_k", [0, 50])
def test_top_p_support(top_k):
    logits = rand_logits(1, seed=1, scale=2.0)
    x = logits[0]
    if top_k:
        x = x.masked_fill(x < x.topk(top_k).values[-1], float("-inf"))
    probs = x.softmax(-1)
    order = probs.argsort(descending=True)
    cum = probs[order].cumsum(0)
    nucleus = set(order[: int((cum < 0.6).sum()) + 1].tolist())
    seen = {
        int(sample([SamplingParams(top_p=0.6, top_k=top_k, seed=s)], logits).token_ids[0])
        for s in range(300)
    }
    assert seen <= nucleus and len(seen) > 1


@pytest.mark.parametrize("vocab", [V, 10_000])
def test_top_p_with_a_nucleus_wider_than_the_candidates(vocab):
    # nearly uniform, ordered by token id: the 0.9 nucleus is most of the vocabulary, past every
    # candidate count (V: past the first only)
    logits = (-torch.arange(vocab, dtype=torch.float32) * 1e-5).expand(2, vocab).contiguous()
    probs = logits[0].softmax(-1)
    nucleus = int(((probs.cumsum(0) - probs) < 0.9).sum())
    for seeded in (True, False):
        seen = set()
        for s in range(150):
            sp = SamplingParams(top_p=0.9, seed=s if seeded else None)
            seen |= set(sample([sp, sp], logits, seed=s).token_ids.tolist())
        assert max(seen) > sampler_mod.TOP_P_CANDIDATES[0] and max(seen) < nucleus + 1


def test_min_p_support():
    logits = rand_logits(1, seed=2)
    probs = logits[0].softmax(-1)
    allowed = set((probs >= 0.2 * probs.max()).nonzero().flatten().tolist())
    seen = {
        int(sample([SamplingParams(min_p=0.2, seed=s)], logits).token_ids[0]) for s in range(200)
    }
    assert seen <= allowed and len(seen) > 1


def test_sampling_follows_the_distribution():
    logits = torch.full((1, V), float("-inf"))
    logits[0, :4] = torch.log(torch.tensor([0.1, 0.2, 0.3, 0.4]))
    counts = np.bincount(
        [int(sample([SamplingParams(seed=s)], logits).token_ids[0]) for s in range(4000)],
        minlength=4,
    )
    assert np.abs(counts[:4] / 4000 - [0.1, 0.2, 0.3, 0.4]).max() < 0.03


def test_seeded_rows_do_not_depend_on_batch_companions():
    logits = rand_logits(4, scale=0.5)
    alone = sample([SamplingParams(seed=42)], logits[2:3]).token_ids[0]
    params = [
        SamplingParams(temperature=0),
        SamplingParams(top_k=5),
        SamplingParams(seed=42),
        SamplingParams(temperature=0.5),
    ]
    for companion_seed in range(5):
        assert sample(params, logits, seed=companion_seed).token_ids[2] == alone


def test_seed_and_output_position_fix_the_draw():
    assert step_seed(7, 3) == step_seed(7, 3)
    assert len({step_seed(7, p) for p in range(100)}) == 100
    assert step_seed(7, 3) != step_seed(8, 3)
    logits = rand_logits(1, scale=0.1)
    # same seed, same output position (e.g. recomputed after a preemption): the same token
    a = sample([SamplingParams(seed=3)], logits, outputs=[[9, 9]]).token_ids[0]
    b = sample([SamplingParams(seed=3)], logits, outputs=[[4, 4]]).token_ids[0]
    draws = {
        int(sample([SamplingParams(seed=3)], logits, outputs=[[9] * k]).token_ids[0])
        for k in range(20)
    }
    assert a == b and len(draws) > 5


def hf_repetition(logits, ids, penalty):
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    return RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([ids]), logits[None].clone())[0]


def test_penalties_match_a_reference(monkeypatch):
    logits = rand_logits(3)
    prompts = [[1, 2, 3, 3], [10, 11], [4]]
    outputs = [[3, 5, 5, 5], [], [7, 7, 8]]
    params = [
        SamplingParams(temperature=0, repetition_penalty=1.3),
        SamplingParams(temperature=0, presence_penalty=0.5, frequency_penalty=0.25),
        SamplingParams(
            temperature=0, repetition_penalty=0.8, presence_penalty=-1.0, frequency_penalty=1.5
        ),
    ]
    seen = {}
    real_argmax = sampler_mod.argmax_rows

    def spy(rows: torch.Tensor) -> torch.Tensor:
        seen["logits"] = rows.clone()
        return real_argmax(rows)

    monkeypatch.setattr(sampler_mod, "argmax_rows", spy)
    sample(params, logits, prompts, outputs)
    got = seen["logits"]
    want0 = hf_repetition(logits[0], prompts[0] + outputs[0], 1.3)
    want1 = logits[1].clone()  # no output yet: presence/frequency change nothing
    want2 = hf_repetition(logits[2], prompts[2] + outputs[2], 0.8)
    want2[7] -= 1.5 * 2 - 1.0
    want2[8] -= 1.5 * 1 - 1.0
    torch.testing.assert_close(got, torch.stack([want0, want1, want2]))


def test_logprobs_are_raw_log_softmax():
    logits = rand_logits(3)
    params = [
        SamplingParams(temperature=0, logprobs=3),
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.8, top_k=4, logprobs=0, repetition_penalty=1.5),
    ]
    out = sample(params, logits, outputs=[[1], [1], [int(logits[2].argmax())]])
    ref = logits.log_softmax(-1)
    lp0, lp1, lp2 = out.logprobs
    assert lp1 is None
    tok = int(out.token_ids[0])
    assert lp0.token_ids[0] == tok and lp0.sampled_rank == 1
    assert lp0.token_ids[1:] == ref[0].topk(3).indices.tolist()
    np.testing.assert_allclose(
        lp0.logprobs, [ref[0, tok].item(), *ref[0].topk(3).values.tolist()], rtol=1e-5
    )
    tok2 = int(out.token_ids[2])
    assert lp2.token_ids == [tok2]
    assert lp2.logprobs[0] == pytest.approx(
        ref[2, tok2].item(), rel=1e-5
    )  # before penalties/temperature
    assert lp2.sampled_rank == int((ref[2] > ref[2, tok2]).sum()) + 1


def test_min_tokens_bans_stop_tokens():
    logits = torch.zeros(2, V)
    logits[:, 2] = 10.0  # EOS
    logits[:, 9] = 9.0  # a stop token id
    params = [
        SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[9]),
        SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[9]),
    ]
    out = sample(params, logits, outputs=[[1], [1, 1, 1]], eos=(2,)).token_ids
    assert out.tolist()[0] not in (2, 9)
    assert out.tolist()[1] == 2  # min_tokens reached
    ignore = sample(
        [SamplingParams(temperature=0, min_tokens=3, ignore_eos=True)], logits[:1], eos=(2,)
    )
    assert ignore.token_ids.tolist() == [2]  # ignore_eos: EOS is not a stop token to ban


def test_apply_bitmask():
    g = torch.Generator().manual_seed(0)
    words = -(-V // 32)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (2, words), generator=g, dtype=torch.int64).to(
        torch.int32
    )
    logits = torch.randn(3, V, generator=g)
    before = logits.clone()
    apply_bitmask(logits, bitmask, torch.tensor([2, 0]))
    for mrow, lrow in ((0, 2), (1, 0)):
        bits = [(int(bitmask[mrow, t // 32]) >> (t % 32)) & 1 for t in range(V)]
        allowed = torch.tensor(bits, dtype=torch.bool)
        assert torch.equal(logits[lrow][allowed], before[lrow][allowed])
        assert torch.isinf(logits[lrow][~allowed]).all()
    assert torch.equal(logits[1], before[1])


def test_bitmask_then_sampling_picks_allowed_tokens():
    words = -(-V // 32)
    bitmask = torch.zeros(1, words, dtype=torch.int32)
    bitmask[0, 3] = 0b1010  # tokens 97 and 99
    for sp in (
        SamplingParams(temperature=0),
        SamplingParams(seed=1),
        SamplingParams(top_p=0.5, seed=2),
    ):
        logits = rand_logits(1)
        apply_bitmask(logits, bitmask)
        assert int(sample([sp], logits).token_ids[0]) in (97, 99)


def test_bitmask_layout_agrees_with_xgrammar():
    xgr = pytest.importorskip("xgrammar")
    g = torch.Generator().manual_seed(3)
    words = -(-V // 32)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, words), generator=g, dtype=torch.int64).to(
        torch.int32
    )
    logits = torch.randn(3, V, generator=g)
    ours, theirs = logits.clone(), logits.clone()
    apply_bitmask(ours, bitmask)
    xgr.apply_token_bitmask_inplace(theirs, bitmask, vocab_size=V)
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs))


def test_an_overflowing_penalty_samples_an_allowed_token():
    """repetition_penalty=5e-324 divides a positive logit to +inf (the schema fuzzer's case):
    the draw is still one of the tokens the bitmask allows, never a NaN pick."""
    from baton.worker.sampler import apply_bitmask

    logits = rand_logits(2, seed=5)
    logits[:, 7] = 3.0
    logits[:, 40] = -2.0
    bitmask = torch.zeros(2, (V + 31) // 32, dtype=torch.int32)
    bitmask[:, 0] = 1 << 7
    bitmask[:, 1] = 1 << 8
    apply_bitmask(logits, bitmask)
    for seed in (None, 3):
        sp = SamplingParams(repetition_penalty=5e-324, temperature=0.5, seed=seed)
        out = sample([sp, sp], logits, prompts=[[7, 40], [7]])
        assert set(out.token_ids.tolist()) <= {7, 40}
