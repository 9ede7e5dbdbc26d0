"""baton's configuration: one pydantic-settings model, eleven sections, plus the sections plugins
register (``register_config_sections``: baton-plugin-openai's ``[server]``).

Sources, strongest first: explicit arguments (``LLM(**overrides)``, CLI flags),
``BATON_<SECTION>__<FIELD>`` environment variables, a TOML or YAML file (given
with ``--config`` or ``BATON_CONFIG``), defaults. A plugin's own settings sit in
a sub-table named after it (``[transport.zmq]``) and are validated by the
settings model the plugin registered (see ``BatonConfig.plugin_settings``).

- ``sections``: one model per section (``ModelSection``, ...).
- ``baton_config``: ``BatonConfig`` (sources, checks across sections, plugin sub-tables).
- ``overrides``: the keyword forms ``load`` / ``replace`` accept.
- ``messages``: how a refused value is worded.

The public names (docs/stability.md) are importable from ``baton.config``.
"""

import warnings
from typing import Any

from baton import config_sections
from baton.config.baton_config import BatonConfig
from baton.config.sections import (
    CacheSection,
    ExecutorSection,
    KVEventsSection,
    KVTransferSection,
    LoRASection,
    ModelSection,
    ObservabilitySection,
    RoutingSection,
    SchedulerSection,
    ServingSettings,
    SpeculativeSection,
    StructuredOutputSection,
    TransportSection,
)

__all__ = [
    "BatonConfig",
    "CacheSection",
    "ExecutorSection",
    "KVEventsSection",
    "KVTransferSection",
    "LoRASection",
    "ModelSection",
    "ObservabilitySection",
    "RoutingSection",
    "SchedulerSection",
    "ServingSettings",
    "SpeculativeSection",
    "StructuredOutputSection",
    "TransportSection",
]


def __getattr__(name: str) -> Any:
    # ServerSection moved to baton-plugin-openai (issue 31): a release of warning
    # (docs/stability.md), found through the registry so that baton-core imports no plugin
    if name == "ServerSection" and "server" in config_sections.registered():
        warnings.warn(
            "baton.config.ServerSection moved to baton_openai.server_section.ServerSection "
            "(baton-plugin-openai); import it from there",
            DeprecationWarning,
            stacklevel=2,
        )
        return config_sections.registered()["server"]
    raise AttributeError(f"module 'baton.config' has no attribute {name!r}")
