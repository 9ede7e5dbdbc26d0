"""Speculative decoding's counters at /metrics (baton's and vLLM's names), scraped from a real
server running the ngram speculator on the tiny model."""

from __future__ import annotations

from baton.testing.conformance.speculator import PROMPTS

from .conftest import running_server, wait_for
from .test_serving_ops import _families

SPEC = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


def _total(fams: dict, name: str) -> float:
    return sum(fams.get(name, {}).values())


def test_spec_decode_counters_equal_the_engines_totals(model_dir):
    with running_server(
        model_dir,
        speculative={"method": "ngram", "num_tokens": 4, "disable_by_batch_size": None},
        **{"observability.prometheus.metric_names": "both"},
    ) as srv:
        fams = _families(srv.url)
        # before any request: zeros, one per-position series per draft position
        assert _total(fams, "baton_spec_decode_num_drafts_total") == 0
        positions = {
            dict(k)["position"] for k in fams["vllm:spec_decode_num_accepted_tokens_per_pos_total"]
        }
        assert positions == {"0", "1", "2", "3"}
        for p in PROMPTS[:2]:
            srv.client().completions.create(
                model=srv.model,
                prompt=list(p),
                max_tokens=24,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
        wait_for(
            lambda: _total(_families(srv.url), "baton_request_success_total") == 2,
            what="both requests counted",
        )
        totals = srv.call(srv.server.engine.get_stats())
        fams = _families(srv.url)
        assert totals.spec_num_drafts > 0
        for name in SPEC:
            baton = _total(fams, f"baton_spec_decode_{name}_total")
            assert fams[f"vllm:spec_decode_{name}_total"] == fams[f"baton_spec_decode_{name}_total"]
            assert baton == getattr(totals, f"spec_{name}"), name
        per_pos = fams["vllm:spec_decode_num_accepted_tokens_per_pos_total"]
        by_pos = [per_pos[k] for k in sorted(per_pos, key=lambda k: int(dict(k)["position"]))]
        assert by_pos == totals.spec_accepted_per_position
        assert sum(by_pos) == totals.spec_num_accepted_tokens
        labels = dict(next(iter(per_pos)))
        assert labels["model_name"] == srv.model and labels["engine"] == "0"


def test_no_spec_decode_series_without_speculation(server):
    assert not any("spec_decode" in name for name in _families(server.url))
