"""The structured-output seam end to end with xgrammar and the fake executor (no model).

The fake executor samples the first token its grammar bitmask allows at or
after its own deterministic choice, so the grammar alone shapes the output and
unconstrained requests give the same tokens whatever shares their batch.
"""

from __future__ import annotations

import json
import re
import threading
import time

import jsonschema
import msgspec
import pytest

from baton.config import BatonConfig
from baton.engine.core import EngineCore
from baton.protocol import EngineCoreRequest, FinishReason, ModelInfo
from baton.sampling_params import SamplingParams, StructuredOutputSpec
from baton.testing import FakeExecutor

VOCAB = 49152
EOS = 2  # SmolLM2's <|im_end|>: the tokenizer's EOS, which xgrammar ends a grammar with
REGEX = r"(cat|dog)s? [0-9]{2}"
CHOICES = ["red", "green", "blue"]
# bounded (enums, integer ranges, whitespace limit) so the fake's arbitrary tokens still finish
SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "inner": {"type": "object", "properties": {"c": {"enum": ["x", "y"]}}, "required": ["c"]},
    },
    "required": ["ok", "n", "inner"],
}


@pytest.fixture
def info(default_model_dir) -> ModelInfo:
    return ModelInfo(
        path=str(default_model_dir),
        architecture="Fake",
        vocab_size=VOCAB,
        max_model_len=1024,
        eos_token_ids=[EOS],
    )


def make_core(
    info: ModelInfo, max_concurrent_batches: int = 1, num_blocks: int = 1024, **overrides
) -> EngineCore:
    overrides.setdefault(
        "structured_output", {"backend": "xgrammar", "xgrammar": {"max_whitespace_cnt": 2}}
    )
    config = BatonConfig.load(max_model_len=1024, **overrides)
    fake = FakeExecutor(
        block_size=config.cache.block_size,
        vocab_size=VOCAB,
        eos_token_id=EOS,
        num_blocks=num_blocks,
        max_concurrent_batches=max_concurrent_batches,
        latency_s=0.001 if max_concurrent_batches > 1 else 0.0,
    )
    return EngineCore(config, executor=fake, info=info)


def req(
    rid: str, spec: StructuredOutputSpec | None = None, n_prompt: int = 12, max_tokens: int = 40
) -> EngineCoreRequest:
    return EngineCoreRequest(
        request_id=rid,
        prompt_token_ids=[
            (97 * i + 13 * len(rid) + ord(rid[-1])) % 40000 + 100 for i in range(n_prompt)
        ],
        sampling_params=SamplingParams(
            temperature=0, max_tokens=max_tokens, structured_outputs=spec
        ),
        eos_token_id=EOS,
    )


def run(
    core: EngineCore, timeout: float = 60.0
) -> dict[str, tuple[list[int], FinishReason, str | None]]:
    tokens: dict[str, list[int]] = {}
    done: dict[str, tuple[list[int], FinishReason, str | None]] = {}
    deadline = time.monotonic() + timeout
    while core.has_work():
        assert time.monotonic() < deadline, "the engine did not finish"
        outs, _ = core.step_fn()
        for o in outs.outputs if outs else ():
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finish_reason is not None:
                done[o.request_id] = (tokens[o.request_id], o.finish_reason, o.error)
    core.shutdown()
    return done


