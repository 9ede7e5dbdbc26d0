"""Config sections plugins register (``register_config_sections``): a plugin's own top-level
table is validated as baton-core's sections are (file, ``BATON_*`` variables with JSON lists and
tables, dotted keys, short keywords), refused values carry their path, a check across sections
runs, the config pickles to another process, and ``baton config check`` reports its problems."""

from __future__ import annotations

import pickle
import subprocess
import sys

import pytest
from pydantic import BaseModel, ConfigDict, Field

from baton import hookimpl
from baton.cli.main import main
from baton.config import BatonConfig, ServingSettings
from baton.errors import ConfigError, PluginLoadError
from baton.plugins.registry import Plugins, get_registry


class WebhookSection(BaseModel):
    """A plugin's section, as the docs/hooks.md example."""

    model_config = ConfigDict(extra="allow")

    webhook_url: str | None = None
    timeout_s: float = Field(5.0, gt=0)
    headers: dict[str, str] = Field(default_factory=dict)
    retry_codes: list[int] = Field(default_factory=list)

    def check_config(self, config: BatonConfig) -> None:
        if self.webhook_url is not None and not config.observability.log_stats:
            raise ValueError("webhook.webhook_url needs observability.log_stats = true")


class WebhookPlugin:
    @hookimpl
    def register_config_sections(self, register):
        register("webhook", WebhookSection)


@pytest.fixture
def webhook(global_plugin):
    global_plugin(WebhookPlugin(), "webhook-section")
    yield


def test_hook_register_config_sections(webhook, monkeypatch):
    monkeypatch.setenv("BATON_WEBHOOK__HEADERS", '{"x-team": "a"}')
    monkeypatch.setenv("BATON_WEBHOOK__RETRY_CODES", "[502, 503]")
    monkeypatch.setenv("BATON_WEBHOOK__TIMEOUT_S", "2.5")
    entry = get_registry().get("config_section", "webhook")
    assert (entry.distribution, entry.factory) == ("hook-test-dist", WebhookSection)
    config = BatonConfig.load(webhook_url="http://127.0.0.1:9/hook", **{"webhook.timeout_s": 1})
    section = config.webhook
    assert isinstance(section, WebhookSection)
    assert section.webhook_url == "http://127.0.0.1:9/hook"  # a short keyword: its unique field
    assert section.timeout_s == 1  # an explicit value over the environment
    assert (section.headers, section.retry_codes) == ({"x-team": "a"}, [502, 503])  # JSON
    again = pickle.loads(pickle.dumps(config))  # as it travels to engine processes
    assert again.webhook == section and again.model_dump() == config.model_dump()
    assert config.replace(timeout_s=3).webhook.timeout_s == 3


def test_an_absent_section_has_its_defaults_and_a_file_sets_it(webhook, tmp_path):
    assert BatonConfig.load().webhook == WebhookSection()
    toml = tmp_path / "baton.toml"
    toml.write_text("[webhook]\nretry_codes = [500]\n[cache]\nblock_size = 32\n")
    config = BatonConfig.load(toml)
    assert (config.webhook.retry_codes, config.cache.block_size) == ([500], 32)


def test_refused_values_name_their_path_with_the_cores(webhook):
    with pytest.raises(ConfigError) as err:
        BatonConfig.load(timeout_s=0, max_num_seqs=0, **{"webhook.retry_codes": ["x"]})
    text = str(err.value)
    assert "scheduler.max_num_seqs: Input should be greater than 0 (got 0)" in text
    assert "webhook.timeout_s: Input should be greater than 0 (got 0)" in text
    assert "webhook.retry_codes.0: Input should be a valid integer" in text


def test_the_sections_check_across_sections_runs(webhook):
    with pytest.raises(ConfigError, match=r"webhook\.webhook_url needs observability\.log_stats"):
        BatonConfig.load(webhook_url="http://127.0.0.1:9", log_stats=False)
    assert BatonConfig.load(webhook_url="http://127.0.0.1:9").webhook.webhook_url


def test_a_top_level_key_no_section_owns_is_refused(webhook, tmp_path):
    toml = tmp_path / "baton.toml"
    toml.write_text("[webhok]\ntimeout_s = 1\n")
    with pytest.raises(ConfigError, match="webhok"):
        BatonConfig.load(toml)
    with pytest.raises(ConfigError, match=r"unknown section 'webhok' \(sections: .*webhook"):
        BatonConfig.load(**{"webhok.timeout_s": 1})


def test_config_check_reports_a_plugin_sections_problems(webhook, tmp_path, capsys):
    toml = tmp_path / "baton.toml"
    toml.write_text("[webhook]\ntimeout_s = -1\ntypo = 1\n")
    assert main(["config", "check", str(toml), "--policy", "nope"]) == 1
    err = capsys.readouterr().err
    # the refused value is put back to its default and the plugins are still checked
    assert "webhook.timeout_s: Input should be greater than 0 (got -1)" in err
    assert "webhook.typo: unknown setting" in err
    assert "scheduler policy 'nope' is not installed" in err
    toml.write_text("[webhook]\ntypo = 1\n")
    assert main(["config", "check", str(toml)]) == 1
    assert (
        "webhook.typo: unknown setting (fields: webhook_url, timeout_s" in capsys.readouterr().err
    )


@pytest.mark.parametrize(
    ("name", "model", "fragment"),
    [
        ("cache", WebhookSection, "config section 'cache' is baton-core's"),
        ("web hook", WebhookSection, "not an identifier"),
        ("webhook", dict, "must be a pydantic BaseModel subclass"),
    ],
)
def test_a_core_name_or_a_non_model_is_refused(name, model, fragment):
    class Plugin:
        @hookimpl
        def register_config_sections(self, register):
            register(name, model)

    plugins = Plugins()
    plugins.load_entry_points({})
    plugins.register(Plugin(), "bad-section", "bad-dist", "0")
    with pytest.raises(PluginLoadError, match=fragment):
        _ = plugins.registry


def test_without_a_serving_plugin_the_kernel_reads_the_librarys_defaults():
    code = (
        "from baton.config import BatonConfig, ServingSettings\n"
        "c = BatonConfig.load()\n"
        "assert c.serving == ServingSettings(), c.serving\n"
        "assert not hasattr(c, 'server')\n"
        "print('ok')\n"
    )
    env = {"BATON_DISABLE_PLUGIN_AUTOLOAD": "1", "PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.stdout.strip() == "ok", out.stderr
    assert ServingSettings().shutdown_timeout == 0.0
