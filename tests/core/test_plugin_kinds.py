"""One record per plugin kind (baton.plugins.kinds): the registry, config selection, hints,
hookspecs' types and docs/hooks.md's kind list all agree with it."""

from __future__ import annotations

import inspect
import re
import tomllib
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel

from baton import hookimpl
from baton.errors import PluginLoadError, PluginNotFoundError
from baton.plugins import hookspecs, registry
from baton.plugins import kinds as plugin_kinds
from baton.plugins.kinds import PLUGIN_KINDS, Register, markdown_table
from baton.plugins.registry import Plugins

ROOT = Path(__file__).resolve().parents[2]
HOOKS_MD = ROOT / "docs" / "hooks.md"


def loaded() -> Plugins:
    p = Plugins()
    p.load_entry_points({})
    return p


def first_party_distributions() -> set[str]:
    """The distribution names of the folders under plugins/ and contrib/."""
    return {
        tomllib.loads(p.read_text())["project"]["name"]
        for folder in ("plugins", "contrib")
        for p in (ROOT / folder).glob("*/pyproject.toml")
    }


def test_registry_and_config_tables_derive_from_the_record():
    assert set(registry.KINDS) == {k.hook for k in PLUGIN_KINDS.values()}
    assert set(registry.KINDS.values()) == set(PLUGIN_KINDS)
    assert {
        (k.name, n): d for k in PLUGIN_KINDS.values() for n, d in k.distributions.items()
    } == registry.KNOWN_DISTRIBUTIONS
    assert plugin_kinds.PLUGIN_SELECTORS == {
        "scheduler_policy": ("scheduler", "policy"),
        "executor": ("executor", "backend"),
        "engine_launcher": ("executor", "data_parallel_backend"),
        "transport": ("transport", "name"),
        "structured_output": ("structured_output", "backend"),
        "speculator": ("speculative", "method"),
        "kv_connector": ("kv_transfer", "connector"),
        "router": ("routing", "router"),
    }
    hooks = {
        name
        for name, fn in inspect.getmembers(hookspecs, inspect.isfunction)
        if hasattr(fn, "baton_spec")
    }
    assert hooks == set(registry.KINDS)


def test_every_distribution_in_the_record_is_a_first_party_folder():
    """The hint must name a distribution that exists: no 'baton-plugin-cuda' any more."""
    real = first_party_distributions()
    for kind in PLUGIN_KINDS.values():
        for name, dist in kind.distributions.items():
            assert dist in real, f"{kind.name} {name!r}: {dist} is not under plugins/ or contrib/"
    assert "cuda" not in PLUGIN_KINDS["executor"].distributions


def test_installed_names_match_the_record():
    """Every name baton-core or a first-party distribution registers is in the record, with
    the distribution that really provides it (all of them are installed by make setup)."""
    reg = loaded().registry
    ours = first_party_distributions() | {"baton-core"}
    for (kind_name, name), entry in reg.entries.items():
        if entry.distribution not in ours:
            continue
        kind = PLUGIN_KINDS[kind_name]
        if entry.distribution == "baton-core":
            assert name in kind.builtin, f"baton-core registers {kind_name} {name!r}; add it"
        else:
            assert kind.distributions.get(name) == entry.distribution, (kind_name, name)
    for kind in PLUGIN_KINDS.values():
        for name in kind.builtin:
            assert reg.get(kind.name, name).distribution == "baton-core"


def test_missing_name_hint_comes_from_the_record():
    reg = Plugins().registry  # nothing loaded: every name is missing
    with pytest.raises(
        PluginNotFoundError, match=r"executor 'cuda-tp' .* pip install baton-plugin-cuda-tp"
    ):
        reg.get("executor", "cuda-tp")
    with pytest.raises(PluginNotFoundError, match="install the distribution that provides it"):
        reg.get("executor", "cuda")
    with pytest.raises(PluginNotFoundError, match="structured-output backend 'xgrammar'"):
        reg.get("structured_output", "xgrammar")


