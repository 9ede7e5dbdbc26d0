"""Greedy float32 parity with transformers' generate through the whole engine (issue: model execution).

16 prompts of mixed lengths, batched together, chunked prefill on with a small
token budget, a block size that splits prompts across blocks; the same with
prefix-cache hits and with preemption forced by a tiny KV cache.
"""

from __future__ import annotations

import pytest

from baton import LLM, SamplingParams
from baton.testing.tiny_model import tiny_model

from .parity import PROMPTS, assert_parity, hf_greedy

MAX_NEW = 40


def engine_tokens(model_dir, prompt_ids, **overrides) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    with LLM(model=str(model_dir), **overrides) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]


def check_model(model_dir, tokenizer, **overrides) -> None:
    prompt_ids = [tokenizer.encode(p) for p in PROMPTS]
    ref = hf_greedy(model_dir, prompt_ids, MAX_NEW)
    base = dict(
        block_size=8, max_num_batched_tokens=96, enable_chunked_prefill=True, max_model_len=512
    )
    # batched, chunked prefill, prompts across blocks
    assert_parity(
        model_dir, prompt_ids, engine_tokens(model_dir, prompt_ids, **base, **overrides), ref
    )
    # prefix-cache hits: the same prompts twice in one engine; the second pass starts from cached blocks
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    with LLM(model=str(model_dir), **base, **overrides) as llm:
        llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params, use_tqdm=False)
        again = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params, use_tqdm=False)
        assert sum(o.num_cached_tokens for o in again) > 0
    assert_parity(model_dir, prompt_ids, [o.outputs[0].token_ids for o in again], ref)
    # preemption forced: a KV cache far smaller than the batch needs
    with LLM(
        model=str(model_dir),
        **{**base, "kv_cache_memory": _tiny_kv(model_dir, blocks=90)},
        **overrides,
    ) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params, use_tqdm=False)
        assert llm.engine.call_utility("get_num_blocks") <= 90
        assert sum(o.metrics.num_preemptions for o in outs) > 0
    assert_parity(model_dir, prompt_ids, [o.outputs[0].token_ids for o in outs], ref)


def _tiny_kv(model_dir, blocks: int, block_size: int = 8) -> int:
    import json

    cfg = json.loads((model_dir / "config.json").read_text())
    heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return blocks * 2 * cfg["num_hidden_layers"] * block_size * heads * head_dim * 4


@pytest.mark.parametrize("arch", ["qwen2", "mistral", "llama"])
def test_parity_tiny_models(arch, tokenizer):
    check_model(tiny_model(arch), tokenizer)


@pytest.mark.slow
def test_parity_smollm2(default_model_dir, tokenizer):
    check_model(default_model_dir, tokenizer)
