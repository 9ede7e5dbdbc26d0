"""Speculative decoding's figures in the ``logging`` stat logger: acceptance rate, mean accepted
length and per-position acceptance over each interval, per engine, from the real logger."""

from __future__ import annotations

import logging
import re

import pytest

from baton import LLM, SamplingParams
from baton.config import BatonConfig
from baton.metrics.logging_logger import LoggingStatLogger
from baton.metrics.spec import SpecTally
from baton.protocol import SchedulerStats
from baton.testing.conformance.speculator import PROMPTS
from baton.testing.tiny_model import tiny_model


def spec_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "baton.stats" and "speculative decoding" in r.getMessage()
    ]


def step(drafts: int, proposed: int, accepted: int, per_pos: list[int]) -> SchedulerStats:
    return SchedulerStats(
        spec_num_drafts=drafts,
        spec_num_draft_tokens=proposed,
        spec_num_accepted_tokens=accepted,
        spec_accepted_per_position=per_pos,
    )


def test_tally_sums_steps_and_derives_the_rates():
    t = SpecTally()
    t.add(step(2, 8, 5, [2, 2, 1, 0]))
    t.add(step(1, 4, 4, [1, 1, 1, 1]))
    t.add(SchedulerStats())  # a step without drafts changes nothing
    assert (t.num_drafts, t.num_draft_tokens, t.num_accepted_tokens) == (3, 12, 9)
    assert t.accepted_per_position == [3, 3, 2, 1]
    assert t.acceptance_rate == 0.75
    assert t.mean_accepted_length == 4.0  # 1 + 9 / 3
    assert t.per_position_acceptance == [1.0, 1.0, 2 / 3, 1 / 3]
    empty = SpecTally()
    assert (empty.acceptance_rate, empty.mean_accepted_length) == (0.0, 1.0)


def test_logging_logger_reports_each_engine_over_its_interval(caplog):
    caplog.set_level("INFO", logger="baton.stats")
    logger = LoggingStatLogger(BatonConfig.load(), None, 0)
    logger.record(step(2, 6, 3, [2, 1, 0]), None, engine_index=0)
    logger.record(step(2, 6, 6, [2, 2, 2]), None, engine_index=0)
    logger.record(step(1, 3, 0, [0, 0, 0]), None, engine_index=1)
    logger.record(SchedulerStats(), None, engine_index=2)  # no drafts there: no line
    logger.log()
    lines = spec_lines(caplog)
    assert len(lines) == 2
    assert lines[0].startswith("engine 000: speculative decoding: acceptance rate 75.0%")
    assert "mean accepted length 3.25 tokens per verification" in lines[0]
    assert "per-position acceptance [1.00, 0.75, 0.50]" in lines[0]
    assert "verifications 4, draft tokens 12, accepted 9" in lines[0]
    assert lines[1].startswith("engine 001: speculative decoding: acceptance rate 0.0%")
    assert "mean accepted length 1.00" in lines[1]
    # the next interval starts from zero: nothing verified, no line
    caplog.clear()
    logger.log()
    assert spec_lines(caplog) == []
    logger.record(step(1, 2, 1, [1, 0]), None, engine_index=1)
    logger.log()
    assert spec_lines(caplog) == [
        "engine 001: speculative decoding: acceptance rate 50.0%, mean accepted length 2.00 "
        "tokens per verification, per-position acceptance [1.00, 0.00], verifications 1, "
        "draft tokens 2, accepted 1"
    ]


def test_llm_with_ngram_logs_what_the_engine_counted(caplog):
    """Through LLM (the engine's per-step deltas): the figures summed over every logged
    interval are the engine's totals; no line without speculation."""
    caplog.set_level("INFO", logger="baton.stats")
    prompts = [{"prompt_token_ids": list(p)} for p in PROMPTS[:2]]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    with LLM(
        model=str(tiny_model("llama")),
        max_model_len=256,
        speculative={"method": "ngram", "disable_by_batch_size": None},
        observability={"log_stats_interval": 1e-6},
    ) as llm:
        llm.generate(prompts, params, use_tqdm=False)
        llm.stat_loggers.log()  # the last interval
        totals = llm.get_stats()
    lines = spec_lines(caplog)
    assert totals.spec_num_drafts > 0 and lines
    found = [
        re.search(r"verifications (\d+), draft tokens (\d+), accepted (\d+)", x) for x in lines
    ]
    counted = [tuple(int(v) for v in m.groups()) for m in found if m is not None]
    assert len(counted) == len(lines)
    assert tuple(map(sum, zip(*counted, strict=True))) == (
        totals.spec_num_drafts,
        totals.spec_num_draft_tokens,
        totals.spec_num_accepted_tokens,
    )
    caplog.clear()
    with LLM(
        model=str(tiny_model("llama")),
        max_model_len=256,
        observability={"log_stats_interval": 1e-6},
    ) as llm:
        llm.generate(prompts, params, use_tqdm=False)
        llm.stat_loggers.log()
    assert spec_lines(caplog) == []
    assert any("generation" in r.getMessage() for r in caplog.records if r.levelno == logging.INFO)
