"""Scoring and sampling fields through HTTP: echo + logprobs as lm-evaluation-harness's
local-completions reads them, vLLM's prompt_logprobs, logit_bias, allowed_token_ids,
bad_words and structured_outputs."""

from __future__ import annotations

import json
from operator import itemgetter

import httpx
import openai
import pytest
import torch

GREEDY = {"temperature": 0.0}
#: baton's paged attention (float32, CPU) against transformers' eager forward
TOLERANCE = 1e-4


def token_prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 1000, (n,), generator=g).tolist()


@pytest.fixture(scope="module")
def reference(model_dir):
    """transformers' log_softmax of the full-sequence logits: [position, vocab]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def logprobs(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)

    return logprobs


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json={"model": server.model, **body}, timeout=60)


def test_echo_logprobs_score_prompts_as_lm_eval_reads_them(server, reference):
    # lm-eval's loglikelihood request: token prompts (context + continuation), echo, logprobs=1,
    # max_tokens=1, temperature 0; it reads choices[i].logprobs.token_logprobs[ctxlen:-1]
    prompts = [token_prompt(12, seed=1), token_prompt(7, seed=2)]
    r = post(
        server,
        "/v1/completions",
        {"prompt": prompts, "echo": True, "logprobs": 1, "max_tokens": 1, **GREEDY},
    )
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=itemgetter("index"))
    assert len(choices) == 2
    for ids, choice in zip(prompts, choices, strict=True):
        lp = choice["logprobs"]
        n = len(ids) + 1  # the prompt, then the one generated token
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == n
        assert len(lp["text_offset"]) == n and lp["text_offset"] == sorted(lp["text_offset"])
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        ref = reference(ids)
        want = [float(ref[i - 1, ids[i]]) for i in range(1, len(ids))]
        assert lp["token_logprobs"][1 : len(ids)] == pytest.approx(want, abs=TOLERANCE)
        for i in range(1, len(ids)):
            [(_, best)] = lp["top_logprobs"][i].items()  # logprobs=1: the most likely token
            assert best == pytest.approx(float(ref[i - 1].max()), abs=TOLERANCE)
        # what lm-eval computes from it: the continuation's sum and whether it is greedy
        ctxlen = 5
        total = sum(lp["token_logprobs"][ctxlen:-1])
        assert total == pytest.approx(sum(want[ctxlen - 1 :]), abs=10 * TOLERANCE)
        greedy = all(
            tok == max(top.values())
            for tok, top in zip(
                lp["token_logprobs"][ctxlen:-1], lp["top_logprobs"][ctxlen:-1], strict=True
            )
        )
        assert greedy == all(int(ref[i - 1].argmax()) == ids[i] for i in range(ctxlen, len(ids)))


def test_max_tokens_0_with_echo_returns_the_prompt_alone(server, client):
    ids = token_prompt(9, seed=3)
    r = client.completions.create(
        model=server.model, prompt=ids, echo=True, logprobs=0, max_tokens=0, **GREEDY
    )
    c = r.choices[0]
    assert len(c.logprobs.token_logprobs) == 9 and c.logprobs.token_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in c.logprobs.token_logprobs[1:])
    assert c.logprobs.top_logprobs == [None] * 9  # logprobs=0: no alternatives
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == 9
    text = client.completions.create(
        model=server.model, prompt="Hello there", echo=True, max_tokens=0
    ).choices[0]
    assert text.text == "Hello there" and text.finish_reason == "length"


def test_echo_logprobs_stream_their_prompt_first(server, client):
    ids = token_prompt(6, seed=4)
    whole = client.completions.create(
        model=server.model, prompt=ids, echo=True, logprobs=2, max_tokens=3, **GREEDY
    )
    chunks = list(
        client.completions.create(
            model=server.model,
            prompt=ids,
            echo=True,
            logprobs=2,
            max_tokens=3,
            stream=True,
            **GREEDY,
        )
    )
    scored = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert scored[0].token_logprobs[0] is None and len(scored[0].token_logprobs) == 6
    streamed = [v for lp in scored for v in lp.token_logprobs]
    assert streamed == whole.choices[0].logprobs.token_logprobs
    offsets = [v for lp in scored for v in lp.text_offset]
    assert offsets == whole.choices[0].logprobs.text_offset


def test_prompt_logprobs_in_vllm_shape_on_both_routes(server, reference):
    ids = token_prompt(10, seed=5)
    ref = reference(ids)
    r = post(
        server, "/v1/completions", {"prompt": ids, "max_tokens": 2, "prompt_logprobs": 2, **GREEDY}
    )
    assert r.status_code == 200, r.text
    lps = r.json()["choices"][0]["prompt_logprobs"]
    assert len(lps) == 10 and lps[0] is None
    for i in range(1, 10):
        entry = lps[i][str(ids[i])]
        assert entry["logprob"] == pytest.approx(float(ref[i - 1, ids[i]]), abs=TOLERANCE)
        assert {"logprob", "rank", "decoded_token"} <= set(entry)
        ranks = sorted(e["rank"] for e in lps[i].values())
        assert ranks[:2] == [1, 2] and len(lps[i]) in (2, 3)  # the token and the top 2
    assert r.json()["choices"][0]["logprobs"] is None  # no sample logprobs asked
    chat = post(
        server,
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "prompt_logprobs": 0},
    )
    assert chat.status_code == 200, chat.text
    body = chat.json()
    lps = body["prompt_logprobs"]
    assert lps[0] is None and len(lps) == body["usage"]["prompt_tokens"]
    assert all(len(p) == 1 for p in lps[1:])  # k=0: the prompt token alone


def test_logit_bias_allowed_token_ids_and_bad_words_shape_the_answer(server):
    tokenizer = server.server.engine.tokenizer
    ids = token_prompt(8, seed=6)

    def answer(**extra: object) -> list[str]:
        body = {"prompt": ids, "max_tokens": 4, "logprobs": 0, **GREEDY, **extra}
        r = post(server, "/v1/completions", body)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["logprobs"]["tokens"]

    base = answer()
    forced = [tokenizer.decode([77])] * 4
    assert base != forced
    assert answer(logit_bias={"77": 100}) == forced
    assert answer(allowed_token_ids=[77]) == forced
    assert set(answer(allowed_token_ids=[77, 78])) <= {
        tokenizer.decode([77]),
        tokenizer.decode([78]),
    }
    # a word of one token ("]", token 77) is banned everywhere; allowed, 78 is all that is left
    word = tokenizer.decode([77])
    assert tokenizer.encode(word, add_special_tokens=False) == [77]
    assert answer(allowed_token_ids=[77, 78], bad_words=[word]) == [tokenizer.decode([78])] * 4


def test_logit_bias_refusals_name_the_field(server):
    vocab = server.server.engine.info.vocab_size
    for body in (
        {"logit_bias": {"5": 101}},
        {"logit_bias": {"x": 1}},
        {"logit_bias": {str(vocab): 1}},
    ):
        r = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 1, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", r.text


def test_structured_outputs_constrain_the_answer(server):
    r = post(
        server,
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "Pick"}],
            "max_tokens": 12,
            "structured_outputs": {"regex": "(ab){2}c"},
        },
    )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "ababc"
    r = post(
        server,
        "/v1/completions",
        {"prompt": "Answer:", "max_tokens": 8, "structured_outputs": {"choice": ["yes", "no"]}},
    )
    assert r.status_code == 200 and r.json()["choices"][0]["text"] in ("yes", "no"), r.text
    r = post(
        server,
        "/v1/completions",
        {
            "prompt": "Answer:",
            "max_tokens": 8,
            "structured_outputs": {"regex": "a", "choice": ["b"]},
        },
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs", r.text
    streamed = httpx.post(
        f"{server.url}/v1/completions",
        json={
            "model": server.model,
            "prompt": "Answer:",
            "max_tokens": 8,
            "stream": True,
            "structured_outputs": {"choice": ["alpha", "beta"]},
        },
        timeout=60,
    )
    events = [
        json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")
    ]
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) in ("alpha", "beta")


def test_every_new_field_is_known(server, client, caplog):
    # accepted fields are used, not dropped with the "ignoring unsupported request fields" warning
    with caplog.at_level("WARNING", logger="baton_openai"):
        client.completions.create(
            model=server.model, prompt="hi", max_tokens=1, extra_body={"no_such_field": 1}
        )
        assert "no_such_field" in caplog.text  # the warning is seen here
        caplog.clear()
        client.completions.create(
            model=server.model,
            prompt="hi",
            max_tokens=1,
            extra_body={
                "allowed_token_ids": [5, 6],
                "bad_words": ["x"],
                "prompt_logprobs": 0,
                "structured_outputs": {"regex": "[56]"},
            },
        )
    assert "ignoring" not in caplog.text


def test_bad_values_of_the_new_fields_are_400s(server, client):
    for extra, param in (
        ({"allowed_token_ids": [10**9]}, "allowed_token_ids"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"structured_outputs": {"grammar": 5}}, "structured_outputs"),
    ):
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(
                model=server.model, prompt="hi", max_tokens=1, extra_body=extra
            )
        assert info.value.body["param"] == param, info.value.body


def test_lm_eval_local_completions_scores_through_its_own_payload_and_parser(server, reference):
    # lm-evaluation-harness's own code: the body local-completions sends for loglikelihood and
    # the function that reads the answer (lm_eval.models.openai_completions)
    api = pytest.importorskip("lm_eval.models.openai_completions").LocalCompletionsAPI
    context, continuation = token_prompt(9, seed=11), token_prompt(4, seed=12)
    greedy_ids = list(context)
    for _ in range(3):  # the model's own greedy continuation: is_greedy must say so
        greedy_ids.append(int(reference(greedy_ids)[-1].argmax()))
    requests = [context + continuation, context + continuation[:2], greedy_ids]
    self = type("Self", (), {"model": server.model})()
    payload = api._create_payload(self, requests, generate=False)
    r = httpx.post(f"{server.url}/v1/completions", json=payload, timeout=60)
    assert r.status_code == 200, r.text
    ctxlens = [len(context)] * 3
    scores = api.parse_logprobs(outputs=r.json(), tokens=requests, ctxlens=ctxlens)
    for ids, (logprob, is_greedy) in zip(requests, scores, strict=True):
        ref = reference(ids)
        want = sum(float(ref[i - 1, ids[i]]) for i in range(len(context), len(ids)))
        assert logprob == pytest.approx(want, abs=10 * TOLERANCE)
        greedy = all(int(ref[i - 1].argmax()) == ids[i] for i in range(len(context), len(ids)))
        assert is_greedy == greedy
    assert scores[2][1] is True
