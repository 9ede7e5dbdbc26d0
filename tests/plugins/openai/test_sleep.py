"""vLLM's dev endpoints POST /sleep, POST /wake_up, GET /is_sleeping, and POST /start_profile,
POST /stop_profile (with observability.profile_dir), behind the API key."""

from __future__ import annotations

import json
from pathlib import Path

import httpx

from .conftest import running_server

KEY = {"Authorization": "Bearer s3cret"}


def complete(url: str) -> httpx.Response:
    body = {"prompt": "one two three four", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    return httpx.post(f"{url}/v1/completions", json=body, headers=KEY, timeout=60)


def test_sleep_wake_and_is_sleeping(model_dir):
    with running_server(
        model_dir, max_model_len=256, kv_cache_memory=4 << 20, server={"api_key": "s3cret"}
    ) as srv:
        url = srv.url
        assert httpx.post(f"{url}/sleep").status_code == 401  # the API key guards them
        assert httpx.get(f"{url}/is_sleeping").status_code == 401
        first = complete(url)
        assert first.status_code == 200
        assert httpx.get(f"{url}/is_sleeping", headers=KEY).json() == {"is_sleeping": False}

        bad = httpx.post(f"{url}/sleep", params={"level": 3}, headers=KEY)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "level"
        assert httpx.post(f"{url}/sleep", params={"level": 1}, headers=KEY).status_code == 200
        assert httpx.get(f"{url}/is_sleeping", headers=KEY).json() == {"is_sleeping": True}
        (mem,) = srv.call(srv.server.engine.get_memory_usage())
        assert mem.kv_cache_bytes == 0 and mem.weights_bytes > 0
        refused = complete(url)  # the engine refuses it: 503, saying how to wake it
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "engine_sleeping"
        assert "wake_up" in refused.json()["error"]["message"]
        assert httpx.get(f"{url}/health").status_code == 200  # asleep is not unhealthy

        assert httpx.post(f"{url}/wake_up", headers=KEY).status_code == 200
        assert httpx.get(f"{url}/is_sleeping", headers=KEY).json() == {"is_sleeping": False}
        again = complete(url)
        assert again.status_code == 200
        assert again.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]


def test_profile_endpoints_write_traces_when_the_folder_is_set(model_dir, tmp_path):
    with running_server(
        model_dir,
        max_model_len=256,
        kv_cache_memory=4 << 20,
        server={"api_key": "s3cret"},
        observability={"profile_dir": str(tmp_path)},
    ) as srv:
        assert httpx.post(f"{srv.url}/start_profile").status_code == 401
        assert httpx.post(f"{srv.url}/start_profile", headers=KEY).status_code == 200
        assert complete(srv.url).status_code == 200
        stopped = httpx.post(f"{srv.url}/stop_profile", headers=KEY)
        assert stopped.status_code == 200
        (trace,) = stopped.json()["traces"]
        events = json.loads(Path(trace).read_text())["traceEvents"]
        assert Path(trace).parent == tmp_path and "aten::embedding" in {e["name"] for e in events}
        again = httpx.post(f"{srv.url}/stop_profile", headers=KEY)
        assert again.status_code == 400 and "not profiling" in again.json()["error"]["message"]


def test_no_profile_endpoints_without_the_folder(model_dir):
    with running_server(model_dir, max_model_len=256, kv_cache_memory=4 << 20) as srv:
        assert httpx.post(f"{srv.url}/start_profile").status_code == 404
        assert httpx.post(f"{srv.url}/stop_profile").status_code == 404


def test_collective_rpc_is_not_served_over_http(server):
    for method in ("post", "get"):
        r = httpx.request(method, f"{server.url}/collective_rpc", json={"method": "memory_usage"})
        assert r.status_code == 404
