"""``model.dtype`` = bfloat16 through the whole engine on a tiny random model.

bfloat16 is not exact (8 bits of mantissa), so its tokens are compared with
float32's by teacher forcing: every prefix of the float32 greedy continuation
is sent as a prompt (its blocks from the prefix cache) and the next token must
be the float32 one at a high share of positions. ``auto`` on a bfloat16
checkpoint follows the CPU's native bf16 support (detection patched both
ways): without it the weights are upcast once and the model runs in float32,
token for token what ``model.dtype = "float32"`` gives on that checkpoint.
Measured on an AVX2 host without avx512_bf16 (emulated bf16, 2026-12-02):
187 of 192 positions (97.4%); the bound leaves a margin. On SmolLM2-135M
(``plugins/bench/scripts/bench_agreement.py --set model.dtype=bfloat16 --prompts 8
--max-tokens 48`` against the default Q4_1 reference): 96.6% of 384 positions,
mean KL 0.00115.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from baton import LLM, SamplingParams
from baton.kernels import cpu_features
from baton.kernels.cpu_features import features_from
from baton.testing.tiny_model import tiny_model
from baton_bench.common import dtype_config

from .parity import PROMPTS

N = 24
BASE = dict(block_size=8, max_model_len=512)
#: share of teacher-forced positions whose top-1 token equals float32's
MIN_AGREEMENT = 0.92


def greedy(model_dir: str | Path, prompts: list[list[int]], **overrides) -> tuple[list, str, bool]:
    """(greedy continuations, the engine's dtype, whether native) for ``overrides``."""
    params = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True)
    with LLM(model=str(model_dir), **BASE, **overrides) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        info = llm.info
    return [o.outputs[0].token_ids for o in outs], info.dtype, info.dtype_native


@pytest.fixture(scope="module")
def setup(tokenizer):
    model_dir = str(tiny_model("llama"))
    prompts = [tokenizer.encode(p) for p in PROMPTS[:8]]
    ref, dtype, native = greedy(model_dir, prompts)
    assert (dtype, native) == ("float32", True)
    return model_dir, prompts, ref


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory) -> Path:
    """The tiny llama saved as a bfloat16 checkpoint (weights and config)."""
    dest = tmp_path_factory.mktemp("bf16") / "model"
    shutil.copytree(tiny_model("llama"), dest)
    weights = dest / "model.safetensors"
    save_file({k: v.to(torch.bfloat16) for k, v in load_file(weights).items()}, weights)
    config = json.loads((dest / "config.json").read_text())
    config["dtype"] = "bfloat16"
    (dest / "config.json").write_text(json.dumps(config))
    return dest


def set_cpu(monkeypatch, flags: set[str]) -> None:
    features = features_from("x86_64", frozenset({"avx2", "fma", "f16c"} | flags))
    monkeypatch.setattr(cpu_features, "cpu_features", lambda: features)


def test_bfloat16_agrees_with_float32(setup):
    model_dir, prompts, ref = setup
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    reqs = [
        {"prompt_token_ids": p + r[:i]} for p, r in zip(prompts, ref, strict=True) for i in range(N)
    ]
    with LLM(model=model_dir, **BASE, **{"model.dtype": "bfloat16"}) as llm:
        native = cpu_features.cpu_features().bf16
        assert (llm.info.dtype, llm.info.dtype_native) == ("bfloat16", native)
        assert dtype_config(llm) == {  # what the bench JSON reports
            "model_dtype": "bfloat16",
            "dtype": "bfloat16",
            "dtype_native": native,
        }
        outs = llm.generate(reqs, one, use_tqdm=False)
        assert sum(o.num_cached_tokens for o in outs) > 0  # prefixes were read from the cache
    got = [o.outputs[0].token_ids[0] for o in outs]
    want = [r[i] for r in ref for i in range(N)]
    agreement = sum(a == b for a, b in zip(got, want, strict=True)) / len(want)
    assert agreement >= MIN_AGREEMENT, f"bfloat16: top-1 agreement {agreement:.3f}"


def test_auto_upcasts_a_bf16_checkpoint_without_native_bf16(setup, bf16_checkpoint, monkeypatch):
    _, prompts, _ = setup
    set_cpu(monkeypatch, set())
    auto, dtype, native = greedy(bf16_checkpoint, prompts[:4], **{"model.dtype": "auto"})
    assert (dtype, native) == ("float32", True)
    fp32, _, _ = greedy(bf16_checkpoint, prompts[:4], **{"model.dtype": "float32"})
    assert auto == fp32


def test_auto_keeps_a_bf16_checkpoint_with_native_bf16(setup, bf16_checkpoint, monkeypatch):
    _, prompts, _ = setup
    set_cpu(monkeypatch, {"avx512_bf16"})
    auto, dtype, native = greedy(bf16_checkpoint, prompts[:4], **{"model.dtype": "auto"})
    assert (dtype, native) == ("bfloat16", True)
    explicit, _, _ = greedy(bf16_checkpoint, prompts[:4], **{"model.dtype": "bfloat16"})
    assert auto == explicit
