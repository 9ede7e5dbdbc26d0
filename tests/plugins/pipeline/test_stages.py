"""Cutting a model into pipeline stages, in one process (no workers): the stages chained equal the model."""

from __future__ import annotations

import copy

import pytest
import torch

from baton.errors import ConfigError
from baton.testing.tiny_model import tiny_model
from baton_pipeline.stages import NoHead, Skip, cut_stage, layer_ranges


def test_layer_ranges_are_contiguous_and_even():
    assert layer_ranges(30, 2) == [(0, 15), (15, 30)]
    assert layer_ranges(3, 2) == [(0, 2), (2, 3)]
    assert layer_ranges(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]
    with pytest.raises(ConfigError, match="only 3 layers"):
        layer_ranges(3, 4)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("pp", [2, 3])
def test_chained_stages_give_the_models_logits(arch, pp):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        tiny_model(arch), dtype=torch.float32, attn_implementation="sdpa"
    )
    model.eval()
    ids = torch.tensor([[5, 17, 300, 42, 7, 9, 1000]])
    with torch.inference_mode():
        want = model(input_ids=ids).logits
        stages = [copy.deepcopy(model) for _ in range(pp)]
        ios = [cut_stage(m, s, pp) for s, m in enumerate(stages)]
        hidden = None
        for m, io in zip(stages, ios, strict=True):
            io.input = hidden
            io.capture = not io.is_last
            out = m(input_ids=ids).logits
            if not io.is_last:
                assert out.shape[-1] == 0  # no LM head before the last stage
                hidden = io.take_output()
    assert torch.allclose(out, want, atol=1e-5), (out - want).abs().max()
    # each stage keeps its own layers only, renumbered for its KV cache
    first, last = stages[0], stages[-1]
    kept = [i for i, layer in enumerate(first.model.layers) if not isinstance(layer, Skip)]
    assert kept == list(range(ios[0].start, ios[0].end))
    assert [
        last.model.layers[i].self_attn.layer_idx for i in range(ios[-1].start, ios[-1].end)
    ] == list(range(ios[-1].end - ios[-1].start))
    assert isinstance(first.get_output_embeddings(), NoHead)
    assert sum(p.numel() for p in last.parameters()) < sum(p.numel() for p in model.parameters())
