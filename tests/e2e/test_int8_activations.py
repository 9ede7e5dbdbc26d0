"""``model.activation_quantization = "int8"`` agrees with float32 activations, by teacher forcing.

int8 activations are not exact, so the test bounds agreement instead of asking
for equal tokens: every prefix of the float32-activation greedy continuation is
sent as a prompt, with steps of at most 16 tokens (so every linear call of the
step takes the decode-sized path that quantizes its input) and the prefix read
from the cache, and the next token must be the float32 one at a high share of
positions. Measured on an AVX2 host (2026-12-02): the tiny GGUF model (random
weights, all six block formats) 190 of 192 positions (99.0%) on the kernels and
on the torch path; SmolLM2-135M's Q4_1 file 189 of 192 (98.4%).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from baton import LLM, SamplingParams
from baton.testing.tiny_gguf import make_tiny_gguf

from .parity import PROMPTS

N = 24
#: steps of <= 16 tokens: QuantLinear.KERNEL_MAX_ROWS, the rows that quantize their input
BASE = dict(block_size=8, max_model_len=512, max_num_batched_tokens=16, enable_chunked_prefill=True)
MIN_AGREEMENT_TINY = 0.95
MIN_AGREEMENT_SMOLLM2 = 0.94


def reference(model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True)
    with LLM(model=str(model_dir), **BASE) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def agreement(model_dir: Path, prompts, ref, **overrides) -> float:
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    reqs = [
        {"prompt_token_ids": p + r[:i]} for p, r in zip(prompts, ref, strict=True) for i in range(N)
    ]
    settings = {**BASE, "model.activation_quantization": "int8", **overrides}
    with LLM(model=str(model_dir), **settings) as llm:
        outs = llm.generate(reqs, one, use_tqdm=False)
        assert sum(o.num_cached_tokens for o in outs) > 0  # prefixes came from the cache
    got = [o.outputs[0].token_ids[0] for o in outs]
    want = [r[i] for r in ref for i in range(N)]
    return sum(a == b for a, b in zip(got, want, strict=True)) / len(want)


@pytest.fixture(scope="module")
def tiny(tokenizer, tmp_path_factory):
    _, folder = make_tiny_gguf(tmp_path_factory.mktemp("gguf"))
    prompts = [tokenizer.encode(p) for p in PROMPTS[:8]]
    return folder, prompts, reference(folder, prompts)


@pytest.mark.parametrize("cpu_kernels", [True, False], ids=["kernels", "torch"])
def test_int8_activations_agree_with_float32_on_the_tiny_gguf(tiny, cpu_kernels):
    folder, prompts, ref = tiny
    got = agreement(folder, prompts, ref, **{"executor.cpu_kernels": cpu_kernels})
    assert got >= MIN_AGREEMENT_TINY, f"top-1 agreement {got:.3f}"


@pytest.mark.slow
def test_int8_activations_agree_with_float32_on_smollm2(default_model_dir, tokenizer):
    prompts = [tokenizer.encode(p) for p in PROMPTS[:8]]
    ref = reference(default_model_dir, prompts)
    got = agreement(default_model_dir, prompts, ref)
    assert got >= MIN_AGREEMENT_SMOLLM2, f"top-1 agreement {got:.3f}"
