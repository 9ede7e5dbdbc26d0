"""Plugin settings sub-tables, the dotted --set, and the one config check (check_config_plugins,
``baton config check``, and LLM refusing a bad config before anything loads)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest
from pydantic import BaseModel, ConfigDict, Field

from baton import hookimpl
from baton.cli.main import add_engine_arguments, engine_overrides, main
from baton.config import BatonConfig
from baton.errors import ConfigError, PluginError, PluginNotFoundError
from baton.plugins.check import check_config_plugins
from baton.plugins.registry import ChosenPlugin, PluginEntry, Plugins
from baton.plugins.resolve import resolve_plugins


class LaxSettings(BaseModel):
    """A plugin model that would take (and drop or keep) any extra key."""

    model_config = ConfigDict(extra="allow")
    deadline_ms: int = 100
    slack: float = 0.0


class NeedsSettings(BaseModel):
    url: str  # required: the plugin cannot run without its table


class _Plugin:
    @hookimpl
    def register_scheduler_policies(self, register):
        from baton.sched.policies import FCFSPolicy

        register("edf", FCFSPolicy, LaxSettings)
        register("remote", FCFSPolicy, NeedsSettings)


def registry():
    p = Plugins()
    p.load_entry_points({})
    p.register(_Plugin(), "edf-plugin", "baton-edf", "0.3")
    return p.registry


# --------------------------------------------------------------------------- settings tables


def test_an_unknown_key_is_refused_whatever_the_plugins_model_says():
    config = BatonConfig.load(**{"scheduler.edf.dealine_ms": "5"})
    with pytest.raises(ConfigError) as err:
        config.plugin_settings("scheduler", "edf", LaxSettings)
    msg = str(err.value)
    assert "scheduler.edf.dealine_ms" in msg  # the bad key
    assert "scheduler policy 'edf'" in msg  # the plugin
    assert "deadline_ms, slack" in msg  # the known keys


def test_known_keys_and_aliases_pass():
    class Aliased(BaseModel):
        model_config = ConfigDict(populate_by_name=True)
        max_wait: int = Field(1, alias="maxWait")

    config = BatonConfig.load(**{"scheduler.edf.deadline_ms": "5"})
    assert config.plugin_settings("scheduler", "edf", LaxSettings).deadline_ms == 5
    config = BatonConfig.load(**{"scheduler.edf.maxWait": 3})
    assert config.plugin_settings("scheduler", "edf", Aliased).max_wait == 3


def test_a_plugin_without_settings_refuses_a_table():
    config = BatonConfig.load(**{"transport.inproc.depth": 2})
    with pytest.raises(ConfigError, match=r"transport 'inproc' takes no settings, got 'depth'"):
        config.plugin_settings("transport", "inproc", None)


# --------------------------------------------------------------------------- dotted keys


def test_dotted_set_sets_a_key_of_the_sub_table(tmp_path):
    toml = tmp_path / "baton.toml"
    toml.write_text('[scheduler]\npolicy = "edf"\n[scheduler.edf]\nslack = 0.5\n')
    argv = ["--set", "scheduler.edf.deadline_ms=7", "--set", "scheduler.max_num_seqs=3"]
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    config = BatonConfig.load(toml, **engine_overrides(parser.parse_args(argv)))
    assert config.scheduler.model_extra == {"edf": {"slack": 0.5, "deadline_ms": "7"}}
    assert "edf.deadline_ms" not in config.scheduler.model_extra
    assert config.scheduler.max_num_seqs == 3
    settings = config.plugin_settings("scheduler", "edf", LaxSettings)
    assert (settings.deadline_ms, settings.slack) == (7, 0.5)
    again = config.replace(**{"scheduler.edf.slack": 1.5})  # merged, not replaced
    assert again.scheduler.model_extra["edf"] == {"slack": 1.5, "deadline_ms": "7"}


def test_a_dotted_key_cannot_go_through_a_setting():
    with pytest.raises(ConfigError, match=r"scheduler\.policy is a setting"):
        BatonConfig.load(**{"scheduler.policy": "fcfs", "scheduler.policy.x": 1})
    with pytest.raises(ConfigError, match="an empty name between dots"):
        BatonConfig.load(**{"scheduler..x": 1})


# --------------------------------------------------------------------------- the one check


def test_check_returns_the_selection_with_validated_settings():
    config = BatonConfig.load(policy="edf", **{"scheduler.edf.deadline_ms": 9})
    selected = {s.kind: s for s in check_config_plugins(config, registry())}
    edf = selected["scheduler_policy"]
    assert (edf.name, edf.distribution, edf.selected_by) == ("edf", "baton-edf", "scheduler.policy")
    assert edf.settings == {"deadline_ms": 9, "slack": 0.0}
    assert selected["executor"].name == "uniproc" and selected["executor"].settings is None


def test_check_lists_every_problem_at_once():
    config = BatonConfig.load(
        executor="no-such-executor",
        **{"scheduler.edf.x": 1, "cache.bogus": 2, "transport.carrier": {"speed": 3}},
    )
    with pytest.raises(PluginNotFoundError) as err:  # the type of the first problem
        check_config_plugins(config, registry())
    msg = str(err.value)
    assert msg.startswith("4 problems in the configuration:")
    for fragment in (
        "executor 'no-such-executor' is not installed",
        "scheduler.edf.x: unknown setting of scheduler policy 'edf'",  # not selected, still checked
        "cache.bogus: unknown setting",
        "transport.carrier: unknown setting",
    ):
        assert fragment in msg


def test_a_selected_plugin_whose_required_settings_are_missing_is_refused():
    with pytest.raises(ConfigError, match=r"scheduler\.remote\.url: Field required"):
        check_config_plugins(BatonConfig.load(policy="remote"), registry())
    config = BatonConfig.load(policy="remote", **{"scheduler.remote.url": "http://x"})
    assert check_config_plugins(config, registry())[0].settings == {"url": "http://x"}


def test_skip_leaves_a_kind_to_the_caller():
    config = BatonConfig.load(executor="no-such-executor")
    kinds = {s.kind for s in check_config_plugins(config, registry(), skip=frozenset({"executor"}))}
    assert "executor" not in kinds


def test_resolve_keeps_each_selected_entry_with_its_validated_settings():
    config = BatonConfig.load(
        policy="edf",
        **{"scheduler.edf.deadline_ms": 9, "observability.stat_loggers": ["logging", "logging"]},
    )
    plugins = resolve_plugins(config, registry())
    edf = plugins.one("scheduler_policy")
    assert (edf.name, edf.entry.distribution) == ("edf", "baton-edf")
    assert isinstance(edf.settings, LaxSettings) and edf.settings.deadline_ms == 9
    assert [c.name for c in plugins.all("stat_logger")] == ["logging", "logging"]
    assert plugins.find("speculator") is None  # speculative.method = "none"
    with pytest.raises(
        PluginError, match=r"no speculator was resolved \(the config selects none\)"
    ):
        plugins.one("speculator")


def test_resolve_refuses_what_the_check_refuses_and_honours_skip():
    config = BatonConfig.load(executor="no-such-executor", **{"scheduler.edf.x": 1})
    with pytest.raises(PluginNotFoundError) as resolved:
        resolve_plugins(config, registry())
    with pytest.raises(PluginNotFoundError) as checked:
        check_config_plugins(config, registry())
    assert str(resolved.value) == str(checked.value)
    config = BatonConfig.load(executor="no-such-executor")
    plugins = resolve_plugins(config, registry(), skip=frozenset({"executor"}))
    with pytest.raises(PluginError, match=r"no executor was resolved \(the caller supplies it\)"):
        plugins.one("executor")


def test_resolve_keeps_a_plugin_the_caller_resolved_without_validating_it_again(monkeypatch):
    """An engine process resolves its transport first (to report what fails next through it),
    then the rest with it: each selected plugin's settings are validated once."""
    config = BatonConfig.load(policy="edf", **{"scheduler.edf.deadline_ms": 9})
    reg = registry()
    entry = reg.get("transport", config.transport.name)
    transport = ChosenPlugin(entry, entry.settings(config))
    real_settings, validated = PluginEntry.settings, []

    def settings(entry, config):
        validated.append((entry.kind, entry.name))
        return real_settings(entry, config)

    monkeypatch.setattr(PluginEntry, "settings", settings)
    plugins = resolve_plugins(config, reg, given=(transport,))
    assert plugins.one("transport") is transport
    assert ("transport", transport.name) not in validated
    others = [(c.entry.kind, c.name) for c in plugins.chosen if c is not transport]
    assert validated == others  # each of the others once, in the record's order
    assert plugins.one("scheduler_policy").settings.deadline_ms == 9
    # what the caller resolved is not a way around the check: the others are still refused
    bad = BatonConfig.load(executor="no-such-executor")
    with pytest.raises(PluginNotFoundError):
        resolve_plugins(bad, reg, given=(transport,))


