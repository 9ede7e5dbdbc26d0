"""Greedy parity of quantized weights through the whole engine (model.quantization).

Weight-only quantization with float32 activations computes what transformers
computes in float32 on the same weights dequantized, up to summation order: so
the reference is transformers' greedy decoding of a folder holding those
dequantized weights, under the near-tie rule of tests/e2e/parity.py. For a GGUF
with ``auto`` that folder is the converted one itself (convert_gguf
dequantizes the same blocks); for ``int8`` / ``int4`` it is the checkpoint
with every linear and the embedding replaced by ``dequantize(quantize(W))``.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from baton import LLM, SamplingParams
from baton.quant import dequantize, quantize
from baton.testing.tiny_gguf import make_tiny_gguf
from baton.testing.tiny_model import tiny_model

from .parity import PROMPTS, assert_parity, hf_greedy

MAX_NEW = 40
#: batched, chunked prefill with a small budget, prompts across blocks (as test_parity.py)
BASE = dict(block_size=8, max_num_batched_tokens=96, enable_chunked_prefill=True, max_model_len=512)


def engine_tokens(model_dir: Path, prompt_ids: list[list[int]], **overrides) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    with LLM(model=str(model_dir), **{**BASE, **overrides}) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]


def dequantized_copy(model_dir: Path, mode: str, dest: Path) -> Path:
    """``model_dir`` with every linear (LM head and tied embedding included) as dequantize(quantize(W))."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        for m in model.modules():
            if type(m) is torch.nn.Linear:
                raw, qtype = quantize(m.weight, mode)
                m.weight.copy_(dequantize(raw, qtype, tuple(m.weight.shape)))
    model.save_pretrained(dest)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(dest)
    return dest


@pytest.fixture(scope="module")
def prompt_ids(tokenizer) -> list[list[int]]:
    return [tokenizer.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def gguf_reference(prompt_ids, tmp_path_factory) -> tuple[Path, list[list[int]]]:
    """(the tiny GGUF's converted folder, transformers' greedy tokens on it)."""
    folder = make_tiny_gguf(tmp_path_factory.mktemp("gguf"))[1]
    return folder, hf_greedy(folder, prompt_ids, MAX_NEW)


@pytest.mark.parametrize("cpu_kernels", [True, False])
def test_gguf_auto_matches_transformers_on_the_converted_weights(
    gguf_reference, prompt_ids, cpu_kernels
):
    folder, ref = gguf_reference
    ours = engine_tokens(
        folder, prompt_ids, cpu_kernels=cpu_kernels, **{"model.quantization": "auto"}
    )
    assert_parity(folder, prompt_ids, ours, ref)


@pytest.fixture(scope="module")
def int8_reference(prompt_ids, tmp_path_factory) -> tuple[Path, list[list[int]]]:
    """(the tiny llama's weights after int8, transformers' greedy tokens on them)."""
    ref_dir = dequantized_copy(tiny_model("llama"), "int8", tmp_path_factory.mktemp("int8"))
    return ref_dir, hf_greedy(ref_dir, prompt_ids, MAX_NEW)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_int8_int4_match_transformers_on_the_dequantized_weights(
    mode, prompt_ids, int8_reference, tmp_path
):
    model_dir = tiny_model("llama")
    if mode == "int8":
        ref_dir, ref = int8_reference
    else:
        ref_dir = dequantized_copy(model_dir, mode, tmp_path / "ref")
        ref = hf_greedy(ref_dir, prompt_ids, MAX_NEW)
    for cpu_kernels in (True, False):
        ours = engine_tokens(
            model_dir, prompt_ids, cpu_kernels=cpu_kernels, **{"model.quantization": mode}
        )
        assert_parity(ref_dir, prompt_ids, ours, ref)


@pytest.mark.parametrize("mode", ["int8", "auto"])
def test_pipeline_stages_keep_their_quantized_layers(
    mode, prompt_ids, int8_reference, gguf_reference
):
    """Each stage quantizes its own layers: int8 on the tiny llama, auto on the tiny GGUF."""
    model_dir, (ref_dir, ref) = (
        (tiny_model("llama"), int8_reference)
        if mode == "int8"
        else (gguf_reference[0], gguf_reference)
    )
    ours = engine_tokens(
        model_dir,
        prompt_ids,
        executor="pipeline",
        pipeline_parallel_size=2,
        device="cpu",
        num_threads=1,
        **{"model.quantization": mode},
    )
    assert_parity(ref_dir, prompt_ids, ours, ref)


@pytest.mark.slow
def test_smollm2_gguf_auto_matches_transformers(default_model_dir, prompt_ids, caplog):
    """The default model runs on its Q4_1 / Q8_0 blocks; transformers on the converted folder."""
    ref = hf_greedy(default_model_dir, prompt_ids, MAX_NEW)
    with caplog.at_level(logging.INFO, logger="baton.model.quantization"):
        ours = engine_tokens(default_model_dir, prompt_ids, **{"model.quantization": "auto"})
    assert "210 Q4_1, 2 Q8_0 quantized" in caplog.text  # 30 x 7 linears; embedding = tied head
    assert_parity(default_model_dir, prompt_ids, ours, ref)
