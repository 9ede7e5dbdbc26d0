"""Structured output with speculative decoding (xgrammar): drafts are cut to what the grammar
allows, every verification position is masked by its own bitmask row, and the matcher accepts
exactly the tokens kept. Outputs equal speculation off, with drafts accepted.

Three levels: the draft helpers on a real xgrammar matcher; the engine with the fake executor
(no model: fast, and every draft position's mask shapes its token); the engine with a tiny
random-weight model, greedy and seeded, json / regex / choice.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest
import torch

from baton import hookimpl
from baton.config import BatonConfig
from baton.engine.core import EngineCore
from baton.plugins.registry import get_plugins
from baton.protocol import EngineCoreRequest, FinishReason, ModelInfo
from baton.request import Request
from baton.sampling_params import SamplingParams, StructuredOutputSpec
from baton.structured.drafts import fill_draft_rows, grammar_prefix
from baton.testing import FakeExecutor
from baton.testing.conformance.speculator import run_engine
from baton.testing.tiny_model import tiny_model
from baton_xgrammar.backend import XGrammarBackend
from baton_xgrammar.plugin import XGrammarSettings

from .test_engine import CHOICES, EOS, REGEX, SCHEMA, VOCAB, text_of

XGRAMMAR = {"backend": "xgrammar", "xgrammar": {"max_whitespace_cnt": 2}}
SPECS = {
    "json": StructuredOutputSpec(json=SCHEMA),
    "regex": StructuredOutputSpec(regex=REGEX),
    "choice": StructuredOutputSpec(choice=CHOICES),
}


class Oracle:
    """Proposes each request's reference continuation; with ``wrong_every``, every such
    draft position holds ``wrong`` instead (a token the grammar refuses, or one it allows
    that the model does not choose)."""

    def __init__(
        self, reference: dict[str, list[int]], wrong_every: int = 0, wrong: int = 0
    ) -> None:
        self.reference = reference
        self.wrong_every = wrong_every
        self.wrong = wrong
        self.calls = 0
        self.proposed: list[list[int]] = []

    def propose(self, request: Request, max_tokens: int) -> list[int]:
        done = len(request.all_token_ids) - request.num_prompt_tokens
        guess = list(self.reference[request.request_id][done : done + max_tokens])
        self.calls += 1
        if self.wrong_every:
            for i in range(len(guess)):
                if (self.calls + i) % self.wrong_every == 0:
                    guess[i] = self.wrong
        self.proposed.append(guess)
        return guess

    def observe(self, request: Request, num_proposed: int, num_accepted: int) -> None:
        pass

    def finished(self, request: Request) -> None:
        pass


_CURRENT: list[Oracle] = []


class _Plugin:
    @hookimpl
    def register_speculators(self, register: Any) -> None:
        register("grammar-oracle", lambda config, settings: _CURRENT[-1])


@pytest.fixture(scope="module", autouse=True)
def oracle_registered() -> Iterator[None]:
    """The oracle in this process's plugins for this module only: a worker process (a parallel
    executor in a later test) refuses to start when its plugins differ from the engine's."""
    plugins = get_plugins()
    plugins.register(_Plugin(), "test-grammar-oracle", "tests", "0")
    yield
    plugins.unregister("test-grammar-oracle")


def speculative(method: str) -> dict[str, Any]:
    return {"method": method, "num_tokens": 4, "disable_by_batch_size": None, "adaptive": False}


# ---------------------------------------------------------------------- the draft helpers


@pytest.fixture(scope="module")
def backend(tokenizer) -> XGrammarBackend:
    return XGrammarBackend(tokenizer, VOCAB, XGrammarSettings())


def test_draft_rows_are_the_masks_after_each_prefix_and_the_matcher_stays(backend, tokenizer):
    compiled = backend.compile(StructuredOutputSpec(regex=REGEX))
    m = backend.matcher(compiled)
    assert m.accept_tokens(tokenizer.encode("dog"))
    drafts = tokenizer.encode("s 42")
    rows = backend.allocate_bitmask(len(drafts) + 2)
    assert fill_draft_rows(m, drafts, rows, 1) == 1 + len(drafts)
    # the same rows, from a fresh matcher stepping through the drafts for real
    ref = backend.matcher(compiled)
    assert ref.accept_tokens(tokenizer.encode("dog"))
    want = backend.allocate_bitmask(len(drafts) + 1)
    for j in range(len(drafts) + 1):
        ref.fill_bitmask(want, j)
        if j < len(drafts):
            assert ref.accept_tokens([drafts[j]])
    assert torch.equal(rows[1 : 2 + len(drafts)], want)
    # the matcher is where it was: its next mask is row 1 again, and "s 42" still fits
    again = backend.allocate_bitmask(1)
    m.fill_bitmask(again, 0)
    assert torch.equal(again[0], want[0])
    assert m.accept_tokens(drafts)


def test_grammar_prefix_cuts_at_the_first_refused_draft(backend, tokenizer):
    m = backend.matcher(backend.compile(StructuredOutputSpec(regex=REGEX)))
    good = tokenizer.encode("cats 1")
    bad = tokenizer.encode("x")
    assert grammar_prefix(m, good + bad + good) == good
    assert grammar_prefix(m, bad + good) == []
    assert m.accept_tokens(good)  # nothing of the above stayed accepted
    with pytest.raises(Exception, match="rejects draft"):
        fill_draft_rows(m, bad, backend.allocate_bitmask(2), 0)
    assert m.accept_tokens(tokenizer.encode("2"))  # and the failed fill rolled back too


