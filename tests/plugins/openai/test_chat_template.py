"""server.chat_template (`baton serve --chat-template`): the server's own template, from a file
or inline, used instead of the tokenizer's; a path with no file is refused at start-up."""

from __future__ import annotations

import argparse
import asyncio

import pytest

from baton.config import BatonConfig
from baton.errors import ConfigError
from baton_openai.cli import add_serve_arguments, serve_overrides
from baton_openai.http.server import OpenAIServer
from baton_openai.templates.chat_template import load_chat_template

from .conftest import running_server

TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<bot>"
#: renders tools itself (the tokenizer's template does not): chat and /tokenize must both see it
TOOLS_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if tools %}<tools {{ tools | length }}>{% endif %}<bot>"
)
TOOL = {"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}


def test_a_template_file_replaces_the_tokenizers(model_dir, tmp_path):
    path = tmp_path / "chat.jinja"
    path.write_text(TEMPLATE)
    with running_server(model_dir, **{"server.chat_template": str(path)}) as srv:
        r = srv.client().chat.completions.create(
            model=srv.model, messages=[{"role": "user", "content": "Hi there"}], max_tokens=1
        )
        tokenizer = srv.server.engine.tokenizer
        rendered = "<user>Hi there\n<bot>"
        assert r.usage.prompt_tokens == len(tokenizer.encode(rendered, add_special_tokens=False))
        default = tokenizer.apply_chat_template(
            [{"role": "user", "content": "Hi there"}], add_generation_prompt=True, tokenize=True
        )
        assert r.usage.prompt_tokens != len(default)  # the tokenizer's own template differs


def test_inline_text_is_the_template_and_a_bare_name_a_path(tmp_path):
    assert load_chat_template(TEMPLATE) == TEMPLATE
    assert load_chat_template(None) is None
    (tmp_path / "t.jinja").write_text("{{ messages }}")
    assert load_chat_template(str(tmp_path / "t.jinja")) == "{{ messages }}"
    with pytest.raises(ConfigError, match=r"no-such\.jinja"):
        load_chat_template(str(tmp_path / "no-such.jinja"))


def test_a_missing_template_file_stops_the_server_before_the_model_loads(tmp_path):
    missing = str(tmp_path / "missing.jinja")
    # a model that does not exist: reaching the model would be a different error
    config = BatonConfig.load(model=str(tmp_path / "no-model"), **{"server.chat_template": missing})
    with pytest.raises(ConfigError, match=r"server\.chat_template"):
        asyncio.run(OpenAIServer(config).run())


def test_the_serve_flag_sets_the_setting():
    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    args = p.parse_args(["--chat-template", "chat.jinja"])
    assert serve_overrides(args)["server.chat_template"] == "chat.jinja"


def test_tokenize_renders_with_the_server_template_as_chat_does(model_dir):
    import httpx

    messages = [{"role": "user", "content": "What time is it?"}]
    with running_server(model_dir, **{"server.chat_template": TOOLS_TEMPLATE}) as srv:
        r = srv.client().chat.completions.create(
            model=srv.model, messages=messages, tools=[TOOL], max_tokens=1
        )
        count = httpx.post(
            f"{srv.url}/tokenize",
            json={"model": srv.model, "messages": messages, "tools": [TOOL]},
            timeout=30,
        ).json()["count"]
        rendered = "<user>What time is it?\n<tools 1><bot>"  # tools rendered by the template
        tokenizer = srv.server.engine.tokenizer
        assert r.usage.prompt_tokens == count
        assert count == len(tokenizer.encode(rendered, add_special_tokens=False))
