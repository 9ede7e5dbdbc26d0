"""save_sharded_state at TP=1 and load_format="sharded_state": same greedy tokens, refusals."""

from __future__ import annotations

import asyncio
import json

import pytest
from safetensors import safe_open

from baton import LLM, AsyncLLM, SamplingParams
from baton.errors import ConfigError, InvalidRequestError
from baton.model.sharded_state import MARKER
from baton.testing.tiny_model import tiny_model

PROMPTS = ["the quick brown fox", "hello there"]


def make_llm(model: str, **overrides) -> LLM:
    return LLM(
        model=model,
        device="cpu",
        num_threads=1,
        max_model_len=512,
        kv_cache_memory=4 << 20,
        **overrides,
    )


def greedy(llm: LLM) -> list[list[int]]:
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("tied", [True, False])
def test_tp1_save_and_load_give_the_same_tokens(tmp_path, tied):
    src = tiny_model("llama", tie_word_embeddings=tied)
    dest = tmp_path / "sharded"
    with make_llm(str(src)) as llm:
        want = greedy(llm)
        llm.save_sharded_state(str(dest), max_size=20_000)
    names = sorted(p.name for p in dest.iterdir())
    assert "config.json" in names and "tokenizer.json" in names
    assert "model-rank-0-part-1.safetensors" in names  # max_size split it
    assert not any(n.startswith("model.safetensors") for n in names)
    marker = json.loads((dest / MARKER).read_text())
    assert marker["tensor_parallel_size"] == 1 and marker["pipeline_parallel_size"] == 1
    with safe_open(str(dest / "model-rank-0-part-0.safetensors"), "pt") as st:
        aliases = json.loads(st.metadata()["baton_aliases"])
    assert aliases == ({"lm_head.weight": "model.embed_tokens.weight"} if tied else {})
    with make_llm(str(dest), load_format="sharded_state") as llm:
        assert greedy(llm) == want
        model = llm.engine.core.executor.worker.model_runner.model
        head, emb = model.get_output_embeddings().weight, model.get_input_embeddings().weight
        assert (head is emb) == tied


def test_a_plain_folder_is_refused_with_sharded_state():
    with pytest.raises(ConfigError, match=r"has no baton-sharded-state\.json"):
        make_llm(str(tiny_model("llama")), load_format="sharded_state")


def test_async_llm_saves_and_lora_is_refused(tmp_path):
    async def save() -> None:
        llm = await AsyncLLM.create(
            model=str(tiny_model("llama")),
            device="cpu",
            num_threads=1,
            max_model_len=512,
            kv_cache_memory=4 << 20,
        )
        try:
            await llm.save_sharded_state(str(tmp_path / "async"))
        finally:
            llm.shutdown()

    asyncio.run(save())
    assert (tmp_path / "async" / "model-rank-0-part-0.safetensors").is_file()
    with (
        make_llm(str(tiny_model("llama")), enable_lora=True) as llm,
        pytest.raises(InvalidRequestError, match=r"lora\.enable_lora = true"),
    ):
        llm.save_sharded_state(str(tmp_path / "lora"))
