"""Per-request SLOs over HTTP: ``scheduling.slo_ttft_ms`` / ``slo_tpot_ms`` in the body reach
the engine, which counts goodput in /metrics; a bad target is a 400 naming the field."""

from __future__ import annotations

import httpx

from .conftest import metric


def test_slo_targets_reach_the_engine_and_goodput_is_counted(server, client):
    before = server.metrics()
    for ttft in (600_000, 0.001):  # ten minutes: met; a microsecond: missed
        client.completions.create(
            model=server.model,
            prompt="meet me",
            max_tokens=4,
            temperature=0,
            extra_body={"ignore_eos": True, "scheduling": {"slo_ttft_ms": ttft}},
        )
    client.completions.create(model=server.model, prompt="no target", max_tokens=2)
    after = server.metrics()

    def delta(name):
        return metric(after, name) - metric(before, name)

    assert delta("baton_slo_requests_total") == 2
    assert delta("baton_slo_met_requests_total") == 1


def test_a_bad_slo_target_is_a_400_naming_the_field(server):
    r = httpx.post(
        f"{server.url}/v1/completions",
        json={"model": server.model, "prompt": "x", "scheduling": {"slo_tpot_ms": -1}},
    )
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "scheduling.slo_tpot_ms"
