"""``[server]`` is baton-plugin-openai's section (registered with ``register_config_sections``):
the same keys, variables, short keywords and refusals as when baton-core held it, and the values
the kernel reads reach it as ``config.serving``."""

from __future__ import annotations

import pytest

import baton.config
from baton.config import BatonConfig, ServingSettings
from baton.errors import ConfigError
from baton.plugins.registry import get_registry
from baton_openai.http.server import DEFAULT_SHUTDOWN_TIMEOUT_S, prepare_config
from baton_openai.server_section import ServerSection


def test_the_plugin_registers_server():
    entry = get_registry().get("config_section", "server")
    assert (entry.factory, entry.distribution) == (ServerSection, "baton-plugin-openai")
    assert type(BatonConfig.load().server) is ServerSection


def test_env_json_short_keywords_and_refusals_as_before(monkeypatch):
    monkeypatch.setenv("BATON_SERVER__CORS_ORIGINS", '["https://app.example.com"]')
    monkeypatch.setenv("BATON_SERVER__LORA_MODULES", '{"sql": "/adapters/sql"}')
    c = BatonConfig.load(port=8123, api_key="k", enable_lora=True)
    assert (c.server.port, c.server.api_key) == (8123, "k")
    assert c.server.cors_origins == ["https://app.example.com"]
    assert c.server.lora_modules == {"sql": "/adapters/sql"}
    with pytest.raises(ConfigError, match=r"server\.api_key: Value error, an empty or blank"):
        BatonConfig.load(api_key=" ")


def test_the_kernel_reads_config_serving():
    c = BatonConfig.load(served_model_name="m", shutdown_timeout=4.5)
    assert c.serving == ServingSettings(shutdown_timeout=4.5, served_model_name="m")
    assert BatonConfig.load().serving == ServingSettings()  # the library's: abort at once
    # baton serve drains by default: the engine reads it through config.serving
    assert prepare_config(BatonConfig.load()).serving.shutdown_timeout == DEFAULT_SHUTDOWN_TIMEOUT_S


def test_the_old_public_path_warns_and_gives_the_plugins_class():
    with pytest.warns(DeprecationWarning, match="baton_openai.server_section.ServerSection"):
        assert baton.config.ServerSection is ServerSection
    with pytest.raises(AttributeError):
        _ = baton.config.NoSuchSection
