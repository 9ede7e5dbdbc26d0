"""Clear errors, before any worker starts, for models and sizes tensor parallel cannot split."""

from __future__ import annotations

import pytest

from baton.config import BatonConfig
from baton.errors import ConfigError
from baton.parallel.sharding import check_shardable, tp_plan
from baton.testing.tiny_model import tiny_model
from baton_cuda_tp.executor import create_tensor_parallel_executor
from tests.plugins.parallel_common import _children


def _config(model, **overrides) -> BatonConfig:
    return BatonConfig.load(model=str(model), executor="cuda-tp", device="cpu", **overrides)


@pytest.mark.parametrize(
    ("overrides", "tp", "field"),
    [({}, 3, "num_attention_heads=4"), ({"num_key_value_heads": 1}, 2, "num_key_value_heads=1")],
)
def test_heads_not_divisible_by_tp(overrides, tp, field):
    model = tiny_model("llama", **overrides)
    with pytest.raises(
        ConfigError, match=f"tensor_parallel_size={tp}: the model's {field} is not divisible"
    ):
        create_tensor_parallel_executor(_config(model, tensor_parallel_size=tp))
    assert not _children(), "no worker may start for a model that cannot be split"


def test_smollm2_heads_suggest_the_sizes_that_work(default_model_dir):
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(default_model_dir)  # 9 query / 3 KV heads
    with pytest.raises(
        ConfigError, match=r"\(9 query / 3 KV heads\); use a tensor_parallel_size in \[1, 3\]"
    ):
        check_shardable(hf, 2)
    check_shardable(hf, 3)


def test_pipeline_parallel_size_is_refused_with_a_pointer_to_the_pipeline_executor():
    with pytest.raises(ConfigError, match=r"executor\.backend = 'pipeline'"):
        create_tensor_parallel_executor(
            _config(tiny_model("llama"), tensor_parallel_size=2, pipeline_parallel_size=2)
        )


def test_plans_with_styles_we_do_not_apply_are_refused():
    from baton.testing.tiny_model import tiny_config

    # phi3 fuses q/k/v and gate/up: its plan gathers outputs, which would need more than colwise/rowwise
    with pytest.raises(ConfigError, match="colwise/rowwise linears only"):
        tp_plan(tiny_config("phi3"))
    assert tp_plan(tiny_config("llama"))["layers.*.self_attn.o_proj"] == "rowwise"
