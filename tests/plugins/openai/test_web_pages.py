"""The playground and dashboard routes over HTTP: what is public and what needs the key, the
security headers, the figures /ui/stats reads from the engine, and the files the distribution
ships (tests/plugins/openai/test_web_browser.py runs the pages themselves)."""

from __future__ import annotations

import re
import tomllib
from fnmatch import fnmatch
from pathlib import Path

import httpx
import pytest

from baton.config import BatonConfig
from baton.metrics.stats import IterationStats
from baton.protocol import SchedulerStats
from baton_openai.endpoints.web_pages import CONTENT_SECURITY_POLICY
from baton_openai.metrics.dashboard_stats import DashboardStatsSource, quantile
from baton_openai.metrics.prometheus import PrometheusStatLogger
from baton_openai.metrics.settings import PrometheusSettings

from .conftest import metric, running_server, wait_for

PLUGIN = Path(__file__).parents[3] / "plugins" / "openai"
WEB = PLUGIN / "src" / "baton_openai" / "web"
KEY = "pages-key"
PAGES = ["/", "/dashboard", "/ui/static/common.js", "/ui/static/style.css"]


@pytest.fixture(scope="module")
def keyed(model_dir):
    with running_server(model_dir, server={"api_key": KEY}) as srv:
        yield srv


def test_every_file_is_sent_with_a_strict_content_security_policy(server):
    for path in PAGES:
        r = httpx.get(f"{server.url}{path}")
        assert r.status_code == 200, path
        csp = r.headers["content-security-policy"]
        assert csp == CONTENT_SECURITY_POLICY
        assert "default-src 'none'" in csp and "script-src 'self'" in csp
        assert "unsafe-inline" not in csp and "unsafe-eval" not in csp
        assert r.headers["x-content-type-options"] == "nosniff"
    assert httpx.get(f"{server.url}/").headers["content-type"].startswith("text/html")
    js = httpx.get(f"{server.url}/ui/static/playground.js").headers["content-type"]
    assert js.startswith("text/javascript")
    assert httpx.get(f"{server.url}/ui/static/nothing.js").status_code == 404


def test_the_pages_are_public_but_their_data_needs_the_key(keyed):
    for path in PAGES:
        assert httpx.get(f"{keyed.url}{path}").status_code == 200, path
    for path in ("/ui/info", "/ui/stats", "/v1/models"):
        r = httpx.get(f"{keyed.url}{path}")
        assert r.status_code == 401, path
        assert r.json()["error"]["code"] == "invalid_api_key"
        wrong = httpx.get(f"{keyed.url}{path}", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401, path
        right = httpx.get(f"{keyed.url}{path}", headers={"Authorization": f"Bearer {KEY}"})
        assert right.status_code == 200, path
    # the pages themselves carry nothing of the server: no model name, no figures
    page = httpx.get(f"{keyed.url}/").text + httpx.get(f"{keyed.url}/dashboard").text
    assert keyed.model not in page


def test_the_playground_setting_turns_the_playground_off(model_dir):
    with running_server(model_dir, server={"playground": False}) as srv:
        off = httpx.get(f"{srv.url}/")
        assert off.status_code == 404
        assert httpx.get(f"{srv.url}/ui/static/playground.js").status_code == 404
        assert httpx.get(f"{srv.url}/dashboard").status_code == 200
        assert httpx.get(f"{srv.url}/ui/info").json()["playground"] is False


def test_stats_follow_the_engine(server, client):
    before = httpx.get(f"{server.url}/ui/stats").json()
    client.chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": "Hello"}],
        max_tokens=12,
        extra_body={"ignore_eos": True},
    )
    wait_for(
        lambda: metric(server.metrics(), "baton_num_requests_running") == 0,
        what="the request to finish",
    )
    after = httpx.get(f"{server.url}/ui/stats").json()
    assert after["stats_enabled"] and after["uptime_s"] > before["uptime_s"]
    [e0], [e1] = before["engines"], after["engines"]
    assert e1["engine"] == "0" and e1["running"] == 0 and e1["waiting"] == 0
    assert e1["generation_tokens"] - e0["generation_tokens"] == 12
    assert e1["finished"]["length"] - e0["finished"]["length"] == 1
    assert e1["ttft_s"]["count"] >= 1 and e1["ttft_s"]["p50"] > 0
    assert e1["ttft_s"]["p50"] <= e1["ttft_s"]["p90"] <= e1["ttft_s"]["p99"]
    assert e1["itl_s"]["count"] >= 11
    # /metrics says the same
    m = server.metrics()
    assert e1["generation_tokens"] == metric(m, "baton_generation_tokens_total")
    assert e1["prompt_tokens"] == metric(m, "baton_prompt_tokens_total")


def test_stats_have_one_entry_per_data_parallel_engine(model_dir):
    with running_server(
        model_dir, max_model_len=128, data_parallel_size=2, routing={"router": "round-robin"}
    ) as srv:
        client = srv.client()
        for _ in range(2):  # one on each engine
            client.completions.create(model=srv.model, prompt="Hi", max_tokens=4)
        stats = httpx.get(f"{srv.url}/ui/stats").json()
        info = httpx.get(f"{srv.url}/ui/info").json()
    assert info["data_parallel_size"] == 2
    assert [e["engine"] for e in stats["engines"]] == ["0", "1"]
    assert [e["generation_tokens"] for e in stats["engines"]] == [4, 4]
    assert [e["finished"]["length"] for e in stats["engines"]] == [1, 1]


