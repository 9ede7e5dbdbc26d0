"""The plugin framework: discovery through real entry points, lookup errors, duplicates, hygiene."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from baton import hookimpl
from baton.config import BatonConfig
from baton.errors import (
    ConfigError,
    DuplicatePluginError,
    PluginError,
    PluginLoadError,
    PluginNotFoundError,
)
from baton.plugins.check import check_config_plugins
from baton.plugins.registry import Plugins, reset_plugins

from .plugin_fixtures import add_to_path, make_dist

POLICY_PLUGIN = """
from pydantic import BaseModel
from baton import hookimpl
from baton.sched.policies import FCFSPolicy

class Settings(BaseModel):
    weight: int = 1

class LIFOPolicy(FCFSPolicy):
    def __init__(self, config, settings):
        super().__init__(config, None)
        self.settings = settings

@hookimpl
def register_scheduler_policies(register):
    register("lifo-test", LIFOPolicy, settings_model=Settings)
"""


@pytest.fixture
def plugin_path(tmp_path, monkeypatch):
    saved = list(sys.path)
    yield tmp_path
    sys.path[:] = saved
    # building a config loads the process-wide registry (its plugins' config sections): forget
    # the plugins it saw on this path, as later tests' engine processes will not see them
    reset_plugins()
    for mod in [m for m in sys.modules if m.startswith("extplug")]:
        del sys.modules[mod]


def loaded(environ: dict[str, str] | None = None) -> Plugins:
    plugins = Plugins()
    plugins.load_entry_points(environ if environ is not None else {})
    return plugins


def test_builtins_come_through_entry_points():
    reg = loaded().registry
    for kind, name in [
        ("scheduler_policy", "fcfs"),
        ("scheduler_policy", "priority"),
        ("transport", "inproc"),
    ]:
        entry = reg.get(kind, name)
        assert entry.distribution == "baton-core"
        assert entry.version


def test_external_plugin_is_discovered_and_selectable_from_toml(plugin_path, tmp_path):
    make_dist(plugin_path / "site", "extplug-lifo", "extplug_lifo", POLICY_PLUGIN)
    add_to_path(plugin_path / "site")
    plugins = loaded()
    entry = plugins.registry.get("scheduler_policy", "lifo-test")
    assert (entry.distribution, entry.version) == ("extplug-lifo", "0.1.0")
    toml = tmp_path / "baton.toml"
    toml.write_text('[scheduler]\npolicy = "lifo-test"\n[scheduler.lifo-test]\nweight = 3\n')
    config = BatonConfig.load(toml)
    check_config_plugins(config, plugins.registry)
    settings = config.plugin_settings("scheduler", "lifo-test", entry.settings_model)
    policy = entry.create(config, settings)
    assert policy.settings.weight == 3


def test_plugin_settings_are_validated_with_the_field_path(plugin_path, tmp_path):
    make_dist(plugin_path / "site", "extplug-lifo", "extplug_lifo", POLICY_PLUGIN)
    add_to_path(plugin_path / "site")
    entry = loaded().registry.get("scheduler_policy", "lifo-test")
    toml = tmp_path / "baton.toml"
    toml.write_text('[scheduler]\npolicy = "lifo-test"\n[scheduler.lifo-test]\nweight = "heavy"\n')
    config = BatonConfig.load(toml)
    with pytest.raises(ConfigError, match=r"scheduler\.lifo-test\.weight.*'heavy'"):
        config.plugin_settings("scheduler", "lifo-test", entry.settings_model)


def test_missing_plugin_names_what_is_installed_and_what_to_install():
    reg = loaded().registry
    with pytest.raises(PluginNotFoundError) as err:
        reg.get("transport", "carrier-pigeon")
    assert "transport 'carrier-pigeon' is not installed (installed: " in str(err.value)
    assert "inproc" in str(err.value)
    if "zmq" not in reg.names("transport"):
        with pytest.raises(PluginNotFoundError, match=r"pip install baton-plugin-zmq"):
            reg.get("transport", "zmq")


def test_config_naming_a_missing_plugin_fails_at_start_up():
    config = BatonConfig.load(policy="no-such-policy")
    with pytest.raises(
        PluginNotFoundError, match="scheduler policy 'no-such-policy' is not installed"
    ):
        check_config_plugins(config, loaded().registry)


def test_unknown_sub_table_is_refused(tmp_path):
    toml = tmp_path / "baton.toml"
    toml.write_text("[transport.carrier]\nspeed = 3\n")
    with pytest.raises(ConfigError, match=r"transport\.carrier: unknown setting"):
        check_config_plugins(BatonConfig.load(toml), loaded().registry)


def test_duplicate_name_names_both_distributions(plugin_path):
    src = """
from baton import hookimpl
@hookimpl
def register_transports(register):
    register("inproc", object)
