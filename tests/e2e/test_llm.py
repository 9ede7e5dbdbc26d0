"""The offline API end to end on a tiny random model: prompts, stops, n, logprobs, seeds, chat, errors."""

from __future__ import annotations

import math

import pytest

from baton import LLM, SamplingParams
from baton.errors import InvalidRequestError
from baton.sampling_params import RequestOutputKind
from baton.testing.tiny_model import tiny_model


@pytest.fixture(scope="module")
def llm():
    with LLM(model=str(tiny_model("llama")), max_model_len=256, block_size=8) as engine:
        yield engine


GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def test_text_token_and_dict_prompts_agree(llm):
    text = "The capital of France is"
    ids = llm.get_tokenizer().encode(text)
    a, b, c = llm.generate(
        [text, {"prompt_token_ids": ids}, {"prompt": text}], GREEDY, use_tqdm=False
    )
    assert a.outputs[0].token_ids == b.outputs[0].token_ids == c.outputs[0].token_ids
    assert a.prompt == text and a.prompt_token_ids == ids
    assert a.outputs[0].finish_reason == "length" and len(a.outputs[0].token_ids) == 24


def test_outputs_come_in_prompt_order_with_their_own_lengths(llm):
    prompts = [f"Item {i}: " + "word " * (3 * i) for i in range(8)]
    params = [SamplingParams(temperature=0, max_tokens=3 + i, ignore_eos=True) for i in range(8)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt for o in outs] == prompts
    assert [len(o.outputs[0].token_ids) for o in outs] == [3 + i for i in range(8)]


def test_text_is_the_decoded_tokens(llm):
    out = llm.generate("Hello there", GREEDY, use_tqdm=False)[0].outputs[0]
    assert out.text == llm.get_tokenizer().decode(out.token_ids, skip_special_tokens=True)


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings(llm, include):
    full = llm.generate("Tell me a story", GREEDY, use_tqdm=False)[0].outputs[0]
    text = full.text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    if len(stop.strip()) < 2:
        pytest.skip("greedy text of the random model too short to cut")
    params = SamplingParams(
        temperature=0,
        max_tokens=24,
        ignore_eos=True,
        stop=[stop],
        include_stop_str_in_output=include,
    )
    out = llm.generate("Tell me a story", params, use_tqdm=False)[0].outputs[0]
    cut = text.index(stop)
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == (text[: cut + len(stop)] if include else text[:cut])
    assert not llm.engine.call_utility("list_requests")  # the engine was told to stop it


