"""The request check runs once per boundary: one call per prompt in the frontend, one per
request in the engine core, and every prompt-length check has validation's one boundary and
message (the scheduler's admission included)."""

from __future__ import annotations

import pytest

from baton import LLM, SamplingParams, validation
from baton.errors import ContextLengthError, InvalidRequestError
from baton.plugins.registry import PluginEntry
from baton.testing.tiny_model import tiny_model

from .sched_helpers import make_request, make_scheduler


def _counting(monkeypatch, module: str, name: str) -> list[int]:
    import importlib

    mod = importlib.import_module(module)
    real, calls = getattr(mod, name), []

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(mod, name, counted)
    return calls


def test_the_frontend_checks_each_prompt_once_and_the_engine_each_request_once(monkeypatch):
    frontend = _counting(monkeypatch, "baton.frontend.prompts", "check_request")
    engine = _counting(monkeypatch, "baton.engine.core", "check_engine_request")
    with LLM(model=str(tiny_model("llama")), max_model_len=128) as llm:
        outs = llm.generate([[1, 2, 3], [4, 5]], SamplingParams(n=2, max_tokens=2), use_tqdm=False)
    assert [len(o.outputs) for o in outs] == [2, 2]
    assert len(frontend) == 2  # one per prompt, not again per child nor in process()
    assert len(engine) == 4  # one per request the engine core receives (n=2 children each)


def test_the_config_is_resolved_once_and_each_plugins_settings_validated_once(monkeypatch):
    """The sync LLM on the inproc transport: one resolve (the start-up check) whose record
    builds the transport, the stat loggers and the engine core's executor and policy."""
    resolves = _counting(monkeypatch, "baton.plugins.resolve", "find_chosen_plugins")
    real_settings, validated = PluginEntry.settings, []

    def settings(entry, config):
        validated.append((entry.kind, entry.name))
        return real_settings(entry, config)

    monkeypatch.setattr(PluginEntry, "settings", settings)
    with LLM(model=str(tiny_model("llama")), max_model_len=128) as llm:
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)
        chosen = [(c.entry.kind, c.name) for c in llm.plugins.chosen]
    assert len(resolves) == 1
    assert {"executor", "scheduler_policy", "transport"} <= {kind for kind, _ in chosen}
    assert validated == chosen  # each selected plugin's settings once, none looked up again


@pytest.mark.parametrize("max_model_len", [16, 64])
def test_the_schedulers_admission_has_the_frontends_boundary_and_message(max_model_len):
    sched = make_scheduler(max_model_len=max_model_len)
    sched.add_request(make_request("fits", max_model_len - 1, max_tokens=1))
    with pytest.raises(ContextLengthError) as at_scheduler:
        sched.add_request(make_request("full", max_model_len, max_tokens=1))
    with pytest.raises(ContextLengthError) as at_frontend:
        validation.check_context_length(max_model_len, 1, max_model_len)
    assert str(at_scheduler.value) == str(at_frontend.value)
    assert at_scheduler.value.param == "prompt"


def test_an_empty_prompt_has_one_message_everywhere():
    with pytest.raises(InvalidRequestError) as at_scheduler:
        make_scheduler().add_request(make_request("empty", [], max_tokens=1))
    with pytest.raises(InvalidRequestError) as at_check:
        validation.check_prompt_token_ids([], 100)
        validation.check_context_length(0, 1, 100)
    assert (
        str(at_scheduler.value)
        == str(at_check.value)
        == "the prompt is empty: give at least one token"
    )
    assert at_scheduler.value.param == at_check.value.param == "prompt"