"""
    make_dist(plugin_path / "site", "extplug-dup", "extplug_dup", src)
    add_to_path(plugin_path / "site")
    with pytest.raises(DuplicatePluginError) as err:
        loaded().registry  # noqa: B018
    assert "baton-core" in str(err.value) and "extplug-dup" in str(err.value)


def test_plugin_that_fails_to_import_is_reported_by_name(plugin_path):
    make_dist(
        plugin_path / "site",
        "extplug-broken",
        "extplug_broken",
        "raise RuntimeError('boom at import')\n",
    )
    add_to_path(plugin_path / "site")
    reg = loaded().registry
    assert any(
        p == "extplug_broken" and d == "extplug-broken" and "boom at import" in r
        for p, d, r in reg.failed
    )
    assert reg.get("scheduler_policy", "fcfs")  # the others still load
    with pytest.raises(PluginNotFoundError, match="extplug_broken"):
        reg.get("transport", "nothing")


def test_plugin_raising_inside_a_hook_is_named(plugin_path):
    src = """
from baton import hookimpl
@hookimpl
def register_executors(register):
    raise ValueError("cannot register")
"""
    make_dist(plugin_path / "site", "extplug-raiser", "extplug_raiser", src)
    add_to_path(plugin_path / "site")
    with pytest.raises(
        PluginLoadError,
        match=r"plugin 'extplug_raiser' from extplug-raiser raised in register_executors",
    ):
        loaded().registry  # noqa: B018


def test_factory_failure_names_plugin_and_distribution():
    plugins = loaded()

    class Boom:
        @hookimpl
        def register_transports(self, register):
            def factory(config, settings):
                raise OSError("no sockets today")

            register("boom", factory)

    plugins.register(Boom(), "boom-plugin", "boom-dist", "9.9")
    with pytest.raises(
        PluginError,
        match=r"transport 'boom' \(plugin 'boom-plugin' from boom-dist 9.9\) failed to start",
    ):
        plugins.registry.get("transport", "boom").create(None, None)


def test_incompatible_api_version_is_refused(plugin_path):
    src = """
from baton import hookimpl
BATON_PLUGIN_API = 99
@hookimpl
def register_transports(register):
    register("future", object)
"""
    make_dist(plugin_path / "site", "extplug-future", "extplug_future", src)
    add_to_path(plugin_path / "site")
    reg = loaded().registry
    assert "future" not in reg.names("transport")
    assert any("plugin API [99]" in r for _, _, r in reg.failed)


def test_allowlist_and_autoload_switches(plugin_path):
    make_dist(plugin_path / "site", "extplug-lifo", "extplug_lifo", POLICY_PLUGIN)
    add_to_path(plugin_path / "site")
    assert "lifo-test" not in loaded({"BATON_DISABLE_PLUGIN_AUTOLOAD": "1"}).registry.names(
        "scheduler_policy"
    )
    assert "lifo-test" not in loaded({"BATON_PLUGINS": "something-else"}).registry.names(
        "scheduler_policy"
    )
    allowed = loaded({"BATON_PLUGINS": "extplug-lifo"}).registry
    assert "lifo-test" in allowed.names("scheduler_policy")
    assert "fcfs" in allowed.names("scheduler_policy")  # built-ins are essential


def test_trace_plugins_logs_hook_calls(caplog, monkeypatch):
    monkeypatch.setenv("BATON_TRACE_PLUGINS", "1")
    with caplog.at_level("WARNING", logger="baton.plugins"):
        loaded().registry  # noqa: B018
    assert any("register_scheduler_policies" in r.getMessage() for r in caplog.records)


def test_baton_plugins_json_lists_builtins_and_external(plugin_path):
    site = make_dist(plugin_path / "site", "extplug-lifo", "extplug_lifo", POLICY_PLUGIN)
    env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run(
        [sys.executable, "-m", "baton.cli.main", "plugins", "--json"],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    rows = json.loads(out.stdout)["plugins"]
    got = {(r["kind"], r["name"]): r for r in rows}
    for key in [
        ("scheduler_policy", "fcfs"),
        ("scheduler_policy", "priority"),
        ("transport", "inproc"),
    ]:
        assert got[key]["distribution"] == "baton-core" and got[key]["version"]
    assert got[("scheduler_policy", "lifo-test")]["distribution"] == "extplug-lifo"
    text = subprocess.run(
        [sys.executable, "-m", "baton.cli.main", "plugins"],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    assert "lifo-test" in text.stdout


def test_registry_fingerprint_is_stable():
    assert loaded().registry.fingerprint() == loaded().registry.fingerprint()


def test_env_prefix_does_not_leak_into_spawned_lookup(tmp_path: Path):
    # BATON_CONFIG pointing at a missing file is a clear error, not a crash
    with pytest.raises(ConfigError, match="does not exist"):
        BatonConfig.load(tmp_path / "nope.toml")
