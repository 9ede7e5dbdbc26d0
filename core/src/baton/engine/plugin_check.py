"""Start-up check: every plugin the config names is installed, every sub-table belongs to one."""

from __future__ import annotations

from baton.config import PLUGIN_SELECTORS, BatonConfig
from baton.plugins import Registry

#: config section -> the plugin kind whose names may appear as its sub-tables
SECTION_KINDS = {section: kind for kind, (section, _) in PLUGIN_SELECTORS.items()} | {
    "observability": "stat_logger"
}


def check_config_plugins(
    config: BatonConfig, registry: Registry, skip: frozenset[str] = frozenset()
) -> None:
    """Raise PluginNotFoundError / ConfigError naming the field when the config asks for a missing plugin.

    ``skip``: plugin kinds the caller supplies itself (e.g. an executor instance).
    """
    for kind, (section, field) in PLUGIN_SELECTORS.items():
        name = getattr(getattr(config, section), field)
        if kind in skip:
            continue
        if kind == "structured_output" and name in ("auto", "none"):
            continue
        registry.get(kind, name)
    for name in config.observability.stat_loggers:
        registry.get("stat_logger", name)
    config.check_extras(
        {section: set(registry.names(kind)) for section, kind in SECTION_KINDS.items()}
    )


def resolve_structured_output_backend(config: BatonConfig, registry: Registry) -> str | None:
    """The backend name to use, or None when none is installed ("auto") or it is turned off ("none")."""
    name = config.structured_output.backend
    if name == "none":
        return None
    if name == "auto":
        names = registry.names("structured_output")
        return "xgrammar" if "xgrammar" in names else (names[0] if names else None)
    return name