# --------------------------------------------------------------------------- the command


def test_config_check_prints_the_selection(tmp_path, capsys):
    toml = tmp_path / "baton.toml"
    toml.write_text('[scheduler]\npolicy = "priority"\n[transport]\nname = "inproc"\n')
    # a model that does not exist: nothing is loaded, so it does not matter
    assert main(["config", "check", str(toml), "--model", str(tmp_path / "nowhere")]) == 0
    out = capsys.readouterr().out
    assert f"config: {toml}" in out and "valid" in out
    assert "scheduler.policy" in out and "priority  (baton-core" in out
    assert "nowhere (not loaded)" in out


def test_config_check_json(tmp_path, capsys):
    assert main(["config", "check", "--json", "--policy", "fcfs"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["ok"] is True
    assert {"kind": "scheduler_policy", "name": "fcfs"}.items() <= result["selected"][0].items()


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (
            ["--policy", "priority", "--set", "scheduler.priority.x=1"],
            "scheduler.priority: scheduler policy 'priority' takes no settings",
        ),
        (["--policy", "nope"], "scheduler policy 'nope' is not installed"),
        (["--set", "cache.block_size=0"], "cache.block_size: Input should be greater than 0"),
        (["--set", "transport.zmq.hvm=3"], "transport.zmq.hvm: unknown setting of transport 'zmq'"),
    ],
)
def test_config_check_prints_the_errors_and_fails(argv, fragment, capsys):
    assert main(["config", "check", *argv]) == 1
    captured = capsys.readouterr()
    assert fragment in captured.err
    assert "Traceback" not in captured.err


