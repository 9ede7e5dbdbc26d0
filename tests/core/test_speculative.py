"""Speculative decoding: the ngram speculator, draft scheduling and verification.

Greedy and seeded outputs with speculation equal those without (drafts change how
many tokens a step yields, never which); a proposer that is right only sometimes
exercises partial acceptance, stops inside accepted drafts and max_tokens; the
accounting (budget, KV, num_computed_tokens) is checked on the scheduler; unseeded
sampling keeps its distribution.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Sequence

import pytest

from baton.config import BatonConfig
from baton.errors import ConfigError
from baton.plugins.registry import get_plugins
from baton.request import Request
from baton.sampling_params import SamplingParams
from baton.speculative.ngram import NgramSpeculator
from baton.testing import FakeExecutor
from baton.testing.conformance.speculator import PROMPTS, SpeculatorConformance, run_engine
from baton.testing.tiny_model import tiny_model


class TestNgramConformance(SpeculatorConformance):
    name = "ngram"


def req(tokens: Sequence[int], rid: str = "r") -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=100))


# ---------------------------------------------------------------------- the ngram speculator


def test_ngram_copies_what_followed_the_latest_longest_match():
    spec = NgramSpeculator(min_n=2, max_n=3)
    # "1 2 3" occurred twice, followed by 4 5 then by 9 9: the latest wins
    assert spec.propose(req([1, 2, 3, 4, 5, 0, 1, 2, 3, 9, 9, 0, 1, 2, 3]), 2) == [9, 9]
    # a 3-gram match beats a later 2-gram one
    spec = NgramSpeculator(min_n=2, max_n=3)
    assert spec.propose(req([7, 2, 3, 4, 8, 2, 3, 5, 7, 2, 3]), 1) == [4]
    spec = NgramSpeculator(min_n=2, max_n=3)
    assert spec.propose(req([1, 2, 3, 4, 5, 6]), 3) == []


def test_ngram_continues_a_recent_match_periodically():
    spec = NgramSpeculator(min_n=2, max_n=4)
    assert spec.propose(req([5, 1, 2, 1, 2]), 5) == [1, 2, 1, 2, 1]
    spec = NgramSpeculator(min_n=2, max_n=4)
    assert spec.propose(req([9, 9, 9]), 3) == [9, 9, 9]


def test_ngram_indexes_new_tokens_as_they_arrive():
    spec = NgramSpeculator(min_n=2, max_n=2)
    r = req([1, 2, 3])
    assert spec.propose(r, 2) == []
    r.all_token_ids.extend([4, 1, 2])  # 1 2 now recurs: it was followed by 3 4
    assert spec.propose(r, 2) == [3, 4]
    spec.finished(r)
    assert spec.propose(req([8, 9]), 2) == []


def test_ngram_settings_are_checked():
    with pytest.raises(ConfigError, match="prompt_lookup_min"):
        BatonConfig.load(
            speculative={"method": "ngram", "ngram": {"prompt_lookup_min": 5}}
        ).plugin_settings("speculative", "ngram", None)


# ---------------------------------------------------------------------- an oracle proposer


class Oracle:
    """Proposes the reference continuation, wrong at every ``wrong_every``-th draft position."""

    def __init__(self, reference: dict[tuple[int, ...], list[int]], wrong_every: int) -> None:
        self.reference = reference
        self.wrong_every = wrong_every
        self.calls = 0
        self.observed: list[tuple[int, int]] = []
        self.finished_ids: list[str] = []

    def propose(self, request: Request, max_tokens: int) -> list[int]:
        prompt = tuple(request.prompt_token_ids)
        out = request.all_token_ids[len(prompt) :]
        ref = self.reference[prompt]
        guess = ref[len(out) : len(out) + max_tokens]
        self.calls += 1
        return [
            (t + 1) % 1000 if (self.calls + i) % self.wrong_every == 0 else t
            for i, t in enumerate(guess)
        ]

    def observe(self, request: Request, num_proposed: int, num_accepted: int) -> None:
        self.observed.append((num_proposed, num_accepted))

    def finished(self, request: Request) -> None:
        self.finished_ids.append(request.request_id)


_ORACLES: list[Oracle] = []


class _OraclePlugin:
    from baton import hookimpl

    @hookimpl
    def register_speculators(self, register) -> None:  # type: ignore[no-untyped-def]
        register("oracle", lambda config, settings: _ORACLES[-1])


@pytest.fixture(scope="module")
def oracle_registered():
    """The oracle in this process's plugins for this module only: a worker process (a parallel
    executor in a later test) refuses to start when its plugins differ from the engine's."""
    plugins = get_plugins()
    plugins.register(_OraclePlugin(), "test-oracle", "tests", "0")
    yield
    plugins.unregister("test-oracle")


