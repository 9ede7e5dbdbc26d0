"""Where ``scheduler.target_step_ms`` is turned off at start-up (baton.engine.step_target):
"auto" with a 16-bit model on CPU, whose tokens would otherwise follow the clock."""

from __future__ import annotations

import logging

import pytest

from baton import LLM
from baton.config import BatonConfig
from baton.engine.core import EngineCore
from baton.protocol import ModelInfo
from baton.testing import FakeExecutor
from baton.testing.tiny_model import tiny_model


def info(dtype: str) -> ModelInfo:
    return ModelInfo(
        path="fake",
        architecture="Fake",
        vocab_size=32000,
        max_model_len=512,
        eos_token_ids=[0],
        dtype=dtype,
    )


def core_for(dtype: str, **overrides: object) -> EngineCore:
    config = BatonConfig.load(max_model_len=512, **overrides)
    return EngineCore(config, executor=FakeExecutor(block_size=16, latency_s=0.0), info=info(dtype))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_auto_is_off_for_a_16_bit_model_on_cpu_saying_why(dtype, caplog):
    with caplog.at_level(logging.INFO, logger="baton.engine.step_target"):
        core = core_for(dtype, **{"executor.device": "cpu"})
    assert core.config.scheduler.target_step_ms == "off"
    assert core.scheduler.prefill_budget is None
    record = next(r for r in caplog.records if "target_step_ms=auto is off" in r.message)
    assert record.levelno == logging.INFO
    assert dtype in record.message and "from run to run" in record.message


def test_auto_stays_on_for_a_float32_model():
    core = core_for("float32", **{"executor.device": "cpu"})
    assert core.config.scheduler.target_step_ms == "auto"
    assert core.scheduler.prefill_budget is not None


def test_a_number_set_for_a_16_bit_model_is_kept():
    core = core_for("bfloat16", **{"executor.device": "cpu", "scheduler.target_step_ms": 250})
    assert core.config.scheduler.target_step_ms == 250
    assert core.scheduler.prefill_budget is not None


def test_auto_stays_on_for_a_16_bit_model_on_cuda():
    # on a GPU no row is independent of its neighbours in any dtype: the rule is the CPU's
    core = core_for("bfloat16", **{"executor.device": "cuda"})
    assert core.config.scheduler.target_step_ms == "auto"


def test_a_real_bfloat16_engine_runs_without_the_clock_steering_it():
    llm = LLM(model=str(tiny_model("llama")), max_model_len=256, **{"model.dtype": "bfloat16"})
    try:
        core = llm.engine.core
        assert core.info.dtype == "bfloat16"
        assert core.scheduler.prefill_budget is None
    finally:
        llm.shutdown()