def test_config_check_reports_value_errors_and_plugin_problems_at_once(tmp_path, capsys):
    toml = tmp_path / "baton.toml"
    toml.write_text(
        '[model]\nmax_model_len = "lots"\n'  # its default is None: still put back
        "[cache]\nblock_size = 0\n"
        '[scheduler]\npolicy = "nope"\nmax_num_seqs = -1\n'
        "[transport.zmq]\nhvm = 3\n"
    )
    assert main(["config", "check", str(toml), "--set", "executor.num_threads=0"]) == 1
    err = capsys.readouterr().err
    assert "6 problems in the configuration" in err and "were not checked" not in err
    for fragment in (
        "model.max_model_len: Input should be a valid integer",
        "cache.block_size: Input should be greater than 0 (got 0)",
        "scheduler.max_num_seqs: Input should be greater than 0 (got -1)",
        "executor.num_threads: Input should be greater than 0",
        "scheduler policy 'nope' is not installed",
        "transport.zmq.hvm: unknown setting of transport 'zmq'",
    ):
        assert fragment in err, fragment
    assert main(["config", "check", str(toml), "--json"]) == 1
    result = json.loads(capsys.readouterr().out)
    assert result["ok"] is False and len(result["problems"]) == 5
    assert result["problems"][0].endswith(
        "model.max_model_len: Input should be a valid "
        "integer, unable to parse string as an integer (got 'lots')"
    )
    assert "scheduler policy 'nope'" in result["problems"][3]


def test_config_check_stops_before_the_plugins_on_a_check_across_sections(capsys):
    argv = ["--set", "model.quantization=int8", "--set", "executor.tensor_parallel_size=2"]
    assert main(["config", "check", *argv, "--policy", "nope"]) == 1
    err = capsys.readouterr().err
    assert "tensor-parallel shards are not quantized" in err
    assert "the plugins were not checked" in err and "'nope'" not in err


def test_config_check_reads_the_environment(monkeypatch, capsys):
    monkeypatch.setenv("BATON_SCHEDULER__POLICY", "no-such-policy")
    assert main(["config", "check"]) == 1
    assert "scheduler policy 'no-such-policy' is not installed" in capsys.readouterr().err


def test_config_check_refuses_two_different_files(tmp_path, capsys):
    a, b = tmp_path / "a.toml", tmp_path / "b.toml"
    a.write_text(""), b.write_text("")
    assert main(["config", "check", str(a), "--config", str(b)]) == 1
    assert "two config files" in capsys.readouterr().err


def test_generate_refuses_a_bad_config_before_loading_anything(tmp_path):
    """The model does not exist: an error about the config proves nothing was loaded first."""
    code = (
        "import sys\n"
        "from baton.cli.main import main\n"
        f"rc = main(['generate', 'hi', '--model', {str(tmp_path / 'nowhere')!r},"
        " '--policy', 'priority', '--set', 'scheduler.priority.x=1'])\n"
        "print(rc, 'transformers' in sys.modules)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.stdout.split() == ["1", "False"], proc.stderr
    assert "scheduler.priority: scheduler policy 'priority' takes no settings" in proc.stderr