def engine_config(method: str, **overrides) -> BatonConfig:
    return BatonConfig.load(
        model=str(tiny_model("llama")),
        max_model_len=256,
        log_stats=True,
        speculative={"method": method, "num_tokens": 5, "disable_by_batch_size": None},
        **overrides,
    )


def test_partial_acceptance_stops_and_lengths_equal_speculation_off(oracle_registered):
    prompts = [list(p) for p in PROMPTS]
    free = SamplingParams(temperature=0.0, max_tokens=37, ignore_eos=True)
    reference, _ = run_engine(engine_config("none"), prompts, [free] * 3)
    ref = {tuple(p): reference[f"r{i}"] for i, p in enumerate(prompts)}
    # stop on a token that the reference reaches mid-output, max_tokens inside a draft run
    stop_tok = reference["r0"][20]
    params = [
        SamplingParams(temperature=0.0, max_tokens=37, ignore_eos=True, stop_token_ids=[stop_tok]),
        SamplingParams(temperature=0.0, max_tokens=23, ignore_eos=True),
        free,
    ]
    off, _ = run_engine(engine_config("none"), prompts, params)
    for wrong_every in (3, 1000):
        oracle = Oracle(ref, wrong_every)
        _ORACLES.append(oracle)
        on, stats = run_engine(engine_config("oracle"), prompts, params)
        assert on == off
        assert off["r0"][-1] == stop_tok and len(off["r0"]) <= 21
        assert len(on["r1"]) == 23
        proposed = sum(p for p, _ in oracle.observed)
        accepted = sum(a for _, a in oracle.observed)
        assert (
            stats.spec_num_draft_tokens == proposed and stats.spec_num_accepted_tokens == accepted
        )
        assert sum(stats.spec_accepted_per_position) == accepted
        if wrong_every == 3:
            assert 0 < accepted < proposed
        else:  # always right: every draft accepted
            assert accepted == proposed > 0
        assert sorted(oracle.finished_ids) == ["r0", "r1", "r2"]


def test_seeded_sampling_penalties_min_tokens_and_logprobs_equal_speculation_off(
    oracle_registered,
):
    prompts = [list(p) for p in PROMPTS]
    params = [
        SamplingParams(temperature=0.9, seed=3, max_tokens=30, ignore_eos=True, logprobs=2),
        SamplingParams(
            temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5, max_tokens=30
        ),
        SamplingParams(
            temperature=0.8, top_p=0.9, seed=11, frequency_penalty=0.4, max_tokens=30, min_tokens=12
        ),
    ]
    off, _ = run_engine(engine_config("none"), prompts, params)
    _ORACLES.append(Oracle({tuple(p): off[f"r{i}"] for i, p in enumerate(prompts)}, 4))
    on, stats = run_engine(engine_config("oracle"), prompts, params)
    assert on == off
    assert stats.spec_num_accepted_tokens > 0


def test_token_constraints_equal_speculation_off(oracle_registered):
    # a verifying row is constrained as decoding would constrain it: a bad word's prefix may
    # end in the drafts before it, and allowed tokens / biases hold for every draft position
    prompts = [list(p) for p in PROMPTS]
    free, _ = run_engine(
        engine_config("none"), prompts, [SamplingParams(temperature=0.0, max_tokens=24)] * 3
    )
    a, b = free["r1"][3:5]  # banned as a word: b may not follow a
    params = [
        SamplingParams(temperature=0.0, max_tokens=24, allowed_token_ids=[11, 12, 13]),
        SamplingParams(temperature=0.0, max_tokens=24, bad_words_token_ids=[[11], [a, b]]),
        SamplingParams(temperature=0.0, max_tokens=24, logit_bias={12: 8.0, 13: -100.0}),
    ]
    off, _ = run_engine(engine_config("none"), prompts, params)
    assert set(off["r0"]) <= {11, 12, 13}
    out = off["r1"]
    assert (a, b) not in itertools.pairwise(out)  # b only where a is not before it
    assert out[0] == free["r1"][0]
    words = {tuple(p): off[f"r{i}"] for i, p in enumerate(prompts)}
    _ORACLES.append(Oracle(words, 3))
    on, stats = run_engine(engine_config("oracle"), prompts, params)
    assert on == off
    assert stats.spec_num_accepted_tokens > 0


