"""Operations through HTTP: the bounded queue (429), CORS, X-Request-Id, JSON log lines, vLLM's
metric names (issue 16 item 4)."""

from __future__ import annotations

import json
import threading

import httpx
from prometheus_client.parser import text_string_to_metric_families

from .conftest import metric, running_server, wait_for
from .test_lifecycle import ServeProcess

CHAT = [{"role": "user", "content": "Go on and on."}]


def test_queue_full_is_a_429_with_retry_after_and_counted(model_dir):
    with running_server(
        model_dir,
        max_model_len=2000,
        max_num_seqs=1,
        **{"server.max_queued_requests": 1, "cache.kv_cache_memory": "64MiB"},
    ) as srv:
        client = srv.client()
        # A holds the only running seat (it has its first token: no longer queued)
        running = client.chat.completions.create(
            model=srv.model,
            messages=CHAT,
            max_tokens=1900,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        it = iter(running)
        next(it)
        answers: list[int] = []
        queued = threading.Thread(
            target=lambda: answers.append(
                httpx.post(
                    f"{srv.url}/v1/completions",
                    json={"model": srv.model, "prompt": "queued", "max_tokens": 2},
                    timeout=120,
                ).status_code
            )
        )
        queued.start()  # B waits for the seat: the queue (of one) is full
        wait_for(lambda: metric(srv.metrics(), "baton_num_requests_waiting") == 1, what="B waiting")
        refused = httpx.post(
            f"{srv.url}/v1/chat/completions",
            json={"model": srv.model, "messages": CHAT, "max_tokens": 2},
            timeout=30,
        )
        assert refused.status_code == 429, refused.text
        assert refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "queue_full"
        assert metric(srv.metrics(), "baton_requests_rejected_total", reason="queue_full") == 1
        running.close()  # A aborted: B runs, and the queue has room again
        queued.join(60)
        assert answers == [200]
        ok = client.completions.create(model=srv.model, prompt="room again", max_tokens=2)
        assert ok.choices[0].finish_reason == "length"


def test_cors_preflight_and_response_headers(model_dir):
    origin = "https://app.example.com"
    with running_server(
        model_dir, **{"server.cors_origins": [origin], "server.api_key": "sekrit"}
    ) as srv:
        preflight = httpx.options(
            f"{srv.url}/v1/chat/completions",
            headers={
                "Origin": origin,
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization, content-type, x-request-id",
            },
        )
        assert preflight.status_code == 200  # answered without the API key
        assert preflight.headers["access-control-allow-origin"] == origin
        assert "POST" in preflight.headers["access-control-allow-methods"]
        assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
        r = httpx.post(
            f"{srv.url}/v1/completions",
            headers={"Origin": origin, "Authorization": "Bearer sekrit"},
            json={"model": srv.model, "prompt": "hi", "max_tokens": 1},
        )
        assert r.status_code == 200
        assert r.headers["access-control-allow-origin"] == origin
        assert "x-request-id" in r.headers["access-control-expose-headers"].lower()
        unauthorized = httpx.get(f"{srv.url}/v1/models", headers={"Origin": origin})
        assert unauthorized.status_code == 401  # errors carry the headers too
        assert unauthorized.headers["access-control-allow-origin"] == origin
        other = httpx.options(
            f"{srv.url}/v1/chat/completions",
            headers={"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"},
        )
        assert other.status_code == 400
        assert "access-control-allow-origin" not in other.headers


def test_no_cors_headers_by_default(server):
    r = httpx.get(f"{server.url}/health", headers={"Origin": "https://app.example.com"})
    assert "access-control-allow-origin" not in r.headers


def test_x_request_id_is_the_id_prefix_and_echoed(server):
    body = {"model": server.model, "messages": CHAT, "max_tokens": 2}
    r = httpx.post(
        f"{server.url}/v1/chat/completions", json=body, headers={"X-Request-Id": "trace-42.a:b"}
    )
    rid = r.headers["x-request-id"]
    assert rid.startswith("chatcmpl-trace-42.a:b-") and r.json()["id"] == rid
    r = httpx.post(f"{server.url}/v1/chat/completions", json={**body, "stream": True})
    rid = r.headers["x-request-id"]
    first = json.loads(r.text.split("\n\n")[0].removeprefix("data: "))
    assert rid.startswith("chatcmpl-") and first["id"] == rid
    r = httpx.post(
        f"{server.url}/v1/completions",
        json={"model": server.model, "prompt": "x", "max_tokens": 1},
        headers={"X-Request-Id": "c1"},
    )
    assert r.json()["id"] == r.headers["x-request-id"] and r.json()["id"].startswith("cmpl-c1-")
    # a value that is not safe in an id is not used; the server makes one
    for unsafe in ("has space", "x" * 129, "semi;colon"):
        r = httpx.post(
            f"{server.url}/v1/chat/completions", json=body, headers={"X-Request-Id": unsafe}
        )
        assert (
            unsafe not in r.headers["x-request-id"] and r.json()["id"] == r.headers["x-request-id"]
        )
    # routes without a generation echo the client's id as it is
    assert (
        httpx.get(f"{server.url}/health", headers={"X-Request-Id": "h-1"}).headers["x-request-id"]
        == "h-1"
    )
    bad = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={**body, "temperature": 9},
        headers={"X-Request-Id": "bad-1"},
    )
    assert bad.status_code == 400 and bad.headers["x-request-id"] == "bad-1"