def test_grammar_prefix_stops_short_of_the_stop_token(backend, tokenizer):
    """A draft that completes the grammar leaves no mask for the position after it: the
    proposal stops before it and the model draws the stop token itself."""
    m = backend.matcher(backend.compile(StructuredOutputSpec(choice=CHOICES)))
    red = tokenizer.encode("red")
    assert grammar_prefix(m, [*red, EOS]) == red
    assert m.accept_tokens(red) and not m.is_terminated()
    with pytest.raises(Exception, match="completes the grammar"):
        fill_draft_rows(m, [EOS], backend.allocate_bitmask(2), 0)
    assert m.accept_tokens([EOS]) and m.is_terminated()


# ---------------------------------------------------------------------- the fake executor


def fake_requests() -> list[EngineCoreRequest]:
    out = []
    for name, spec in SPECS.items():
        for k in range(2):
            prompt = [(97 * i + 31 * k + len(name)) % 40000 + 100 for i in range(8 + 5 * k)]
            out.append(
                EngineCoreRequest(
                    request_id=f"{name}{k}",
                    prompt_token_ids=prompt,
                    sampling_params=SamplingParams(
                        temperature=0, max_tokens=120, structured_outputs=spec
                    ),
                    eos_token_id=EOS,
                )
            )
    return out


def run_fake(
    model_info, method: str
) -> tuple[dict[str, list[int]], Any, list[dict[str, list[int]]]]:
    config = BatonConfig.load(
        max_model_len=1024, structured_output=XGRAMMAR, speculative=speculative(method)
    )
    fake = FakeExecutor(block_size=config.cache.block_size, vocab_size=VOCAB, eos_token_id=EOS)
    core = EngineCore(config, executor=fake, info=model_info)
    scheduled: list[dict[str, list[int]]] = []
    schedule = core.scheduler.schedule

    def spy():
        so = schedule()
        if so.scheduled_spec_decode_tokens:
            scheduled.append(so.scheduled_spec_decode_tokens)
            assert set(so.scheduled_spec_decode_tokens) <= set(so.structured_output_req_ids)
        return so

    core.scheduler.schedule = spy  # type: ignore[method-assign]
    try:
        for r in fake_requests():
            core.add_request(r)
        tokens: dict[str, list[int]] = {}
        for _ in range(5000):
            if not core.has_work():
                break
            outs, _ = core.step_fn()
            for o in outs.outputs if outs else ():
                assert o.error is None, (o.request_id, o.error)
                tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
                if o.finish_reason is not None:
                    assert o.finish_reason == FinishReason.STOP, o.request_id
        assert not core.has_work()
        return tokens, core.scheduler.make_stats(delta=False), scheduled
    finally:
        core.shutdown()


def test_fake_executor_drafts_follow_the_grammar(default_model_dir, tokenizer):
    info = ModelInfo(
        path=str(default_model_dir),
        architecture="Fake",
        vocab_size=VOCAB,
        max_model_len=1024,
        eos_token_ids=[EOS],
    )
    off, _, _ = run_fake(info, "none")
    for rid, ids in off.items():  # the grammar shaped them (the fake's own tokens are noise)
        text = text_of(tokenizer, ids)
        if rid.startswith("regex"):
            assert re.fullmatch(REGEX, text), text
        elif rid.startswith("choice"):
            assert text in CHOICES
        else:
            jsonschema.validate(json.loads(text), SCHEMA)
    # right every time: all drafts scheduled and accepted
    _CURRENT.append(Oracle(off))
    on, stats, scheduled = run_fake(info, "grammar-oracle")
    assert on == off
    assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens > 0
    # a token no grammar here allows at every 3rd position: cut before scheduling
    never = tokenizer.encode("@")[0]
    oracle = Oracle(off, wrong_every=3, wrong=never)
    _CURRENT.append(oracle)
    on, stats, scheduled = run_fake(info, "grammar-oracle")
    assert on == off
    assert any(never in p for p in oracle.proposed)
    assert all(never not in d for step in scheduled for d in step.values())
    assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens > 0
    # a digit where the grammar allows one but the fake does not choose it: verified, rejected
    digit = tokenizer.encode("7")[0]
    _CURRENT.append(Oracle(off, wrong_every=4, wrong=digit))
    on, stats, _ = run_fake(info, "grammar-oracle")
    assert on == off
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens


# ---------------------------------------------------------------------- a tiny real model

PROMPTS = [[(53 * i + 7 * k) % 40000 + 200 for i in range(10 + 3 * k)] for k in range(6)]


def model_params() -> list[SamplingParams]:
    out = []
    for spec in SPECS.values():
        out.append(SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=spec))
        out.append(
            SamplingParams(
                temperature=0.9, top_p=0.95, seed=5, max_tokens=40, structured_outputs=spec
            )
        )
    return out


def model_config(method: str) -> BatonConfig:
    return BatonConfig.load(
        model=str(tiny_model("llama")),
        max_model_len=256,
        structured_output=XGRAMMAR,
        speculative=speculative(method),
    )


def test_tiny_model_greedy_and_seeded_with_grammar_equal_speculation_off():
    params = model_params()
    off, _ = run_engine(model_config("none"), PROMPTS, params)
    _CURRENT.append(Oracle(off, wrong_every=5, wrong=EOS))
    on, stats = run_engine(model_config("grammar-oracle"), PROMPTS, params)
    assert on == off
    assert stats.spec_num_accepted_tokens > 0 and stats.spec_num_drafts > 0
