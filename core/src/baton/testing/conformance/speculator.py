"""Conformance suite for speculators: subclass ``SpeculatorConformance``.

    from baton.testing.conformance import SpeculatorConformance

    class TestMySpeculator(SpeculatorConformance):
        name = "mine"                  # looked up in the plugin registry
        settings = {"depth": 8}        # the [speculative.mine] sub-table (optional)

or override ``make_speculator(self, config)`` to build it yourself. The checks:
it implements ``baton.interfaces.Speculator``; proposals are token ids, never
more than asked for, for histories from one token to thousands; it takes
``observe`` and ``finished`` as the kernel calls them and a request id reused
after ``finished`` starts afresh; and through a real engine (the in-process
executor on a tiny random-weight model) greedy and seeded outputs are exactly
those of speculation off, while a repetitive prompt gets drafts accepted.

Class attributes: ``history_only`` (True: proposals depend only on the
request's own tokens, so a fresh speculator and a used one propose the same;
set False for one that learns from other requests), ``expects_acceptance``
(the repetitive prompts must see accepted drafts), ``num_tokens``.
"""

from __future__ import annotations

from typing import Any, ClassVar

import pytest

from baton.config import BatonConfig
from baton.engine.core import EngineCore
from baton.interfaces import Speculator
from baton.plugins.registry import get_registry
from baton.protocol import EngineCoreRequest
from baton.request import Request
from baton.sampling_params import SamplingParams
from baton.testing.tiny_model import tiny_model

#: Prompts (token ids of the SmolLM2 vocabulary): repetitive ones, where copying pays, and one
#: that does not repeat.
PROMPTS: tuple[list[int], ...] = (
    [510, 1230, 314, 2500, 28, 510, 1230, 314, 2500, 28, 510, 1230, 314, 2500, 28, 510],
    [48, 49, 50, 51, 52, 53] * 5,
    list(range(1000, 1040)),
)


def run_engine(
    config: BatonConfig, prompts: list[list[int]], params: list[SamplingParams]
) -> tuple[dict[str, list[int]], Any]:
    """Run ``prompts`` to completion on an in-process EngineCore: tokens per request id
    ("r0", "r1", ...) and the scheduler's totals (``SchedulerStats``)."""
    core = EngineCore(config)
    try:
        for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
            core.add_request(
                EngineCoreRequest(request_id=f"r{i}", prompt_token_ids=p, sampling_params=sp)
            )
        tokens: dict[str, list[int]] = {}
        for _ in range(10_000):
            if not core.has_work():
                break
            outs, _ = core.step_fn()
            for o in outs.outputs if outs else ():
                assert o.error is None, o.error
                tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
        assert not core.has_work(), "the engine did not finish the requests"
        return tokens, core.scheduler.make_stats(delta=False)
    finally:
        core.shutdown()


def _request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=64))


class SpeculatorConformance:
    """Behaviour every speculator must show. Set ``name`` or override ``make_speculator``."""

    pytestmark = [pytest.mark.timeout(300)]

    #: The registered speculator name.
    name: ClassVar[str | None] = None
    #: Its ``[speculative.<name>]`` settings for every test.
    settings: ClassVar[dict[str, Any]] = {}
    #: Proposals depend only on the request's own tokens (False: it learns across requests).
    history_only: ClassVar[bool] = True
    #: The repetitive prompts must get drafts accepted through the engine.
    expects_acceptance: ClassVar[bool] = True
    #: speculative.num_tokens in the engine checks.
    num_tokens: ClassVar[int] = 4

    def config(self, **overrides: Any) -> BatonConfig:
        if self.name is None:
            raise NotImplementedError("set name = '<registered speculator>' or override config")
        spec: dict[str, Any] = {
            "method": self.name,
            "num_tokens": self.num_tokens,
            "disable_by_batch_size": None,
        }
        if self.settings:
            spec[self.name] = dict(self.settings)
        return BatonConfig.load(speculative=spec, **overrides)

    def make_speculator(self, config: BatonConfig) -> Speculator:
        entry = get_registry().get("speculator", config.speculative.method)
        speculator: Speculator = entry.create(config, entry.settings(config))
        return speculator

    # ------------------------------------------------------------------ the protocol

    def test_is_a_speculator(self) -> None:
        assert isinstance(self.make_speculator(self.config()), Speculator)

    @pytest.mark.parametrize("max_tokens", [1, 3, 8])
    def test_proposals_are_token_ids_within_the_limit(self, max_tokens: int) -> None:
        spec = self.make_speculator(self.config())
        histories = [[7], [7, 7], *PROMPTS, [(i * 7919) % 49000 for i in range(3000)]]
        for i, tokens in enumerate(histories):
            req = _request(f"p{i}", tokens)
            for _ in range(3):  # as decoding goes on
                out = list(spec.propose(req, max_tokens))
                assert len(out) <= max_tokens, (tokens[:8], out)
                assert all(isinstance(t, int) and t >= 0 for t in out), out
                accepted = len(out) // 2
                req.all_token_ids.extend([*out[:accepted], 11])
                spec.observe(req, len(out), accepted)
            spec.finished(req)

    def test_a_reused_request_id_starts_afresh(self) -> None:
        used = self.make_speculator(self.config())
        a = _request("same", PROMPTS[0])
        used.propose(a, 4)
        a.all_token_ids.extend([1, 2, 3])
        used.propose(a, 4)
        used.finished(a)
        b = _request("same", PROMPTS[1])
        got = list(used.propose(b, 4))
        assert len(got) <= 4
        if self.history_only:
            fresh = self.make_speculator(self.config())
            assert got == list(fresh.propose(_request("same", PROMPTS[1]), 4))

    # ------------------------------------------------------------------ through the engine

    def _engine_config(self, method: str) -> BatonConfig:
        cfg = self.config(model=str(tiny_model("llama")), max_model_len=256, log_stats=True)
        if method == "none":
            cfg = cfg.replace(speculative={"method": "none"})
        return cfg

    def _both(self, params: list[SamplingParams]) -> tuple[dict[str, list[int]], ...]:
        prompts = [list(p) for p in PROMPTS]
        off, _ = run_engine(self._engine_config("none"), prompts, params)
        on, stats = run_engine(self._engine_config(self.name or ""), prompts, params)
        return off, on, stats

    def test_greedy_outputs_equal_speculation_off(self) -> None:
        params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)] * len(PROMPTS)
        off, on, stats = self._both(params)
        assert on == off
        if self.expects_acceptance:
            assert stats.spec_num_accepted_tokens > 0, stats

    def test_seeded_sampling_equals_speculation_off(self) -> None:
        params = [
            SamplingParams(temperature=0.7, top_k=4, seed=i, max_tokens=32, ignore_eos=True)
            for i in range(len(PROMPTS))
        ]
        off, on, _ = self._both(params)
        assert on == off
