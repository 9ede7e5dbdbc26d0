"""The config's plugins, checked before anything loads: what it selects is installed, every
sub-table belongs to an installed plugin and passes that plugin's settings model.

``check_config_plugins`` is the one check: ``baton config check`` prints its result, ``LLM`` /
``AsyncLLM`` run it before the tokenizer and the weights load, and ``EngineCore`` runs it
before the executor starts. What it knows about each kind comes from
``baton.plugins.kinds.PLUGIN_KINDS``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from baton.config import BatonConfig
from baton.config.overrides import all_section_models
from baton.errors import BatonError, ConfigError
from baton.plugins.kinds import BY_SECTION, PLUGIN_KINDS, PluginKind
from baton.plugins.registry import ChosenPlugin, Registry


class Selected(msgspec.Struct, frozen=True):
    """One plugin the config selects, and its validated settings (None: it takes none)."""

    kind: str
    name: str
    selected_by: str  # the config field, e.g. "scheduler.policy"
    distribution: str
    version: str
    settings: dict[str, Any] | None = None


def check_config_plugins(
    config: BatonConfig, registry: Registry, skip: frozenset[str] = frozenset()
) -> list[Selected]:
    """The plugins ``config`` selects, or one error listing every problem.

    Checks: each selected name is installed (PluginNotFoundError naming what is installed and
    what to install); each extra key of a section is the sub-table of an installed plugin of
    that section's kind; every such sub-table, and the defaults of each selected plugin's
    settings model, pass validation (unknown keys refused, ConfigError naming the key, the
    plugin and its settings). ``skip``: kinds the caller supplies itself (an executor instance).
    The error raised has the type of the first problem found and the text of all of them.
    """
    selected, errors = find_plugin_problems(config, registry, skip)
    if errors:
        raise combined(errors)
    return selected


def find_plugin_problems(
    config: BatonConfig, registry: Registry, skip: frozenset[str] = frozenset()
) -> tuple[list[Selected], list[BatonError]]:
    """``check_config_plugins``'s checks: the plugins that passed, and every problem found."""
    chosen, errors = find_chosen_plugins(config, registry, skip)
    return [_selection(c) for c in chosen], errors


def find_chosen_plugins(
    config: BatonConfig,
    registry: Registry,
    skip: frozenset[str] = frozenset(),
    given: Sequence[ChosenPlugin] = (),
) -> tuple[list[ChosenPlugin], list[BatonError]]:
    """The checks, keeping what passed as registry entries with their validated settings
    (in ``PLUGIN_KINDS`` order, a list selector's names in the config's order). ``given``:
    selected plugins the caller already resolved, kept as they are (not validated again)."""
    errors: list[BatonError] = []
    chosen: list[ChosenPlugin] = []
    done: set[tuple[str, str]] = set()  # (kind, name) whose sub-table was checked
    ready = {(c.entry.kind, c.name): c for c in given}
    for kind in PLUGIN_KINDS.values():
        if kind.name in skip:
            continue
        for name in _selected_names(kind, config, registry):
            done.add((kind.name, name))
            if (kind.name, name) in ready:
                chosen.append(ready[(kind.name, name)])
                continue
            try:
                entry = registry.get(kind.name, name)
                settings = entry.settings(config)
            except BatonError as e:
                errors.append(e)
                continue
            chosen.append(ChosenPlugin(entry, settings))
    for section in all_section_models():  # the sections plugins register too ([server])
        errors += _check_sub_tables(config, section, registry, done)
    return chosen, errors


def _selected_names(kind: PluginKind, config: BatonConfig, registry: Registry) -> list[str]:
    if kind.name == "structured_output":
        name = resolve_structured_output_backend(config, registry)
        return [] if name is None else [name]
    return kind.selected(config)


def _selection(chosen: ChosenPlugin) -> Selected:
    entry, settings = chosen.entry, chosen.settings
    return Selected(
        kind=entry.kind,
        name=entry.name,
        selected_by=PLUGIN_KINDS[entry.kind].selector_path(),
        distribution=entry.distribution,
        version=entry.version,
        settings=None if settings is None else settings.model_dump(mode="json"),
    )


def _check_sub_tables(
    config: BatonConfig, section: str, registry: Registry, done: set[tuple[str, str]]
) -> list[BatonError]:
    """An extra key of ``section`` must be an installed plugin's valid settings table (a plugin
    of any kind that section configures: ``[executor.ray]`` is the ray executor's and the ray
    engine launcher's)."""
    kinds = [k for k in PLUGIN_KINDS.values() if k.section == section]
    kind = BY_SECTION.get(section)
    extras = getattr(config, section).model_extra or {}
    installed = sorted({n for k in kinds for n in registry.names(k.name)})
    errors: list[BatonError] = []
    for key in extras:
        if key not in installed:
            fields = ", ".join(type(getattr(config, section)).model_fields)
            plugins = (
                f"; {kind.word} sub-tables: {', '.join(installed) or 'none installed'}"
                if kind
                else ""
            )
            errors.append(
                ConfigError(f"{section}.{key}: unknown setting (fields: {fields}{plugins})")
            )
            continue
        if any((k.name, key) in done for k in kinds):
            continue  # checked as a selected plugin (the kinds of a section share its tables)
        owner = next(k for k in kinds if key in registry.names(k.name))
        try:
            registry.get(owner.name, key).settings(config)
        except BatonError as e:
            errors.append(e)
    return errors


def combined(errors: list[BatonError]) -> BatonError:
    """One error for ``errors``: the first's type, every message."""
    if len(errors) == 1:
        return errors[0]
    lines = "\n".join(f"  - {str(e).replace(chr(10), chr(10) + '    ')}" for e in errors)
    return type(errors[0])(f"{len(errors)} problems in the configuration:\n{lines}")


def resolve_structured_output_backend(config: BatonConfig, registry: Registry) -> str | None:
    """The backend name to use, or None when none is installed ("auto") or it is turned off ("none")."""
    name = config.structured_output.backend
    if name == "none":
        return None
    if name == "auto":
        names = registry.names("structured_output")
        return "xgrammar" if "xgrammar" in names else (names[0] if names else None)
    return name
