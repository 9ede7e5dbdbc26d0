"""/v1/models, /health, /version, /metrics (parsed with prometheus-client), the API key."""

from __future__ import annotations

import fastapi.routing
import httpx
import openai
import pytest

import baton

from .conftest import metric, running_server, wait_for


def test_models(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [server.model]
    assert models.data[0].model_extra["max_model_len"] == 1024


def test_health_and_version(server):
    assert httpx.get(f"{server.url}/health").status_code == 200
    v = httpx.get(f"{server.url}/version").json()
    assert v["version"] == baton.__version__


def test_routes_are_built_before_the_server_listens(model_dir, monkeypatch):
    """FastAPI builds an included router's routes on the first request matched against them
    (~85 ms of the event loop, which a /health probe waited for); build_routes has them built
    before the server listens. (A FastAPI that renames the hook fails here: see build_routes.)"""
    context = fastapi.routing._EffectiveRouteContext
    built: list[str] = []
    original = context.from_api_route

    def counted(*args, **kwargs):
        built.append(kwargs["original_route"].path)
        return original(*args, **kwargs)

    monkeypatch.setattr(context, "from_api_route", counted)
    with running_server(model_dir) as srv:
        at_start = len(built)
        for path in ("/health", "/v1/models", "/version", "/metrics"):
            assert httpx.get(f"{srv.url}{path}", timeout=10).status_code == 200, path
        r = httpx.post(f"{srv.url}/v1/completions", json={}, timeout=10)
        assert r.status_code == 400
    assert at_start > 10, built
    assert built[at_start:] == [], "routes built while serving"


def test_unknown_route_is_openai_shaped(server):
    r = httpx.get(f"{server.url}/v1/nothing")
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_counters_move_by_the_right_amounts(server, client):
    before = server.metrics()
    r = client.completions.create(
        model=server.model,
        prompt="count me",
        max_tokens=7,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    after = server.metrics()

    def delta(name, **labels):
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert delta("baton_generation_tokens_total") == 7
    assert delta("baton_prompt_tokens_total") == r.usage.prompt_tokens
    assert delta("baton_request_success_total", finished_reason="length") == 1
    assert delta("baton_request_success_total", finished_reason="stop") == 0
    assert delta("baton_time_to_first_token_seconds_count") == 1
    assert delta("baton_e2e_request_latency_seconds_count") == 1
    assert delta("baton_request_queue_time_seconds_count") == 1
    # one per output after the first; a lone greedy request gets up to decode_steps tokens in one
    k = server.config.scheduler.decode_steps
    assert delta("baton_inter_token_latency_seconds_count") == -(-6 // k)
    assert delta("baton_prefix_cache_queries_total") >= r.usage.prompt_tokens - 1
    assert delta("baton_time_to_first_token_seconds_sum") > 0
    assert metric(after, "baton_num_requests_running") == 0
    assert metric(after, "baton_num_requests_waiting") == 0
    assert metric(after, "baton_kv_cache_usage_perc") == 0
    # the same prompt again hits the prefix cache (full blocks of 16 tokens)
    long_prompt = "one two three four five six seven eight nine ten " * 4
    client.completions.create(model=server.model, prompt=long_prompt, max_tokens=1)
    mid = server.metrics()
    client.completions.create(model=server.model, prompt=long_prompt, max_tokens=1)
    end = server.metrics()
    assert (
        metric(end, "baton_prefix_cache_hits_total") - metric(mid, "baton_prefix_cache_hits_total")
        >= 32
    )
    assert metric(end, "baton_num_preemptions_total") == 0


def test_metrics_exposes_every_family(server):
    names = {name for name, _ in server.metrics()}
    for family in (
        "baton_num_requests_running",
        "baton_num_requests_waiting",
        "baton_kv_cache_usage_perc",
        "baton_prefix_cache_queries_total",
        "baton_prefix_cache_hits_total",
        "baton_num_preemptions_total",
        "baton_prompt_tokens_total",
        "baton_generation_tokens_total",
        "baton_request_success_total",
        "baton_time_to_first_token_seconds_bucket",
        "baton_inter_token_latency_seconds_bucket",
        "baton_e2e_request_latency_seconds_bucket",
        "baton_request_queue_time_seconds_bucket",
    ):
        assert family in names, family


def test_two_servers_in_one_process_keep_their_own_metrics(server, model_dir, client):
    with running_server(model_dir, max_model_len=256, served_model_name="second") as other:
        other.client().completions.create(
            model="second", prompt="hi", max_tokens=3, extra_body={"ignore_eos": True}
        )
        assert metric(other.metrics(), "baton_generation_tokens_total") == 3
        text = httpx.get(f"{other.url}/metrics").text
        assert 'model_name="second"' in text and server.model not in text
        assert [m.id for m in other.client().models.list().data] == ["second"]


def test_api_key(model_dir):
    with running_server(model_dir, max_model_len=256, server={"api_key": "s3cret"}) as srv:
        with pytest.raises(openai.AuthenticationError) as info:
            srv.client(api_key="wrong").models.list()
        assert info.value.body["code"] == "invalid_api_key"
        ok = srv.client(api_key="s3cret")
        assert ok.completions.create(model=srv.model, prompt="hi", max_tokens=2).choices
        assert httpx.get(f"{srv.url}/health").status_code == 200  # ops routes stay open
        assert httpx.get(f"{srv.url}/metrics").status_code == 200


def test_periodic_log_line(model_dir, caplog):
    caplog.set_level("INFO", logger="baton.stats")
    with running_server(
        model_dir, max_model_len=256, observability={"log_stats_interval": 0.2}
    ) as srv:
        srv.client().completions.create(model=srv.model, prompt="hi", max_tokens=2)
        wait_for(
            lambda: any(
                "generation" in r.getMessage() and "KV cache" in r.getMessage()
                for r in caplog.records
                if r.name == "baton.stats"
            ),
            what="the stats log line",
        )


def test_malformed_bodies_are_openai_400s(server):
    r = httpx.post(
        f"{server.url}/v1/chat/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"model": server.model})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": "many"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
