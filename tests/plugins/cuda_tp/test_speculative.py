"""Speculative decoding under tensor parallel: greedy tokens of TP=2 (CPU, gloo) with the
ngram speculator equal those of one process without speculation (tests/e2e/parity.py's
near-tie rule, as for TP without drafts), with drafts accepted on the way. One TP engine
only: each costs two worker processes."""

from __future__ import annotations

from typing import Any

from baton import LLM, SamplingParams
from baton.testing.conformance.speculator import PROMPTS
from baton.testing.tiny_model import tiny_model
from tests.e2e.parity import assert_parity

BASE = dict(device="cpu", num_threads=1, max_model_len=256, block_size=8)


def run(**overrides: Any) -> tuple[list[list[int]], Any]:
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(p)} for p in PROMPTS]
    with LLM(model=str(tiny_model("llama")), **BASE, **overrides) as llm:
        out = llm.generate(prompts, params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in out], llm.get_stats()


def test_tp2_greedy_with_ngram_equals_speculation_off():
    off, _ = run()
    on, stats = run(
        executor="cuda-tp",
        tensor_parallel_size=2,
        speculative={"method": "ngram", "disable_by_batch_size": None},
    )
    assert_parity(tiny_model("llama"), [list(p) for p in PROMPTS], on, off)
    assert stats.spec_num_drafts > 0 and stats.spec_num_accepted_tokens > 0