def test_info_lists_the_plugins_and_the_cpu_path(server):
    info = httpx.get(f"{server.url}/ui/info").json()
    assert info["model"] == server.model and info["max_model_len"] == 1024
    assert info["architecture"] == "LlamaForCausalLM"
    assert info["dtype"] in ("float32", "bfloat16", "float16")
    rows = {(p["kind"], p["name"]): p for p in info["plugins"]}
    prometheus = rows[("stat_logger", "prometheus")]
    assert prometheus["distribution"] == "baton-plugin-openai" and prometheus["selected"]
    assert prometheus["settings"] == {"metric_names": "baton"}
    assert rows[("scheduler_policy", "fcfs")]["selected"]
    assert not rows[("scheduler_policy", "priority")]["selected"]
    # baton env's report: the kernels the engine built, each with its path and the reason
    cpu = info["cpu"]
    assert cpu["kernel_isa"] == "native" and cpu["arch"] in ("x86_64", "aarch64")
    assert cpu["kernels_built"], cpu["kernels_error"]
    assert {"linear_q", "paged_decode"} <= {k["kernel"] for k in cpu["kernels"]}
    assert all(k["path"] and k["why"] for k in cpu["kernels"])


@pytest.mark.parametrize("names", ["baton", "vllm", "both"])
def test_figures_are_per_engine_whatever_the_metric_names(names):
    logger = PrometheusStatLogger(BatonConfig.load(), PrometheusSettings(metric_names=names))
    source = DashboardStatsSource(logger.registry, logger.prefix)
    logger.record(
        SchedulerStats(
            num_running_reqs=2,
            num_waiting_reqs=3,
            kv_cache_usage=0.25,
            prefix_cache_queries=100,
            prefix_cache_hits=40,
            num_preemptions=1,
        ),
        IterationStats(
            timestamp=0.0,
            num_prompt_tokens=7,
            num_generation_tokens=10,
            time_to_first_tokens=[0.05, 0.15],
            inter_token_latencies=[0.02] * 10,
        ),
        engine_index=0,
    )
    logger.record(SchedulerStats(num_running_reqs=1), None, engine_index=1)
    logger.count_rejected("queue_full")
    stats = source.read()
    assert stats.stats_enabled and stats.rejected == 1
    e0, e1 = stats.engines
    assert (e0.engine, e0.running, e0.waiting, e0.kv_cache_usage) == ("0", 2, 3, 0.25)
    assert (e0.preemptions, e0.prompt_tokens, e0.generation_tokens) == (1, 7, 10)
    assert e0.prefix_cache_hit_rate == pytest.approx(0.4)
    assert e0.ttft_s.count == 2 and 0.04 <= e0.ttft_s.p50 <= 0.1
    assert e0.itl_s.count == 10 and 0.01 <= e0.itl_s.p99 <= 0.025
    assert e0.generation_tokens_per_s is not None and e0.generation_tokens_per_s > 0
    assert (e1.engine, e1.running, e1.generation_tokens) == ("1", 1, 0)
    assert e1.ttft_s.p50 is None and e1.prefix_cache_hit_rate is None
    # a second read: the window still begins at the first snapshot (140 hits of 200 queries)
    logger.record(SchedulerStats(prefix_cache_queries=100, prefix_cache_hits=100), None, 0)
    assert source.read().engines[0].prefix_cache_hit_rate == pytest.approx(0.7)


def test_without_engine_stats_there_are_no_figures():
    stats = DashboardStatsSource(None, "baton_").read()
    assert not stats.stats_enabled and stats.engines == []


@pytest.mark.parametrize(
    ("q", "expected"),
    [
        (0.5, 0.15),  # rank 5 of 10: halfway into the (0.1, 0.2] bucket's 4 to 6
        (0.9, 0.3),  # rank 9: the top of (0.2, 0.3]
        (0.99, 0.3),  # rank 9.9: in +Inf, so the highest finite bound
        (0.1, 0.05),  # rank 1 of the first bucket's 2: half of (0, 0.1]
    ],
)
def test_quantile_interpolates_inside_a_bucket_as_prometheus_does(q, expected):
    buckets = [(0.1, 2.0), (0.2, 8.0), (0.3, 9.0), (float("inf"), 10.0)]
    assert quantile(q, buckets) == pytest.approx(expected)


def test_quantile_without_observations_is_none():
    assert quantile(0.5, [(0.1, 0.0), (float("inf"), 0.0)]) is None
    assert quantile(0.5, []) is None


def test_the_distribution_ships_every_page_file_and_nothing_from_elsewhere():
    config = tomllib.loads((PLUGIN / "pyproject.toml").read_text())
    globs = config["tool"]["setuptools"]["package-data"]["baton_openai"]
    files = sorted(p.name for p in WEB.iterdir() if p.is_file())
    assert files, WEB
    for name in files:
        assert any(fnmatch(f"web/{name}", g) for g in globs), f"{name} is not package data"
        text = (WEB / name).read_text()
        # works offline: no URL of another origin (a CDN, a font), no inline script or style
        assert not re.search(r"(src|href)=[\"']?(https?:)?//", text), name
        assert not re.search(r"<script>|<style|style=", text), name
        assert "innerHTML" not in text, f"{name}: answers are text, never HTML"