def test_unseeded_sampling_keeps_its_distribution(oracle_registered):
    """400 samples of 3 tokens under top_k=2: the joint frequencies with drafts (the greedy
    guess, accepted only when the draw equals it) match those without, within what two
    independent samplings differ by. The sampler's generator is seeded (model.seed): the
    figures are the same on every run."""
    prompt = PROMPTS[0]
    n = 400
    params = [SamplingParams(temperature=1.0, top_k=2, max_tokens=3, ignore_eos=True)] * n
    greedy, _ = run_engine(
        engine_config("none"), [list(prompt)], [SamplingParams(temperature=0.0, max_tokens=3)]
    )

    def joint(method: str, seed: int) -> Counter[tuple[int, ...]]:
        cfg = engine_config(method, max_num_seqs=n, seed=seed)
        out, _ = run_engine(cfg, [list(prompt)] * n, params)
        return Counter(tuple(t) for t in out.values())

    _ORACLES.append(Oracle({tuple(prompt): greedy["r0"]}, 10**9))
    on = joint("oracle", 1)
    off = joint("none", 2)
    off2 = joint("none", 3)
    assert len(on) > 2

    def tvd(a: Counter, b: Counter) -> float:
        return sum(abs(a[k] - b[k]) for k in a.keys() | b.keys()) / (2 * n)

    # two independent samplings of 400 differ by ~0.05-0.1 here; a biased verifier (e.g.
    # accepting drafts without comparing) would put ~all mass on the greedy sequence
    assert tvd(on, off) < 0.15, (on.most_common(4), off.most_common(4), tvd(off, off2))
    assert on[tuple(greedy["r0"])] / n < 0.9


# ---------------------------------------------------------------------- scheduling and modes


def test_a_batch_queue_refuses_speculation():
    from baton.engine.core import EngineCore
    from baton.protocol import ModelInfo

    info = ModelInfo(
        path="fake", architecture="Fake", vocab_size=32000, max_model_len=512, eos_token_ids=[0]
    )
    config = BatonConfig.load(max_model_len=512, speculative={"method": "ngram"})
    with pytest.raises(ConfigError, match=r"speculative.method='ngram'.*batches in flight"):
        EngineCore(
            config,
            executor=FakeExecutor(block_size=config.cache.block_size, max_concurrent_batches=2),
            info=info,
        )


class Always:
    """Proposes 1, 2, 3, ...: drafts every step."""

    def propose(self, request: Request, max_tokens: int) -> list[int]:
        return list(range(1, max_tokens + 1))

    def observe(self, request: Request, num_proposed: int, num_accepted: int) -> None:
        pass

    def finished(self, request: Request) -> None:
        pass


