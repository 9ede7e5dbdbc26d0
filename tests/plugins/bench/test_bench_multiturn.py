"""``baton bench multiturn``: the multi-turn workload (deterministic, its shape, each turn's prompt
the conversation so far) and the bench on a tiny model (its report, cached tokens counted)."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from baton.cli.main import main as baton_main
from baton.errors import BatonError
from baton.testing.tiny_model import tiny_model
from baton_bench.multiturn import table
from baton_bench.multiturn_workload import (
    FORMAT,
    load_multiturn,
    multiturn,
    next_prompt,
    write_multiturn,
)


def test_workload_is_deterministic_and_shaped(tokenizer):
    wl = multiturn(tokenizer, sessions=5, turns=3, seed=7, first_prompt_tokens=200)
    again = multiturn(tokenizer, sessions=5, turns=3, seed=7, first_prompt_tokens=200)
    other = multiturn(tokenizer, sessions=5, turns=3, seed=8, first_prompt_tokens=200)
    assert msgspec.json.encode(wl) == msgspec.json.encode(again)
    assert msgspec.json.encode(wl) != msgspec.json.encode(other)
    assert wl.format == FORMAT and len(wl.sessions) == 5
    assert all(len(s.turns) == 3 for s in wl.sessions)
    assert len({s.id for s in wl.sessions}) == 5
    firsts = [s.turns[0].token_ids for s in wl.sessions]
    # about the target: the note that reaches it is the last one added
    assert all(200 <= len(f) <= 260 for f in firsts), [len(f) for f in firsts]
    assert len({tuple(f) for f in firsts}) == 5  # no two sessions share a conversation
    assert all(32 <= t.max_new_tokens <= 48 for s in wl.sessions for t in s.turns)
    assert wl.summary["turns"] == 15 and wl.summary["sessions"] == 5


def test_turn_prompt_is_the_conversation_rendered_by_the_chat_template(tokenizer):
    """Turn 2's prompt is turn 1's, the answer and the next message: the same tokens as the chat
    template's rendering of the whole conversation (for an answer that tokenizes alone as it
    does inside it)."""
    wl = multiturn(tokenizer, sessions=1, turns=3, seed=0, first_prompt_tokens=64)
    s = wl.sessions[0]
    answers = ["Sure, here is a short plan.", "Yes, the second point matters most."]
    prompt = list(s.turns[0].token_ids)
    messages = [{"role": "user", "content": s.turns[0].user}]
    for turn, answer in zip(s.turns[1:], answers, strict=True):
        ids = tokenizer(answer, add_special_tokens=False)["input_ids"]
        grown = next_prompt(prompt, ids, turn)
        assert grown[: len(prompt) + len(ids)] == prompt + ids  # grows by the previous answer
        messages += [
            {"role": "assistant", "content": answer},
            {"role": "user", "content": turn.user},
        ]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert grown == tokenizer(text, add_special_tokens=False)["input_ids"]
        prompt = grown
    assert s.turns[1].user != s.turns[2].user


def test_workload_file_round_trip_and_refusals(tokenizer, tmp_path):
    wl = multiturn(tokenizer, sessions=2, turns=2, seed=1, first_prompt_tokens=64)
    path = tmp_path / "mt.json"
    write_multiturn(wl, path)
    assert load_multiturn(path) == wl
    path.write_text(json.dumps({"format": "chat-workload/v1", "sessions": []}))
    with pytest.raises(BatonError, match="multiturn-workload/v1"):
        load_multiturn(path)
    with pytest.raises(BatonError, match="sessions >= 1"):
        multiturn(tokenizer, sessions=0)


def run_bench(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, dict[str, Any]]:
    code = baton_main(["bench", "multiturn", "--json", *argv])
    return code, json.loads(capsys.readouterr().out.strip().splitlines()[-1])


#: A pool of at most 13 blocks (16 tokens of 3 layers x 2 KV heads x 16 x fp32: 12KiB each): one
#: tiny-model conversation of ~130 tokens fits, the four sessions' do not.
TIGHT = "cache.kv_cache_memory=160KiB"


def test_bench_reports_turns_and_counts_cached_tokens(tmp_path, capsys):
    """A roomy pool serves a returning turn's whole conversation so far from the prefix cache;
    a pool smaller than the sessions need (side B) serves less; same greedy tokens both ways."""
    saved = tmp_path / "wl.json"
    argv = ["--model", str(tiny_model("llama")), "--sessions", "4", "--turns", "3"]
    argv += ["--first-prompt-tokens", "64", "--max-new-tokens", "8", "--per-request"]
    argv += ["--compare", TIGHT, "--save-workload", str(saved)]
    code, res = run_bench(argv, capsys)
    assert code == 0, res
    assert res["bench"] == "multiturn" and res["concurrency"] == 1
    assert res["workload_summary"]["turns"] == 12
    assert load_multiturn(saved).summary == res["workload_summary"]
    a, b = res["sides"]["A"], res["sides"]["B"]
    assert a["settings"] == [] and b["settings"] == [TIGHT]
    for side in (a, b):
        (run,) = side["runs"]
        assert run["requests"] == 12 and run["output_tokens"] == 12 * 8
        assert run["expected_tokens_ok"] and run["tok_per_s"] > 0
        assert run["tok_per_cpu_s"] > 0 and run["cpu"]["self_cpu_s"] > 0
        assert [t["turn"] for t in run["turns"]] == [1, 2, 3]
        for fig in (*run["turns"], run["returning"]):
            assert set(fig) == {
                "requests",
                "prompt_tokens",
                "cached_tokens",
                "cached_frac",
                "ttft_s",
            } | ({"turn"} if "turn" in fig else set())
            assert 0 < fig["ttft_s"]["p50"] <= fig["ttft_s"]["p90"]
        assert run["returning"]["requests"] == 8
        med = side["medians"]
        assert med["runs"] == 1 and med["digests"] == [run["outputs_sha256_16"]]
    assert b["runs"][0]["kv_blocks"] <= 13 < a["runs"][0]["kv_blocks"]

    # side A (roomy): a returning turn's cached tokens cover the previous prompt's full blocks
    by_turn = {(r["session"], r["turn"]): r for r in res["per_request"]["A"]}
    assert len(by_turn) == 12
    for (session, turn), r in by_turn.items():
        assert 0 <= r["cached_tokens"] < r["prompt_tokens"]
        assert r["expected_tokens"] == r["output_tokens"] == 8
        if turn > 1:
            prev = by_turn[session, turn - 1]
            assert r["prompt_tokens"] > prev["prompt_tokens"] + prev["output_tokens"]
            assert r["cached_tokens"] >= prev["prompt_tokens"] // 16 * 16
    roomy, tight = a["medians"], b["medians"]
    assert roomy["returning_cached_frac"] > 0.5 > tight["returning_cached_frac"]
    assert sum(r["cached_tokens"] for r in res["per_request"]["A"]) == sum(
        t["cached_tokens"] for t in a["runs"][0]["turns"]
    )
    assert res["b_over_a"]["same_outputs"] is True  # the prefix cache is exact
    assert res["b_over_a"]["returning_ttft_p50"] > 0
    text = table(res)  # without --json
    assert f"side B: {TIGHT}" in text and "turn 2+: TTFT p50" in text and "B / A: " in text


def test_bench_with_the_offload_connector_serves_returning_turns_from_ram(capsys):
    """The pool too small for the sessions, with and without ``kv_transfer.connector=offload``:
    the connector's RAM tier serves the returning turns (counted as cached, and in the run's
    ``kv_transfer`` figures), the same greedy tokens."""
    argv = ["--model", str(tiny_model("llama")), "--sessions", "4", "--turns", "2"]
    argv += ["--first-prompt-tokens", "64", "--max-new-tokens", "8", "--set", TIGHT]
    argv += ["--compare", "kv_transfer.connector=offload"]
    code, res = run_bench(argv, capsys)
    assert code == 0, res
    (off,), (on,) = res["sides"]["A"]["runs"], res["sides"]["B"]["runs"]
    assert "kv_transfer" not in off and on["kv_transfer"]["hit_tokens"]["CPU"] > 0
    assert on["kv_transfer"]["save_bytes"] > 0 and on["kv_transfer"]["load_bytes"] > 0
    assert on["returning"]["cached_tokens"] > off["returning"]["cached_tokens"]
    # turn 1 of a session: only the chat template's system prompt ran before
    assert on["turns"][0]["cached_frac"] < 0.5
    assert on["returning"]["cached_frac"] > 0.5
    assert res["b_over_a"]["same_outputs"] is True
