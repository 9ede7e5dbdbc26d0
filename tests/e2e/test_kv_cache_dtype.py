"""cache.dtype through the whole engine: a float16/bfloat16 KV cache on a tiny random model.

A narrower cache is not exact, so its tokens are compared with the float32
cache's by teacher forcing: every prefix of the float32 greedy continuation is
sent as a prompt (its blocks then come from the prefix cache: the cached-prefix
prefill path) and the next token must be the float32 one at a high share of
positions. Measured on the tiny llama: 100% (float16) and 99% (bfloat16) of
192 positions; the bounds below leave a margin. ``cache.dtype = "float32"`` is
today's cache: the same tokens as ``auto``.
"""

from __future__ import annotations

import pytest
import torch

from baton import LLM, SamplingParams
from baton.errors import ConfigError
from baton.testing.tiny_model import tiny_model
from baton.worker.kv_cache_dtype import kv_cache_dtype

from .parity import PROMPTS

N = 24
BASE = dict(block_size=8, max_model_len=512)
#: share of teacher-forced positions whose top-1 token equals the float32 cache's
MIN_AGREEMENT = {"float16": 0.97, "bfloat16": 0.95}


@pytest.fixture(scope="module")
def setup(tokenizer):
    model_dir = str(tiny_model("llama"))
    prompts = [tokenizer.encode(p) for p in PROMPTS[:8]]
    params = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True)
    with LLM(model=model_dir, **BASE) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return model_dir, prompts, [o.outputs[0].token_ids for o in outs]


def test_float32_cache_is_the_auto_cache(setup):
    model_dir, prompts, ref = setup
    params = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True)
    with LLM(model=model_dir, **BASE, **{"cache.dtype": "float32"}) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref


@pytest.mark.parametrize("cpu_kernels", [True, False], ids=["kernels", "torch"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_low_precision_cache_agrees_with_float32(setup, dtype, cpu_kernels):
    model_dir, prompts, ref = setup
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    reqs = [
        {"prompt_token_ids": p + r[:i]} for p, r in zip(prompts, ref, strict=True) for i in range(N)
    ]
    with LLM(
        model=model_dir, **BASE, **{"cache.dtype": dtype, "executor.cpu_kernels": cpu_kernels}
    ) as llm:
        outs = llm.generate(reqs, one, use_tqdm=False)
        assert sum(o.num_cached_tokens for o in outs) > 0  # prefixes were read from the cache
    got = [o.outputs[0].token_ids[0] for o in outs]
    want = [r[i] for r in ref for i in range(N)]
    agreement = sum(a == b for a, b in zip(got, want, strict=True)) / len(want)
    assert agreement >= MIN_AGREEMENT[dtype], f"{dtype}: top-1 agreement {agreement:.3f}"


def test_half_width_cache_buys_twice_the_blocks():
    model_dir = str(tiny_model("llama"))
    blocks = {}
    for dtype in ("float32", "bfloat16"):
        with LLM(model=model_dir, **BASE, kv_cache_memory="4MiB", **{"cache.dtype": dtype}) as llm:
            blocks[dtype] = llm.engine.call_utility("get_num_blocks")
    # the budget divided by a page half as large (each floored): 2x, or 2x + 1
    assert blocks["bfloat16"] in (2 * blocks["float32"], 2 * blocks["float32"] + 1)


def test_bad_cache_dtypes_are_refused(monkeypatch):
    with pytest.raises(ConfigError, match=r"cache\.dtype"):
        LLM(model=str(tiny_model("llama")), **{"cache.dtype": "float8"})
    assert kv_cache_dtype("auto", torch.bfloat16, torch.device("cpu")) == torch.bfloat16
    assert kv_cache_dtype("float16", torch.float32, torch.device("cpu")) == torch.float16
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    with pytest.raises(ConfigError, match=r"no native bfloat16; use cache\.dtype='float16'"):
        kv_cache_dtype("bfloat16", torch.float16, torch.device("cuda"))


def test_cli_dtype_flag_is_the_models():
    from baton.cli.main import build_parser, engine_overrides
    from baton.config import BatonConfig

    argv = ["generate", "hi", "--dtype", "float16", "--set", "cache.dtype=bfloat16"]
    cfg = BatonConfig.load(**engine_overrides(build_parser().parse_args(argv)))
    assert (cfg.model.dtype, cfg.cache.dtype) == ("float16", "bfloat16")
