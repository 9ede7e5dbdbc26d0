"""Through the engine on a tiny model: an agent-like workload (the same request twice, one
after the other) gets the second answer drafted from the first, with outputs equal to
speculation off."""

from __future__ import annotations

from typing import Any

import pytest

from baton.config import BatonConfig
from baton.protocol import EngineCoreRequest
from baton.sampling_params import SamplingParams
from baton.testing.tiny_model import tiny_model

pytestmark = [pytest.mark.timeout(300)]

PROMPT = [1000 + (i * 37) % 500 for i in range(24)]  # no repeats: nothing to look up in it


def run_in_turn(config: BatonConfig, prompts: list[list[int]], params: SamplingParams) -> Any:
    """Each prompt to completion before the next is added: tokens per request and the accepted
    drafts per request."""
    from baton.engine.core import EngineCore

    core = EngineCore(config)
    try:
        tokens: dict[str, list[int]] = {}
        accepted: list[int] = []
        before = 0
        for i, prompt in enumerate(prompts):
            rid = f"r{i}"
            core.add_request(
                EngineCoreRequest(request_id=rid, prompt_token_ids=prompt, sampling_params=params)
            )
            for _ in range(1000):
                if not core.has_work():
                    break
                outs, _ = core.step_fn()
                for o in outs.outputs if outs else ():
                    assert o.error is None, o.error
                    tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            assert not core.has_work()
            total = core.scheduler.make_stats(delta=False).spec_num_accepted_tokens
            accepted.append(total - before)
            before = total
        return tokens, accepted
    finally:
        core.shutdown()


def config(method: str) -> BatonConfig:
    return BatonConfig.load(
        model=str(tiny_model("llama")),
        max_model_len=256,
        log_stats=True,
        speculative={"method": method, "num_tokens": 4, "disable_by_batch_size": None},
    )


def test_a_repeated_request_is_drafted_from_the_first_ones_output() -> None:
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    prompts = [PROMPT, PROMPT]
    off, _ = run_in_turn(config("none"), prompts, params)
    on, accepted = run_in_turn(config("suffix"), prompts, params)
    assert on == off
    assert off["r0"] == off["r1"]  # greedy: the same answer twice
    # the second answer follows the first one's: nearly all of it comes from drafts
    assert accepted[1] >= 0.75 * len(off["r1"]), accepted
    assert accepted[1] > accepted[0], accepted