@pytest.mark.parametrize("kind", list(PLUGIN_KINDS.values()), ids=lambda k: k.name)
def test_hookspec_register_is_typed_with_the_kinds_factory(kind):
    fn = getattr(hookspecs, kind.hook)
    hints = typing.get_type_hints(fn, localns=vars(plugin_kinds))
    assert hints["register"] == Register[kind.factory]


@pytest.mark.parametrize("kind", list(PLUGIN_KINDS.values()), ids=lambda k: k.name)
def test_installed_factories_take_their_protocols_arguments(kind):
    """Each registered factory can be called as its kind's protocol calls it."""
    params = list(inspect.signature(kind.factory.__call__).parameters)[1:]  # without self
    entries = loaded().registry.of_kind(kind.name)
    assert entries
    for entry in entries:
        sig = inspect.signature(entry.factory)
        sig.bind(*params)  # TypeError names the factory that cannot take them


def test_docs_hooks_md_kind_list_is_the_record():
    text = HOOKS_MD.read_text()
    m = re.search(
        r"<!-- kinds: python -m baton.plugins.kinds -->\n(.*?)<!-- /kinds -->", text, re.S
    )
    assert m, "docs/hooks.md lost its kind list markers"
    assert m.group(1) == markdown_table(), (
        "docs/hooks.md's kind list is stale: paste `python -m baton.plugins.kinds` between the markers"
    )


def test_each_hook_sections_built_in_line_names_the_records_names():
    text = HOOKS_MD.read_text()
    for kind in PLUGIN_KINDS.values():
        section = text.split(f"## `{kind.hook}(register)`", 1)[1].split("\n## ", 1)[0]
        bullet = re.search(
            r"^- (?:Called once when the CLI starts\. )?Built in:(.*?)(?=^- |\n\n|\Z)",
            section,
            re.S | re.M,
        )
        assert bullet, f"the {kind.hook} section has no 'Built in:' bullet"
        names = {
            n
            for n in re.findall(r"`([^`]+)`", bullet.group(1))
            if "." not in n and not n.startswith("baton-")
        }
        assert names == set(kind.builtin) | set(kind.distributions), kind.hook


class _Settings(BaseModel):
    weight: int = 1


def _register_one(kind_hook: str, *args):
    class Plugin:
        pass

    def hook(self, register):
        register(*args)

    hook.__name__ = kind_hook
    setattr(Plugin, kind_hook, hookimpl(hook))
    p = Plugins()
    p.register(Plugin(), "badplug", "badplug-dist", "1.0")
    return p


@pytest.mark.parametrize(
    "hook, args, fragment",
    [
        (
            "register_commands",
            ("hello", lambda parser: None, _Settings),
            "commands are not configured",
        ),
        (
            "register_scheduler_policies",
            ("x", lambda c, s: None, dict),
            "pydantic BaseModel subclass",
        ),
        ("register_transports", ("x", "not a factory"), "is not callable"),
        ("register_executors", ("", lambda c, s: None), "non-empty string"),
    ],
)
def test_register_refuses_what_the_kind_cannot_take(hook, args, fragment):
    p = _register_one(hook, *args)
    with pytest.raises(PluginLoadError, match=fragment) as err:
        p.registry  # noqa: B018
    assert "plugin 'badplug' from badplug-dist" in str(err.value)


def test_a_settings_model_is_accepted_where_the_kind_has_a_sub_table():
    p = _register_one("register_scheduler_policies", "x", lambda c, s: None, _Settings)
    assert p.registry.get("scheduler_policy", "x").settings_model is _Settings


def test_an_entry_reads_its_settings_from_its_kinds_section():
    from baton.config import BatonConfig

    p = _register_one("register_scheduler_policies", "x", lambda c, s: None, _Settings)
    entry = p.registry.get("scheduler_policy", "x")
    assert entry.settings(BatonConfig.load(**{"scheduler.x.weight": 4})).weight == 4
    assert (
        entry.settings(BatonConfig.load(**{"transport.x.weight": 4})).weight == 1
    )  # not its table
    command = loaded().registry.get("command", "config")
    assert command.settings(BatonConfig.load()) is None  # commands have no section