def text_of(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode([t for t in ids if t != EOS])


@pytest.mark.parametrize("batch_queue", [1, 2], ids=["step", "batch-queue"])
def test_constrained_outputs_match_their_specs(info, tokenizer, batch_queue):
    core = make_core(info, max_concurrent_batches=batch_queue)
    specs = {
        "regex": StructuredOutputSpec(regex=REGEX),
        "choice": StructuredOutputSpec(choice=CHOICES),
        "json": StructuredOutputSpec(json=SCHEMA),
        "ebnf": StructuredOutputSpec(grammar='root ::= "<" [a-c] [a-c]? [a-c]? ">"'),
    }
    for name, spec in specs.items():
        for k in range(3):
            core.add_request(req(f"{name}{k}", spec, n_prompt=8 + 5 * k, max_tokens=200))
    done = run(core)
    assert len(done) == 12
    for rid, (ids, reason, error) in done.items():
        assert reason == FinishReason.STOP and error is None, (
            rid,
            reason,
            error,
            text_of(tokenizer, ids),
        )
        assert ids[-1] == EOS
        text = text_of(tokenizer, ids)
        if rid.startswith("regex"):
            assert re.fullmatch(REGEX, text), text
        elif rid.startswith("choice"):
            assert text in CHOICES
        elif rid.startswith("json"):
            jsonschema.validate(json.loads(text), SCHEMA)
        else:
            assert re.fullmatch(r"<[a-c]{1,3}>", text), text


@pytest.mark.parametrize("batch_queue", [1, 2], ids=["step", "batch-queue"])
def test_unconstrained_requests_are_untouched_by_constrained_neighbours(info, batch_queue):
    alone = make_core(info, max_concurrent_batches=batch_queue)
    mixed = make_core(info, max_concurrent_batches=batch_queue)
    for i in range(4):
        alone.add_request(req(f"u{i}", n_prompt=10 + 7 * i))
        mixed.add_request(req(f"u{i}", n_prompt=10 + 7 * i))
        mixed.add_request(req(f"c{i}", StructuredOutputSpec(regex=REGEX), n_prompt=9 + 7 * i))
    expected = run(alone)
    got = run(mixed)
    assert {k: v for k, v in got.items() if k.startswith("u")} == expected
    assert all(got[f"c{i}"][1] == FinishReason.STOP for i in range(4))


def test_a_spec_that_fails_to_compile_fails_only_its_request(info):
    core = make_core(info)
    core.add_request(req("good", StructuredOutputSpec(regex=REGEX)))
    core.add_request(req("bad", StructuredOutputSpec(regex="(unclosed")))
    core.add_request(req("plain"))
    core.add_request(req("bad-ebnf", StructuredOutputSpec(grammar="root ::= nowhere")))
    done = run(core)
    assert done["bad"][1] == FinishReason.ERROR and done["bad"][0] == []
    assert "StructuredOutputError" in done["bad"][2] and "regex" in done["bad"][2], done["bad"][2]
    assert done["bad-ebnf"][1] == FinishReason.ERROR and "nowhere" in done["bad-ebnf"][2]
    assert done["good"][1] == FinishReason.STOP and done["plain"][1] == FinishReason.LENGTH


def test_a_failed_spec_is_not_cached(info):
    core = make_core(info)
    core.add_request(req("bad1", StructuredOutputSpec(regex="[z-a]")))
    first = run(core)
    core = make_core(info)
    core.add_request(req("bad2", StructuredOutputSpec(regex="[z-a]")))
    assert first["bad1"][1] == run(core)["bad2"][1] == FinishReason.ERROR


def test_one_compile_per_spec(info):
    core = make_core(info)
    backend = core.structured_output.backend
    calls: list[str] = []
    lock = threading.Lock()
    compile_ = backend.compile

    def counting(spec):
        with lock:
            calls.append(spec.kind)
        return compile_(spec)

    backend.compile = counting
    for i in range(6):
        core.add_request(req(f"r{i}", StructuredOutputSpec(choice=CHOICES)))
    core.add_request(req("j", StructuredOutputSpec(json=SCHEMA)))
    done = run(core)
    assert sorted(calls) == ["choice", "json"]
    assert all(d[1] == FinishReason.STOP for d in done.values())


def test_preemption_and_recompute_keep_the_grammar_in_step(info, tokenizer):
    """Tight KV memory preempts constrained requests; their outputs equal a roomy run's."""
    small = msgspec.structs.replace(info, max_model_len=128)

    def go(num_blocks: int) -> tuple[dict, int]:
        core = make_core(
            small, num_blocks=num_blocks, max_num_seqs=8, observability={"log_stats": False}
        )
        for i in range(8):
            core.add_request(
                req(f"r{i}", StructuredOutputSpec(json=SCHEMA), n_prompt=6 + i, max_tokens=100)
            )
        out = run(core)
        return out, core.scheduler.make_stats().num_preemptions

    roomy, none = go(1024)
    tight, preemptions = go(12)
    assert none == 0 and preemptions > 0
    assert tight == roomy
    for ids, reason, _ in tight.values():
        assert reason == FinishReason.STOP
        jsonschema.validate(json.loads(text_of(tokenizer, ids)), SCHEMA)


def test_abort_while_the_grammar_compiles(info):
    core = make_core(info)
    core.add_request(req("a", StructuredOutputSpec(json=SCHEMA)))
    core.add_request(req("b", StructuredOutputSpec(regex=REGEX)))
    core.abort_requests(["a"])
    done = run(core)
    assert set(done) == {"b"} and done["b"][1] == FinishReason.STOP


def test_a_backend_that_cannot_start_fails_each_request_clearly(info):
    broken = ModelInfo(
        path="/nonexistent/model",
        architecture="Fake",
        vocab_size=VOCAB,
        max_model_len=1024,
        eos_token_ids=[EOS],
    )
    core = make_core(broken)
    core.add_request(req("x", StructuredOutputSpec(regex=REGEX)))
    core.add_request(req("y", StructuredOutputSpec(choice=CHOICES)))
    core.add_request(req("plain", max_tokens=3))
    done = run(core)
    for rid in ("x", "y"):
        assert done[rid][1] == FinishReason.ERROR
        assert "backend 'xgrammar' failed to start" in done[rid][2] and "tokenizer" in done[rid][2]
    assert done["plain"][1] == FinishReason.LENGTH


@pytest.mark.parametrize("setting", ["none", "auto-without-plugins"])
def test_no_backend_names_the_plugin_to_install(info, setting):
    from baton.errors import StructuredOutputError
    from baton.plugins.registry import Plugins

    if setting == "none":
        core = make_core(info, structured_output="none")
        expected = "structured_output.backend = 'none'"
    else:  # a registry with the built-ins only: as if baton-plugin-xgrammar were not installed
        config = BatonConfig.load(max_model_len=1024)
        fake = FakeExecutor(block_size=config.cache.block_size, vocab_size=VOCAB)
        plugins = Plugins()
        plugins.load_entry_points({"BATON_DISABLE_PLUGIN_AUTOLOAD": "1"})
        core = EngineCore(config, executor=fake, info=info, registry=plugins.registry)
        expected = "no structured-output backend is installed"
    with pytest.raises(StructuredOutputError, match="pip install baton-plugin-xgrammar") as e:
        core.add_request(req("j", StructuredOutputSpec(regex=REGEX)))
    assert expected in str(e.value)
    core.add_request(req("plain", max_tokens=2))
    assert run(core)["plain"][1] == FinishReason.LENGTH
