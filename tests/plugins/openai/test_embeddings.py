"""/v1/embeddings through the official openai client and raw HTTP against a real server.

The tiny model's vectors are checked against transformers' hidden states (last token,
normalised, the config's default), for texts and token ids, float and base64.
"""

from __future__ import annotations

import base64

import httpx
import numpy as np
import openai
import pytest
import torch

_ref: dict[str, torch.nn.Module] = {}


def want(model_dir: str, ids: list[int], normalize: bool = True) -> np.ndarray:
    from transformers import AutoModel

    if model_dir not in _ref:
        _ref[model_dir] = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        vec = _ref[model_dir](torch.tensor([ids])).last_hidden_state[0, -1]
    if normalize:
        vec = torch.nn.functional.normalize(vec, dim=0)
    return vec.numpy()


def tokens(server, text: str) -> list[int]:
    r = httpx.post(f"{server.url}/tokenize", json={"prompt": text}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def test_openai_client_embeds_texts(server, client, model_dir):
    texts = ["The weather today is", "hello"]
    # the openai client asks for base64 and decodes it itself (float32, little-endian)
    r = client.embeddings.create(model=server.model, input=texts)
    assert r.object == "list" and r.model == server.model
    assert [d.index for d in r.data] == [0, 1]
    ids = [tokens(server, t) for t in texts]
    for d, i in zip(r.data, ids, strict=True):
        np.testing.assert_allclose(d.embedding, want(model_dir, i), atol=1e-4)
    assert r.usage.prompt_tokens == sum(map(len, ids)) == r.usage.total_tokens


def test_float_and_base64_carry_the_same_vector(server):
    body = {"model": server.model, "input": [[5, 6, 7], [8, 9]]}
    floats = httpx.post(f"{server.url}/v1/embeddings", json=body, timeout=30).json()
    b64 = httpx.post(
        f"{server.url}/v1/embeddings", json={**body, "encoding_format": "base64"}, timeout=30
    ).json()
    for f, b in zip(floats["data"], b64["data"], strict=True):
        decoded = np.frombuffer(base64.b64decode(b["embedding"]), dtype="<f4")
        assert decoded.tolist() == pytest.approx(f["embedding"], abs=0)
        assert len(f["embedding"]) == 64
    assert floats["usage"] == {"prompt_tokens": 5, "total_tokens": 5}


def test_token_ids_and_normalize_false(server, model_dir):
    r = httpx.post(
        f"{server.url}/v1/embeddings",
        json={"input": [11, 12, 13, 14], "normalize": False},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    got = r.json()["data"][0]["embedding"]
    np.testing.assert_allclose(got, want(model_dir, [11, 12, 13, 14], normalize=False), atol=1e-4)
    assert abs(np.linalg.norm(got) - 1.0) > 1e-3  # really not normalised


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"input": [1, 2, 49152]}, "input", "outside the vocabulary"),
        ({"input": [[5] * 1024]}, "input", "model.max_model_len is 1024"),
        ({"input": ["ok", "word " * 50_000]}, "input", "max_model_len"),
        ({"input": ""}, "input", "empty"),
        ({"input": []}, "input", "must not be empty"),
        ({"input": [[1, 2], "x"]}, "input", "input must be"),
        ({"input": "hi", "dimensions": 8}, "dimensions", "not trained for shortened"),
        ({"input": "hi", "encoding_format": "int8"}, "encoding_format", "float"),
        ({"input": "hi", "model": "other"}, "model", "does not exist"),
    ],
)
def test_bad_fields_are_400s_naming_them(server, body, param, words):
    r = httpx.post(f"{server.url}/v1/embeddings", json=body, timeout=30)
    err = r.json()["error"]
    assert r.status_code == (404 if param == "model" else 400), r.text
    assert err["param"] == param and words in err["message"], err


def test_embeddings_and_chat_share_the_engine(server, client):
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        chats = [
            pool.submit(
                client.chat.completions.create,
                model=server.model,
                messages=[{"role": "user", "content": f"count to {i}"}],
                max_tokens=16,
                temperature=0,
            )
            for i in range(2)
        ]
        embeds = [
            pool.submit(client.embeddings.create, model=server.model, input=f"text {i}")
            for i in range(4)
        ]
        assert all(len(e.result().data[0].embedding) == 64 for e in embeds)
        assert all(c.result().choices[0].message.content is not None for c in chats)


def test_openai_client_error_type(server, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model=server.model, input="hi", dimensions=8)
    assert e.value.body["param"] == "dimensions"


def test_an_encoder_server_embeds_and_refuses_generation():
    from baton.testing.tiny_model import tiny_model

    from .conftest import running_server

    path = str(tiny_model("bert"))
    with running_server(path, max_model_len=128) as srv:
        client = srv.client()
        r = client.embeddings.create(model=srv.model, input="Hello there")
        ids = tokens(srv, "Hello there")
        from transformers import AutoModel

        ref = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
        with torch.no_grad():
            cls = ref(torch.tensor([ids])).last_hidden_state[0, 0]
        want_cls = torch.nn.functional.normalize(cls, dim=0).numpy()  # BERT's default: cls
        np.testing.assert_allclose(r.data[0].embedding, want_cls, atol=1e-4)
        for call in (
            lambda: client.chat.completions.create(
                model=srv.model, messages=[{"role": "user", "content": "hi"}], max_tokens=2
            ),
            lambda: client.completions.create(model=srv.model, prompt="hi", max_tokens=2),
        ):
            with pytest.raises(openai.BadRequestError) as e:
                call()
            assert e.value.body["param"] == "model"
            assert "cannot generate text" in e.value.body["message"]