def _families(url: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def test_vllm_metric_names(model_dir):
    with running_server(model_dir, **{"observability.prometheus.metric_names": "both"}) as srv:
        srv.client().completions.create(
            model=srv.model, prompt="count", max_tokens=5, extra_body={"ignore_eos": True}
        )
        wait_for(
            lambda: sum(_families(srv.url).get("vllm:request_success_total", {}).values()) == 1,
            what="the finished request counted",
        )
        fams = _families(srv.url)
        for name in (
            "num_requests_running",
            "num_requests_waiting",
            "prompt_tokens_total",
            "generation_tokens_total",
            "request_success_total",
            "time_to_first_token_seconds_count",
            "time_to_first_token_seconds_bucket",
            "inter_token_latency_seconds_count",
            "e2e_request_latency_seconds_sum",
            "request_queue_time_seconds_count",
        ):
            assert fams[f"vllm:{name}"] == fams[f"baton_{name}"], name
        assert sum(fams["vllm:generation_tokens_total"].values()) == 5
        assert sum(fams["vllm:inter_token_latency_seconds_count"].values()) == 4
        assert (
            fams["vllm:time_per_output_token_seconds_count"]
            == fams["vllm:inter_token_latency_seconds_count"]
        )
        labels = dict(next(iter(fams["vllm:num_requests_running"])))
        assert labels["model_name"] == srv.model
        buckets = {float(dict(k)["le"]) for k in fams["vllm:time_to_first_token_seconds_bucket"]}
        assert {0.001, 2560.0, float("inf")} <= buckets and len(buckets) == 23
    with running_server(model_dir, **{"observability.prometheus.metric_names": "vllm"}) as srv:
        names = set(_families(srv.url))
        assert "vllm:e2e_request_latency_seconds_count" in names
        assert {n for n in names if n.startswith("baton_")} == {"baton_requests_rejected_total"}


def test_json_log_lines(model_dir):
    serve = ServeProcess(
        "--model", model_dir, "--max-model-len", "256", "--set", "server.log_format=json"
    )
    try:
        r = httpx.post(
            f"{serve.url}/v1/completions",
            json={"prompt": "hi", "max_tokens": 1, "frobnicate": 1},  # unknown: a warning line
            headers={"X-Request-Id": "log-me"},
            timeout=60,
        )
        assert r.status_code == 200
        wait_for(lambda: any("frobnicate" in line for line in serve.log), what="the warning")
    finally:
        serve.proc.terminate()
        serve.wait()
    records = [json.loads(line) for line in serve.log if line.startswith("{")]
    assert any("listening on" in r["message"] for r in records)
    (warning,) = [r for r in records if "frobnicate" in r["message"]]
    assert warning["level"] == "WARNING" and warning["request_id"] == "log-me"
    assert set(warning) >= {"time", "level", "logger", "message", "request_id"}
    # every log line of the server is JSON (other stderr output, e.g. warnings, is not logging's)
    assert not [line for line in serve.log if " INFO " in line or " WARNING " in line]