def test_stop_token_ids(llm):
    full = llm.generate("Count with me", GREEDY, use_tqdm=False)[0].outputs[0]
    stop_id = full.token_ids[5]
    first = full.token_ids.index(stop_id)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop_token_ids=[stop_id])
    out = llm.generate("Count with me", params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == full.token_ids[: first + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_id)


def test_n_and_seeds(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    a = llm.generate("Once upon a time", params, use_tqdm=False)[0]
    b = llm.generate("Once upon a time", params, use_tqdm=False)[0]
    assert [c.index for c in a.outputs] == [0, 1, 2]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert len({tuple(c.token_ids) for c in a.outputs}) > 1  # independent samples


def test_seeded_sampling_ignores_batch_companions(llm):
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate("A seeded prompt", params, use_tqdm=False)[0].outputs[0].token_ids
    noise = [SamplingParams(temperature=1.0, max_tokens=5 + i, ignore_eos=True) for i in range(6)]
    outs = llm.generate(
        [f"noise {i} " * (i + 1) for i in range(6)] + ["A seeded prompt"],
        [*noise, params],
        use_tqdm=False,
    )
    assert outs[-1].outputs[0].token_ids == alone


def test_logprobs(llm):
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)
    out = llm.generate("Logprobs please", params, use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 6
    total = 0.0
    for tid, pos in zip(out.token_ids, out.logprobs, strict=True):
        assert tid in pos and pos[tid].rank == 1  # greedy picks the most likely
        assert 3 <= len(pos) <= 4 and all(lp.logprob <= 0 for lp in pos.values())
        assert pos[tid].decoded_token is not None
        total += pos[tid].logprob
    assert math.isclose(out.cumulative_logprob, total, rel_tol=1e-5)


def test_chat_uses_the_template(llm):
    out = llm.chat([{"role": "user", "content": "hi"}], GREEDY, use_tqdm=False)[0]
    ids = llm.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True
    )
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert out.prompt_token_ids == list(ids)
    two = llm.chat(
        [[{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}]],
        GREEDY,
        use_tqdm=False,
    )
    assert len(two) == 2


def test_bad_input_is_refused_before_anything_runs(llm):
    with pytest.raises(InvalidRequestError, match="max_model_len is 256"):
        llm.generate({"prompt_token_ids": [5] * 300}, GREEDY, use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="lower max_tokens to at most"):
        llm.generate({"prompt_token_ids": [5] * 250}, SamplingParams(max_tokens=20), use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.generate({"prompt_token_ids": []}, GREEDY, use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="2 entries for 3 prompts"):
        llm.generate(["a", "b", "c"], [GREEDY, GREEDY], use_tqdm=False)
    assert llm.generate("still serving", GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def _exploit_params(**kwargs):
    # built without validation, as a careless caller (or an old baton) would hand them over
    params = SamplingParams(max_tokens=4)
    for k, v in kwargs.items():
        setattr(params, k, v)
    return params


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda llm: llm.generate("hi", _exploit_params(top_k=10**20)), r"SamplingParams\.top_k"),
        (
            lambda llm: llm.generate("hi", _exploit_params(min_tokens=2, stop_token_ids=[1000000])),
            r"SamplingParams\.stop_token_ids must hold token ids in \[0, 49152\)",
        ),
        (
            lambda llm: llm.generate("hi", _exploit_params(temperature=float("inf"))),
            r"SamplingParams\.temperature must be a finite number",
        ),
        (lambda llm: llm.generate("hi", GREEDY, priority=[2**63]), "priority"),
        (lambda llm: llm.generate("\udc80x", GREEDY), "lone surrogate"),
        (lambda llm: llm.generate(b"hello", GREEDY), "decode it"),
        (lambda llm: llm.generate([], GREEDY), "no prompts"),
        (lambda llm: llm.chat([], GREEDY), "no messages"),
        (lambda llm: llm.generate([1, 2.5], GREEDY), r"item 1 is 2\.5"),
        (
            lambda llm: llm.chat(
                [{"role": "user", "content": "hi"}],
                GREEDY,
                chat_template_kwargs={"tokenize": False},
            ),
            "'tokenize' is an option of apply_chat_template",
        ),
        (
            lambda llm: llm.chat(
                [{"role": "user", "content": "hi"}],
                GREEDY,
                chat_template_kwargs={"return_tensors": "np"},
            ),
            "'return_tensors' is an option of apply_chat_template",
        ),
    ],
)
def test_issue_exploits_are_invalid_requests_and_the_engine_keeps_serving(llm, call, match):
    with pytest.raises(InvalidRequestError, match=match):
        call(llm)
    assert llm.generate("still serving", GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert not llm.engine.call_utility("list_requests")


def test_a_tiny_temperature_is_greedy_not_nan(llm):
    greedy = llm.generate("hi", GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    tiny = SamplingParams(temperature=1e-40, top_p=0.5, max_tokens=24, ignore_eos=True)
    assert llm.generate("hi", tiny, use_tqdm=False)[0].outputs[0].token_ids == greedy


def test_final_only_and_metrics(llm):
    params = SamplingParams(
        temperature=0, max_tokens=5, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY
    )
    out = llm.generate("metrics", params, use_tqdm=False)[0]
    m = out.metrics
    assert out.finished and m.num_generation_tokens == 5
    assert m.ttft is not None and m.ttft > 0 and m.e2e_latency >= m.ttft
    assert m.queue_time is not None and m.queue_time >= 0


def test_eos_ends_a_request(llm):
    eos = llm.info.eos_token_id
    full = llm.generate("eos test", GREEDY, use_tqdm=False)[0].outputs[0]
    # with eos among the stop ids (as a model whose EOS came early would), the request stops there
    params = SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[full.token_ids[2]])
    out = llm.generate("eos test", params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and len(out.token_ids) <= 3
    assert eos is not None


def test_max_model_len_unset_is_the_models_lowered_to_the_kv_cache(model_dir):
    import json
    from pathlib import Path

    from baton.errors import InvalidRequestError

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    page = 2 * cfg["num_hidden_layers"] * 16 * heads * head_dim * 4  # one float32 block of 16
    # 33 blocks: 32 usable after the null block, 512 tokens, below the model's 2048
    with LLM(model=model_dir, block_size=16, kv_cache_memory=33 * page) as llm:
        assert llm.config.model.max_model_len is None
        assert llm.info.max_model_len == 512 < cfg["max_position_embeddings"]
        with pytest.raises(InvalidRequestError, match="max_model_len is 512"):
            llm.generate({"prompt_token_ids": [5] * 600}, use_tqdm=False)
        (out,) = llm.generate(
            {"prompt_token_ids": [5] * 500},
            SamplingParams(max_tokens=12, ignore_eos=True),
            use_tqdm=False,
        )
        assert len(out.outputs[0].token_ids) == 12