def test_rejected_drafts_are_taken_back_and_steps_stay_within_budget(oracle_registered):
    """The fake executor accepts no draft: every step's drafts are taken back, budgets hold,
    outputs equal speculation off, and big batches get no drafts."""
    from baton.engine.core import EngineCore
    from baton.protocol import EngineCoreRequest, ModelInfo

    info = ModelInfo(
        path="fake", architecture="Fake", vocab_size=32000, max_model_len=512, eos_token_ids=[0]
    )

    def run(method: str, n_reqs: int) -> tuple[dict[str, list[int]], list, EngineCore]:
        config = BatonConfig.load(
            max_model_len=512,
            max_num_batched_tokens=64,
            speculative={"method": method, "num_tokens": 4, "disable_by_batch_size": 2},
        )
        core = EngineCore(
            config, executor=FakeExecutor(block_size=config.cache.block_size), info=info
        )
        for i in range(n_reqs):
            core.add_request(
                EngineCoreRequest(
                    request_id=f"r{i}",
                    prompt_token_ids=[3, 4, 5, 3, 4, 5, 3, 4] * (i + 1),
                    sampling_params=SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                )
            )
        tokens: dict[str, list[int]] = {}
        schedules = []
        sched = core.scheduler
        original = sched.schedule

        def spy():
            so = original()
            schedules.append(so)
            for rid, drafts in so.scheduled_spec_decode_tokens.items():
                assert so.num_scheduled_tokens[rid] == 1 + len(drafts)
            assert so.total_num_scheduled_tokens <= 64
            return so

        sched.schedule = spy
        while core.has_work():
            outs, _ = core.step_fn()
            for o in outs.outputs if outs else ():
                tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            for r in sched.running:
                assert r.num_computed_tokens == r.num_tokens - 1 or r.num_tokens == len(
                    r.prompt_token_ids
                )
        return tokens, schedules, core

    _ORACLES.append(Always())  # type: ignore[arg-type]
    off, _, _ = run("none", 2)
    on, schedules, core = run("oracle", 2)
    assert on == off
    assert any(so.scheduled_spec_decode_tokens for so in schedules)
    stats = core.scheduler.make_stats(delta=False)
    # the fake model's tokens are never 1, 2, 3, ...: nothing accepted
    assert stats.spec_num_draft_tokens > 0 and stats.spec_num_accepted_tokens == 0
    _, schedules3, _ = run("oracle", 3)  # 3 running > disable_by_batch_size=2
    assert not any(so.scheduled_spec_decode_tokens for so in schedules3[2:])


class FakeSeer:
    """Proposes the fake executor's next tokens, every third draft position wrong."""

    def __init__(self, fake: FakeExecutor) -> None:
        self.fake = fake
        self.calls = 0

    def propose(self, request: Request, max_tokens: int) -> list[int]:
        self.calls += 1
        tokens = list(request.all_token_ids)
        out = []
        for i in range(max_tokens):
            tok = self.fake.next_token(tokens, request.num_prompt_tokens)
            tokens.append(tok)
            out.append(tok + 1 if (self.calls + i) % 3 == 0 else tok)
        return out

    def observe(self, request: Request, num_proposed: int, num_accepted: int) -> None:
        pass

    def finished(self, request: Request) -> None:
        pass


def test_drafts_under_preemption_and_prefix_caching_keep_outputs_and_kv_exact(oracle_registered):
    """A cache too small for every request: requests with drafts are preempted and recomputed,
    shared prompt prefixes come from the prefix cache, and the fake executor checks every KV
    slot a step reads (deep_check); outputs equal speculation off."""
    from baton.engine.core import EngineCore
    from baton.protocol import EngineCoreRequest, ModelInfo
    from baton.testing import FakeExecutorSettings

    info = ModelInfo(
        path="fake", architecture="Fake", vocab_size=32000, max_model_len=256, eos_token_ids=[0]
    )
    shared = [9, 8, 7, 6, 5, 4, 3, 2] * 4  # two blocks of 16, shared by every prompt

    def run(method: str) -> tuple[dict[str, list[int]], object]:
        config = BatonConfig.load(
            max_model_len=256,
            block_size=16,
            max_num_batched_tokens=128,
            speculative={"method": method, "num_tokens": 4, "disable_by_batch_size": None},
        )
        fake = FakeExecutor(FakeExecutorSettings(num_blocks=24, deep_check=True), block_size=16)
        _ORACLES.append(FakeSeer(fake))  # type: ignore[arg-type]
        core = EngineCore(config, executor=fake, info=info)
        for i in range(6):
            core.add_request(
                EngineCoreRequest(
                    request_id=f"r{i}",
                    prompt_token_ids=shared + [100 + i] * (3 + i),
                    sampling_params=SamplingParams(temperature=0, max_tokens=60, ignore_eos=True),
                )
            )
        tokens: dict[str, list[int]] = {}
        while core.has_work():
            outs, _ = core.step_fn()
            for o in outs.outputs if outs else ():
                tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
        stats = core.scheduler.make_stats(delta=False)
        core.shutdown()
        return tokens, stats

    off, _ = run("none")
    on, on_stats = run("oracle")
    assert on == off and all(len(t) == 60 for t in on.values())
    assert on_stats.num_preemptions > 0 and on_stats.prefix_cache_hits > 0
    assert 0 < on_stats.spec_num_accepted_tokens < on_stats.spec_num_draft_tokens
