"""Greedy parity through the whole engine with executor.fast_decode taking the decode steps.

The 16 prompts of tests/e2e/parity.py batched, chunked prefill under a small token
budget (so prompt chunks and decodes share steps, and later steps are decode-only
with requests at different context lengths), a block size that splits prompts and
outputs across blocks: transformers' greedy tokens under the near-tie rule, and the
load log saying the fast path was built.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from baton import LLM, SamplingParams
from baton.testing.tiny_gguf import make_tiny_gguf
from baton.testing.tiny_model import tiny_model

from .parity import PROMPTS, assert_parity, hf_greedy

MAX_NEW = 40
BASE = dict(block_size=8, max_num_batched_tokens=96, enable_chunked_prefill=True, max_model_len=512)
BUILT = "decode-only steps run the layer stack in one native call"


def fast_tokens(
    model_dir: Path, prompt_ids: list[list[int]], caplog, **overrides
) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    with (
        caplog.at_level(logging.INFO, logger="baton.worker.model_runner"),
        LLM(model=str(model_dir), **{**BASE, **overrides}) as llm,
    ):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params, use_tqdm=False)
    assert BUILT in caplog.text
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def prompt_ids(tokenizer) -> list[list[int]]:
    return [tokenizer.encode(p) for p in PROMPTS]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_fast_decode_matches_transformers(arch, prompt_ids, caplog):
    model_dir = tiny_model(arch)
    ref = hf_greedy(model_dir, prompt_ids, MAX_NEW)
    assert_parity(model_dir, prompt_ids, fast_tokens(model_dir, prompt_ids, caplog), ref)


def test_fast_decode_on_gguf_blocks_matches_transformers(prompt_ids, caplog, tmp_path):
    """The tiny GGUF's own quantized blocks (linear_q in the stack); transformers on the converted folder."""
    folder = make_tiny_gguf(tmp_path)[1]
    ref = hf_greedy(folder, prompt_ids, MAX_NEW)
    ours = fast_tokens(folder, prompt_ids, caplog, **{"model.quantization": "auto"})
    assert_parity(folder, prompt_ids, ours, ref)
