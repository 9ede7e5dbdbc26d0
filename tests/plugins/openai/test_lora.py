"""LoRA adapters as model names (vLLM's): /v1/models, a request's `model`, --lora-modules, and
POST /v1/load_lora_adapter / /v1/unload_lora_adapter behind server.allow_runtime_lora_updating."""

from __future__ import annotations

import argparse

import httpx
import openai
import pytest

from baton.lora import LoRARequest
from baton_openai.cli import add_serve_arguments, serve_overrides
from tests.core.lora_helpers import adapter

from .conftest import running_server

pytest.importorskip("peft")

PROMPT = "one two three four five"


@pytest.fixture(scope="module")
def adapters(model_dir: str) -> dict[str, str]:
    return {
        "sql": adapter(model_dir, seed=1, r=8),
        "poet": adapter(model_dir, seed=2, r=4, targets=("q_proj", "v_proj")),
    }


@pytest.fixture(scope="module")
def lora_server(model_dir, adapters):
    with running_server(
        model_dir,
        max_model_len=256,
        kv_cache_memory=8 << 20,
        enable_lora=True,
        max_loras=2,
        server={
            "lora_modules": {"sql": adapters["sql"]},
            "allow_runtime_lora_updating": True,
            "served_model_name": "base",
        },
    ) as srv:
        yield srv


def complete(client: openai.OpenAI, model: str) -> str:
    r = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    return r.choices[0].text


def engine_text(srv, lora: LoRARequest | None) -> str:
    """The same completion straight through the server's engine (AsyncLLM)."""
    from baton import SamplingParams

    async def run() -> str:
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        async for out in srv.server.engine.generate(PROMPT, params, lora_request=lora):
            last = out
        return last.outputs[0].text

    return srv.call(run())


def test_adapters_are_models_a_request_selects(lora_server, adapters):
    client = lora_server.client()
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {"base", "sql"}
    assert models["sql"].parent == "base" and models["sql"].root == adapters["sql"]
    assert getattr(models["base"], "parent", None) is None
    base, sql = complete(client, "base"), complete(client, "sql")
    assert base != sql
    assert sql == engine_text(lora_server, LoRARequest("sql", 1, adapters["sql"]))
    assert base == engine_text(lora_server, None)
    chat = client.chat.completions.create(
        model="sql", messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    assert chat.model == "sql"  # the adapter answers under its name (as vLLM)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        complete(client, "nope")


def test_load_and_unload_adapters_at_runtime(lora_server, adapters):
    url, client = lora_server.url, lora_server.client()
    load = f"{url}/v1/load_lora_adapter"
    unload = f"{url}/v1/unload_lora_adapter"
    r = httpx.post(load, json={"lora_name": "poet", "lora_path": adapters["poet"]}, timeout=30)
    assert r.status_code == 200 and "poet" in r.text
    assert {m.id for m in client.models.list().data} == {"base", "sql", "poet"}
    poet = complete(client, "poet")
    assert poet not in (complete(client, "base"), complete(client, "sql"))
    again = httpx.post(load, json={"lora_name": "poet", "lora_path": adapters["poet"]})
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    bad = httpx.post(load, json={"lora_name": "x", "lora_path": "/nonexistent"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "lora_path"
    assert httpx.post(unload, json={"lora_name": "poet"}).status_code == 200
    assert httpx.post(unload, json={"lora_name": "poet"}).status_code == 404
    with pytest.raises(openai.NotFoundError):
        complete(client, "poet")
    # loaded again under the same name: a new adapter id, the same tokens
    assert httpx.post(load, json={"lora_name": "poet", "lora_path": adapters["poet"]}).is_success
    assert complete(client, "poet") == poet


def test_runtime_updates_are_off_by_default(model_dir, adapters):
    with running_server(
        model_dir, max_model_len=128, kv_cache_memory=2 << 20, enable_lora=True
    ) as srv:
        r = httpx.post(
            f"{srv.url}/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": adapters["sql"]}
        )
        assert r.status_code == 404
        assert [m.id for m in srv.client().models.list().data] == [srv.model]


def test_serve_flags():
    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    args = p.parse_args(
        [
            "--enable-lora",
            "--max-loras",
            "4",
            "--max-lora-rank",
            "32",
            "--max-cpu-loras",
            "8",
            "--lora-modules",
            "sql=/a/sql",
            '{"name": "poet", "path": "/a/poet"}',
        ]
    )
    o = serve_overrides(args)
    assert (o["enable_lora"], o["max_loras"], o["max_lora_rank"], o["max_cpu_loras"]) == (
        True,
        4,
        32,
        8,
    )
    assert o["server.lora_modules"] == {"sql": "/a/sql", "poet": "/a/poet"}
    assert serve_overrides(p.parse_args([]))["enable_lora"] is None  # unset: the config decides
    with pytest.raises(SystemExit):
        p.parse_args(["--lora-modules", "no-equals-sign"])


def test_a_bad_lora_module_is_refused_before_the_model_loads(model_dir, tmp_path):
    import asyncio

    from baton.config import BatonConfig
    from baton.errors import ConfigError
    from baton_openai.http.server import OpenAIServer

    config = BatonConfig.load(
        model=model_dir,
        enable_lora=True,
        server={"port": 0, "lora_modules": {"broken": str(tmp_path)}},
    )
    server = OpenAIServer(config)
    with pytest.raises(ConfigError, match=r"server.lora_modules 'broken'.*adapter_config\.json"):
        asyncio.run(server.run())
    assert server.engine is None  # refused before the engine started
